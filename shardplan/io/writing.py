"""Files the commands write (`plan --write`, `export -o`, `import -o`, `schedule --svg`): the
path checked before the work, and a write that never leaves a file half-written.

A regular file (or a new one) is written to a temporary file beside it, then renamed over
it: a failed write leaves the old file as it was and no temporary file behind. A target that
is not a regular file (`/dev/stdout`, a pipe, `/dev/full`) is written directly. A path that
cannot be written (no such folder, a folder, no permission) and a write that fails on the
way (a full disk, a quota, a file too large) are both exit 2 in one line naming the flag
(`--write: cannot write 'best.toml': No space left on device`): the CONTRACT keeps exit 3 for
`run`. `-` names stdout, as in most command-line tools, where the command has stdout free for
the file (`output_target`).

A job file written somewhere else than the file it comes from keeps naming the same files:
`relocate_job_paths` rewrites its relative paths for the folder it is written to."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Sequence

from ..spec.errors import InputError, Problem

# What a write raises when the output cannot be kept, as against a path that cannot be
# written at all (cli/app.py reads these as a lost stdout).
WRITE_FAILURES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


# The job keys whose relative paths the loader resolves against the job file's folder
# (io/job.py `resolve_document`). `checkpoint.dir` is not one: `run` uses it from the working
# directory as written, so a written job keeps it as it is.
JOB_PATH_KEYS = (("model", "hf_config"), ("data", "path"))


# Paths that name a process's streams (`/dev/stdout` may lead to a regular file the shell
# redirected it to, which a rename must not replace): written directly.
_STREAMS = ("/dev/", "/proc/")


def _unwritable(path: str, flag: str, reason: str) -> InputError:
    return InputError(Problem(flag, f"cannot write {path!r}: {reason}"))


def _failed(path: str, flag: str, exc: OSError) -> InputError:
    """A write that failed, before or on the way (a full disk: WRITE_FAILURES): exit 2."""
    return _unwritable(path, flag, exc.strerror or str(exc))


def check_writable(path: str, flag: str) -> None:
    """Bad input, before any work, if `path` names no file this process can write: empty,
    a folder, in a folder that does not exist or that it may not write in, or a file it may
    not write."""
    if not path:
        raise InputError(Problem(flag, "needs a file name (got an empty one)"))
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a path through a file (ENOTDIR), too long, a loop
        raise _unwritable(path, flag, exc.strerror or str(exc)) from None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise _unwritable(path, flag, os.strerror(errno.EISDIR))
        if not os.access(path, os.W_OK):
            raise _unwritable(path, flag, os.strerror(errno.EACCES))
        return
    if path.endswith(("/", os.sep)):  # a folder that does not exist, not a file (open() refuses it too)
        raise _unwritable(path, flag, os.strerror(errno.EISDIR))
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        raise _unwritable(path, flag, os.strerror(errno.ENOENT if not os.path.exists(folder) else errno.ENOTDIR))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _unwritable(path, flag, os.strerror(errno.EACCES))


def folder_problem(folder: str) -> str | None:
    """Why `folder` is no folder this process can write files into, nor one it can make (a
    file there or above it, no write permission), else None: what `check_writable` asks of a
    file, for a folder written later (`run`'s checkpoints)."""
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            return f"{folder!r} is a file, not a folder"
        return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder!r} is not writable"
    above = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(above) and above != os.path.dirname(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{folder!r} cannot be made: {above!r} is a file"
    return None if os.access(above, os.W_OK | os.X_OK) else f"{folder!r} cannot be made: {above!r} is not writable"


# The name that means stdout for an output flag (POSIX utility convention, as `tar -f -`).
STDOUT = "-"


def output_target(path: str | None, flag: str, stdout_holds: str | None = None) -> str | None:
    """The file an output flag names, checked before any work (`check_writable`), or None for
    stdout: the flag left out, or `-`. A command that prints its own output on stdout names it
    in `stdout_holds`, and there `-` is refused rather than mixed into it."""
    if path is None:
        return None
    if path == STDOUT:
        if stdout_holds:
            raise InputError(Problem(flag, f"'-' would write to stdout, which holds {stdout_holds}: "
                                           "name a file (or /dev/stdout to have both there)"))
        return None
    check_writable(path, flag)
    return path


def refuse_overwriting_input(path: str | None, source: str, flag: str, written: str) -> None:
    """Bad input when the output flag names the file the command reads (`import ds.json -o
    ds.json`): the write would replace it with another kind of file. Any name of it counts (a
    link, another path), as the file system sees it."""
    if not path or not source:
        return
    try:
        same = os.path.samefile(path, source)
    except (OSError, ValueError):  # the output does not exist yet, or a name no file can have
        return
    if same:
        raise InputError(Problem(flag, f"{path!r} is the input file: writing {written} there would replace it; "
                                       "name another file"))


def job_folders(source: str, overrides: Sequence[tuple[str, object]] = (),
                config_as_job: bool = False) -> dict[tuple[str, str], str]:
    """The folder each of JOB_PATH_KEYS is meant from, as the loader (io/job.py
    `resolve_document`) and `run` resolve it: the job file's, but the working directory for a
    job with no file, a key given on the command line, and the model of a Hugging Face
    config.json read as a job."""
    flagged = {path for path, _ in overrides}
    here = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()
    folders = {}
    for table, key in JOB_PATH_KEYS:
        from_cwd = f"{table}.{key}" in flagged or (config_as_job and table == "model")
        folders[table, key] = os.getcwd() if from_cwd else here
    return folders


def relocate_job_paths(data: dict, folders: dict[tuple[str, str], str], target: str) -> dict:
    """A copy of the job `data` whose relative paths (JOB_PATH_KEYS), meant from `folders`,
    name the same files from the folder of `target`, the file it is written to: relative
    where a relative path exists (os.path.relpath; folders through links as the system walks
    them), else absolute. A target that is a stream (`/dev/stdout`, a pipe) may land anywhere:
    absolute paths."""
    result = dict(data)
    there = None if _is_stream(target) else os.path.realpath(os.path.dirname(os.path.abspath(target)))
    for table, key in JOB_PATH_KEYS:
        here = os.path.realpath(folders[table, key])
        section = result.get(table)
        value = section.get(key) if isinstance(section, dict) else None
        if not isinstance(value, str) or not value or os.path.isabs(value) or here == there:
            continue
        head, tail = os.path.split(os.path.join(here, value))
        # The folder through its links, the file's own name kept (a link to a config stays one).
        named = (os.path.join(os.path.realpath(head), tail) if tail not in ("", ".", "..")
                 else os.path.realpath(os.path.join(head, tail)))
        try:
            moved = os.path.relpath(named, there) if there is not None else named
        except ValueError:  # another drive (Windows): no relative path leads there
            moved = named
        result[table] = {**section, key: moved}
    return result


def _is_stream(path: str) -> bool:
    """A target that is no regular file: written directly, wherever it leads (`write_text`)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    return (mode is not None and not stat.S_ISREG(mode)) or os.path.abspath(path).startswith(_STREAMS)


def write_text(path: str, text: str, flag: str) -> None:
    """Write `text` (UTF-8) to `path` whole, or leave what was there (see the module)."""
    check_writable(path, flag)
    data = text.encode("utf-8")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if _is_stream(path):
        _write_directly(path, data, flag)
        return
    target = os.path.realpath(path)  # through a link: the file it names, the link kept
    folder, name = os.path.split(target)
    try:
        temp, fd = _temporary(folder, name)
    except OSError as exc:
        if mode is not None and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            # A file it may write in a folder it may not add to: written in place.
            _write_directly(path, data, flag)
            return
        raise _failed(path, flag, exc) from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if mode is not None:
                os.fchmod(fd, stat.S_IMODE(mode))  # the file keeps its permissions
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except OSError as exc:
        _remove(temp)
        raise _failed(path, flag, exc) from None
    except BaseException:
        _remove(temp)
        raise


def _temporary(folder: str, name: str) -> tuple[str, int]:
    """A new file beside the target, created with the permissions a new file gets (the umask
    applies); hidden, and named after the target."""
    while True:
        temp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return temp, os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue


def _write_directly(path: str, data: bytes, flag: str) -> None:
    try:
        with open(path, "wb") as out:
            out.write(data)
    except OSError as exc:
        raise _failed(path, flag, exc) from None


def _remove(temp: str) -> None:
    try:
        os.unlink(temp)
    except OSError:
        pass
