"""Reading job files (TOML or JSON) into plain dicts, with the line of every key.

Every failure becomes an `InputError` naming the file: missing, a directory, a pipe or
another thing that is no regular file, unreadable, not text, too large, malformed.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..spec.errors import InputError, Problem

# A job file is a few dozen lines; anything this large is not one (and reading it whole
# would be the first mistake).
MAX_FILE_BYTES = 8 * 2**20

_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
_PART = r"(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"  # a bare or quoted key (`"tp" = 2`)
_KEY = re.compile(rf"^\s*({_PART}(?:\s*\.\s*{_PART})*)\s*=")
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column \d+\)\s*$")
_TOML_EOF = re.compile(r"\s*\(at end of document\)\s*$")
# Editors on Windows (Notepad, PowerShell's `Out-File -Encoding utf8`) start UTF-8 files with a
# byte order mark, which tomllib and json reject; it carries nothing, so it is dropped.
_BOM = "\ufeff"


@dataclass
class Document:
    """A parsed file: its data and the line where each dotted key was written."""

    path: str
    data: dict
    lines: dict[str, int] = field(default_factory=dict)

    def line_of(self, path: str) -> int | None:
        """The line of `a.b.c`, else of its closest written parent, else None."""
        parts = path.split(".")
        while parts:
            line = self.lines.get(".".join(parts))
            if line is not None:
                return line
            parts.pop()
        return None


def toml_key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line, for tables and keys written one per line."""
    lines: dict[str, int] = {}
    prefix = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header and not line.lstrip().startswith("[["):
            prefix = ".".join(p.strip().strip("\"'") for p in header.group(1).split("."))
            lines.setdefault(prefix, number)
            continue
        key = _KEY.match(line)
        if key:
            parts = [p.strip().strip("\"'") for p in key.group(1).split(".")]
            for end in range(1, len(parts) + 1):  # `dp.x = 1` also writes the table dp here
                dotted = ".".join(parts[:end])
                lines.setdefault(f"{prefix}.{dotted}" if prefix else dotted, number)
    return lines


def unreadable_kind(mode: int) -> str | None:
    """What a file of `mode` is when it is none that an input may be, else None. A regular
    file is read, and a character device too (`/dev/null`, `/dev/zero`: the read is bounded);
    a FIFO is not, as open() waits for a writer that may never come, nor a socket or a
    block device (a disk is no job file)."""
    if stat.S_ISREG(mode) or stat.S_ISCHR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "an unknown kind of file"  # a door or an event port (Solaris): nothing a job can be


def unreadable_path_kind(path: str | Path) -> str | None:
    """`unreadable_kind` of what `path` names, looked at without opening it; None for a
    directory or a path that cannot be looked at (their open() says what is wrong)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISDIR(mode) else unreadable_kind(mode)


def _read_text(path: Path, shown: str) -> str:
    def fail(message: str) -> InputError:
        return InputError(Problem("", message, file=shown))

    try:
        if path.is_dir():
            raise fail("is a directory, not a file")
        if not path.exists():
            raise fail("no such file")
        status = path.stat()  # before open(): a FIFO's open() blocks until a writer comes
        kind = unreadable_kind(status.st_mode)
        if kind:
            raise fail(f"is {kind}, not a regular file")
        size = status.st_size
        if size > MAX_FILE_BYTES:
            raise fail(f"is {size} bytes: too large for a job file")
        with path.open("rb") as stream:  # a device (/dev/zero) states no size and never ends
            raw = stream.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise fail(f"holds more than {MAX_FILE_BYTES} bytes: too large for a job file")
    except PermissionError:
        raise fail("permission denied") from None
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror or exc}") from None
    if b"\x00" in raw:
        raise fail("is a binary file, not TOML or JSON")
    try:
        return raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise fail(f"is not UTF-8 text (invalid byte at offset {exc.start})") from None


def longest_int_digits() -> int:
    """The most digits Python turns into an integer (`sys.set_int_max_str_digits`; 0: no limit)."""
    return getattr(sys, "get_int_max_str_digits", lambda: 0)()


def _long_number(text: str, language: str, shown: str) -> InputError:
    """The error for a number too long to read, at the line that holds it."""
    limit = longest_int_digits()
    found = re.search(rf"[0-9_]{{{limit + 1},}}", text) if limit else None
    line = text.count("\n", 0, found.start()) + 1 if found else None
    return InputError(Problem("", f"invalid {language}: a number of more than {limit} digits", file=shown, line=line))


def unreadable(exc: OSError) -> InputError:
    """An OSError met while looking at a path the input names (a name too long for the file
    system, a folder this user may not search) as the bad input it is, naming the path."""
    shown = os.fsdecode(exc.filename) if exc.filename is not None else None
    return InputError(Problem("", f"cannot read: {exc.strerror or exc}", file=shown))


def parse_toml(text: str, shown: str) -> Document:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = None
        position = _TOML_POSITION.search(message)
        if position:
            line = int(position.group(1))
            message = message[: position.start()]
        message = _TOML_EOF.sub("", message)
        from .toml_twice import toml_given_twice  # only on an error: not on a planning command's path

        twice = toml_given_twice(text, message, line, shown) if line else None
        raise (twice or InputError(Problem("", f"invalid TOML: {message}", file=shown, line=line))) from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise InputError(Problem("", "invalid TOML: nested too deeply", file=shown)) from None
    except ValueError:  # an integer longer than Python converts (TOML's are 64-bit)
        raise _long_number(text, "TOML", shown) from None
    return Document(shown, data, toml_key_lines(text))


def json_key_lines(text: str, shown: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line of every object key in a JSON text (keys inside arrays
    are left out). A small scanner: `json` itself keeps no positions. Without `shown`, a key
    given twice is at its last line; with it, a key given twice in
    one object is refused at both its lines (naming `shown`): `json` keeps the last silently,
    where TOML refuses it and so does DeepSpeed (runtime/config.py,
    `dict_raise_error_on_duplicate_keys`)."""
    lines: dict[str, int] = {}
    stack: list[str | None] = []  # per open container: the key it was reached by (None: array)
    given: list[dict[str, int]] = []  # per open container: its keys so far, with their lines
    line, i, expecting_key, last_key = 1, 0, False, None
    while i < len(text):
        char = text[i]
        if char == "\n":
            line += 1
        elif char == '"':
            end, start_line = i + 1, line
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            string = text[i + 1:end]
            if expecting_key and None not in stack:
                last_key = json.loads(f'"{string}"') if "\\" in string else string
                path = ".".join([k for k in stack[1:] if k] + [last_key])
                if last_key in given[-1] and shown:
                    raise InputError(Problem(path, f"given twice (lines {given[-1][last_key]} and {start_line})",
                                             file=shown, line=start_line))
                given[-1][last_key] = start_line
                if shown:
                    lines.setdefault(path, start_line)
                else:  # the last of a key given twice is the one `json` keeps
                    lines[path] = start_line
            i = end
        elif char == "{":
            stack.append(last_key if stack else "")
            given.append({})
            expecting_key = True
        elif char == "[":
            stack.append(None)
            given.append({})
            expecting_key = False
        elif char in "}]":
            if stack:
                stack.pop()
                given.pop()
            expecting_key = False
        elif char == ",":
            expecting_key = bool(stack) and stack[-1] is not None
        elif char == ":":
            expecting_key = False
        i += 1
    return lines


def parse_json(text: str, shown: str, key_lines: bool = False) -> Document:
    """`key_lines`: the document keeps every key's line (a job file, a DeepSpeed config), and a
    key given twice in one object is refused there (`json_key_lines`), not the last one kept
    (as `json`, and transformers reading a config.json, keep it)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(Problem("", f"invalid JSON: {exc.msg}", file=shown, line=exc.lineno)) from None
    except RecursionError:
        raise InputError(Problem("", "invalid JSON: nested too deeply", file=shown)) from None
    except ValueError:  # an integer longer than Python converts
        raise _long_number(text, "JSON", shown) from None
    if not isinstance(data, dict):
        raise InputError(Problem("", "expected a JSON object at the top", file=shown))
    refuse_surrogates(data, shown, "JSON")
    return Document(shown, data, json_key_lines(text, shown) if key_lines else {})


def refuse_surrogates(data: dict, shown: str, syntax: str) -> None:
    """JSON's and YAML's `\ud800` escapes can leave half of a UTF-16 pair in a string, which no
    output can print (TOML refuses them itself): one line naming the first key that holds one."""
    stack: list[tuple[str, object]] = [("", data)]
    seen: set[int] = set()  # YAML's aliases are one object met many times: each is walked once
    while stack:
        path, value = stack.pop()
        if isinstance(value, (dict, list)):
            if id(value) in seen:
                continue
            seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                dotted = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _has_surrogate(key):
                    raise InputError(Problem(path, f"a key is not valid Unicode (an unpaired surrogate in "
                                                   f'"{key.encode("utf-8", "backslashreplace").decode()}")',
                                             file=shown))
                stack.append((dotted, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and _has_surrogate(value):
            shown_value = value.encode("utf-8", "backslashreplace").decode()
            raise InputError(Problem(path, f"not valid Unicode: {syntax}'s escape leaves an unpaired surrogate "
                                           f'in "{shown_value}"', file=shown))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_json(path: str | Path, shown: str | None = None, key_lines: bool = False) -> Document:
    """Parse a JSON file whatever its name. `key_lines`: the document keeps every key's line,
    a key given twice at its last, the one kept (a Hugging Face config.json, which
    transformers reads with `json` too)."""
    shown = shown or str(path)
    text = _read_text(Path(path), shown)
    doc = parse_json(text, shown)
    if key_lines:
        doc.lines = json_key_lines(text)
    return doc


def read_document(path: str | Path) -> Document:
    """Parse a TOML file (JSON when its name ends in .json) into a `Document`."""
    shown = str(path)
    text = _read_text(Path(path), shown)
    if shown.lower().endswith(".json"):
        return parse_json(text, shown, key_lines=True)
    return parse_toml(text, shown)
