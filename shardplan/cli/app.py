"""The `shardplan` application: commands, global options, and errors -> exit codes.

CONTRACT, exit codes: 0 success, 1 infeasible, 2 bad input, 3 runtime failure. Bad input
never shows a traceback unless `--debug` (or SHARDPLAN_DEBUG=1) asks for one; with `--json`
stdout then carries the error document.

Start-up is most of what a planning command costs, so this module imports nothing heavy:
`--version` is answered before typer loads, and only the module of the command being run
is imported (all of them only for the command list: `--help`, an unknown command, shell
completion).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

from .. import __version__

# Every command and the module (shardplan/cli/<module>.py) whose `register(app)` adds it, in
# the order `--help` lists them. Adding a command is one line here.
COMMANDS = {
    "validate": "validate_cmd",
    "layout": "layout_cmd",
    "shards": "shards_cmd",
    "estimate": "estimate_cmd",
    "plan": "plan_cmd",
    "schedule": "schedule_cmd",
    "run": "run_cmd",
    "export": "export_cmd",
    "import": "import_cmd",
    "presets": "presets_cmd",
    "schema": "schema_cmd",
}

# Options of `shardplan` itself (none takes a value): the first other word names the command.
ROOT_FLAGS = ("--debug", "--version", "--help", "-h", "--install-completion", "--show-completion")
# typer's shell completion calls the program back with this variable set (click's
# `_{PROG}_COMPLETE` convention) and the words typed so far in COMP_WORDS / COMP_CWORD (bash)
# or _TYPER_COMPLETE_ARGS (zsh, fish, PowerShell).
COMPLETE_VAR = "_SHARDPLAN_COMPLETE"


def _completed_words() -> list[str]:
    """The words before the one being completed, program name left out."""
    if "COMP_WORDS" in os.environ:
        words = os.environ["COMP_WORDS"].split()
        cword = os.environ.get("COMP_CWORD", "")
        return words[1:int(cword)] if cword.isdigit() else words[1:-1]
    typed = os.environ.get("_TYPER_COMPLETE_ARGS", "")
    words = typed.split()[1:]
    return words if typed.endswith(" ") else words[:-1]


def command_names(argv: list[str]) -> list[str]:
    """The commands to build for this command line: the one it runs, or all of them. Shell
    completion builds the command already typed, or all of them to complete its name."""
    if os.environ.get(COMPLETE_VAR):
        argv = _completed_words()
    for arg in argv:
        if arg in ("--help", "-h") or arg == "--" or (arg.startswith("-") and arg not in ROOT_FLAGS):
            break  # the root's help lists every command
        if not arg.startswith("-"):
            return [arg] if arg in COMMANDS else list(COMMANDS)
    return list(COMMANDS)


def _plans_only(argv: list[str]) -> bool:
    """Whether the command line runs a short-lived planning command (anything but `run`, which
    trains): those run with the cyclic collector paused and end without the interpreter's
    teardown (`_end_process`)."""
    return command_names(argv) != ["run"]


def _debugging() -> bool:
    return os.environ.get("SHARDPLAN_DEBUG", "") not in ("", "0")


def _optional_values(argv: list[str]) -> list[str]:
    """`--resume` alone means the latest checkpoint; `--resume=PATH` names one (click has no
    options with an optional value)."""
    return ["--resume=latest" if arg == "--resume" else arg for arg in argv]


def _global_debug(argv: list[str]) -> list[str]:
    """`--debug` may stand anywhere before `--`: it is taken out and read here, so that
    `shardplan estimate job.toml --debug` works as `shardplan --debug estimate job.toml`."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[:end]:
        return argv
    os.environ["SHARDPLAN_DEBUG"] = "1"  # workers started by `run` inherit it
    return [arg for arg in argv[:end] if arg != "--debug"] + argv[end:]


def _usage_problem(exc, command: str):
    """A click usage error as a `Problem` whose path is the option or argument at fault."""
    from ..spec.errors import Problem

    param = getattr(exc, "param", None)
    path = getattr(exc, "option_name", None) or (param.opts[0] if param is not None and param.opts else "")
    if param is not None and not path:
        path = param.name or ""
    return Problem(path, f"{exc.format_message()} (see {command} --help)")


def _fail(lines: list[str], code: int, json_out: bool, problems: list | None = None) -> int:
    """Diagnostics on stderr and, with `--json`, the CONTRACT's error document on stdout."""
    from ..render.output import emit_diagnostics, emit_json, error_document

    emit_diagnostics(lines)
    if json_out:
        try:
            emit_json(error_document(problems if problems is not None else lines, code))
        except OSError:  # stdout's reader is gone (`| head`) or its disk full: the exit code still says it
            _quiet_stdout()
    return code


def _quiet_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush does
    not complain again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file (tests' StringIO)
        pass
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (the console script exits with it)."""
    argv = _optional_values(list(argv if argv is not None else sys.argv[1:]))
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:  # started with the descriptor closed: the output has nowhere to go
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))
    if argv == ["--version"]:  # instant: no typer, no pydantic
        sys.stdout.write(f"shardplan {__version__}\n")
        return 0
    saved_debug = os.environ.get("SHARDPLAN_DEBUG")
    # A planning command is a short-lived process whose objects (the modules' classes and
    # schemas, the job, a search's plans) are freed by reference counting: Python's cyclic
    # collector, which runs as they are made, frees next to nothing there. It is paused for
    # the command and restored after; `run`, which trains, keeps it.
    paused = gc.isenabled() and _plans_only(argv)
    if paused:
        gc.disable()
    try:
        return _main(_global_debug(argv))
    finally:  # in-process callers (tests) get their environment back
        if paused:
            gc.enable()
        if saved_debug is None:
            os.environ.pop("SHARDPLAN_DEBUG", None)
        else:
            os.environ["SHARDPLAN_DEBUG"] = saved_debug


def _command_path(exc, argv: list[str]) -> str:
    """`shardplan estimate` for a usage error of that command: click leaves the context out
    of some (an option given no value), which the command line then names."""
    if exc.ctx is not None:
        return exc.ctx.command_path
    names = command_names(argv)
    return f"shardplan {names[0]}" if len(names) == 1 else "shardplan"


def _main(argv: list[str]) -> int:
    end = argv.index("--") if "--" in argv else len(argv)
    json_out = "--json" in argv[:end]  # after `--` it is an argument: a file named --json
    from ..spec.errors import EXIT_BAD_INPUT, InputError, ShardplanError

    import typer

    from .root import build_app

    try:  # typer >= 0.20 vendors click
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:  # pragma: no cover - older typer on top of click
        from click.exceptions import NoArgsIsHelpError, UsageError

    try:
        command = typer.main.get_command(build_app([COMMANDS[name] for name in command_names(argv)]))
        result = command.main(args=argv, prog_name="shardplan", standalone_mode=False)
    except NoArgsIsHelpError:  # the help is already printed
        return EXIT_BAD_INPUT
    except UsageError as exc:
        name = _command_path(exc, argv)
        line = f"{name}: {exc.format_message()} (see {name} --help)"
        return _fail([line], EXIT_BAD_INPUT, json_out, [_usage_problem(exc, name)])
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # typer's completion options exit by themselves
        if exc.code == 1 and type(sys.stdout).__name__ == "PacifyFlushWrapper":
            # click's answer to a broken pipe (EPIPE) in the command: it wraps the streams and
            # exits 1 (click/core.py, `Command.main`). A reader that left (`| head`) is no failure.
            _quiet_stdout()
            return 0
        return exc.code if isinstance(exc.code, int) else 0
    except typer.Abort:
        return _fail(["shardplan: interrupted"], 130, False)
    except ShardplanError as exc:
        show_traceback(exc)
        problems = exc.problems if isinstance(exc, InputError) else None
        return _fail(exc.lines(), exc.exit_code, json_out, problems)
    except KeyboardInterrupt:
        return _fail(["shardplan: interrupted"], 130, False)
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except OSError as exc:
        from ..io.writing import WRITE_FAILURES  # what a write that cannot be kept raises

        if exc.errno not in WRITE_FAILURES:
            return _internal_error(exc, json_out)
        _quiet_stdout()  # the output is lost: only stderr can say so
        return _fail([_lost_output(exc)], _lost_output_code(argv), False)
    except Exception as exc:  # an internal error: say so in one line, never a traceback
        return _internal_error(exc, json_out)
    return result if isinstance(result, int) else 0


def show_traceback(exc: BaseException) -> None:
    """Under `--debug` (or SHARDPLAN_DEBUG=1), the error's traceback on stderr before its usual
    lines; the exit code stays the one the contract gives the error."""
    if _debugging():
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def _lost_output(exc: OSError) -> str:
    return f"shardplan: could not write the output: {exc}"


def _lost_output_code(argv: list[str]) -> int:
    """The exit code of an output that cannot be written (a full disk): 2, as a file named by
    `--write` or `-o` that cannot be written (io/writing.py); under `run`, whose failures are
    exit 3 (CONTRACT), 3."""
    from ..spec.errors import EXIT_BAD_INPUT, EXIT_RUNTIME

    return EXIT_BAD_INPUT if _plans_only(argv) else EXIT_RUNTIME


def _internal_error(exc: Exception, json_out: bool) -> int:
    """An internal error: one line, never a traceback (`--debug` shows it)."""
    from ..spec.errors import EXIT_RUNTIME

    show_traceback(exc)
    hint = "" if _debugging() else " (rerun with --debug)"
    line = f"shardplan: internal error: {type(exc).__name__}: {exc}{hint}"
    return _fail([line], EXIT_RUNTIME, json_out)


def main_exit() -> None:
    """Console-script entry point (and `python -m shardplan`)."""
    code = main()
    if _plans_only(sys.argv[1:]):
        _end_process(code)
    sys.exit(code)


def _end_process(code: int) -> None:
    """End a planning command's process without tearing the interpreter down. Teardown frees,
    one by one, every object still alive (the modules, their classes and schemas, a search's
    caches) for memory the operating system takes back anyway: 5-8% of a planning command
    (benchmarks/bench_plan.py). What a normal exit does that matters still happens: the
    `atexit` handlers run and the standard streams are flushed; files the command wrote are
    closed already, and no planning command starts a thread that would still run. An output
    that cannot be written (a full disk) fails the command with one line, as a normal exit
    would not say; a reader that left (`| head`) is no failure. `run`, which trains, exits
    normally."""
    gc.disable()
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython: what a normal exit calls
    if run_handlers is not None:
        run_handlers()
    for stream in (sys.stdout, sys.stderr):  # never None: `main` gave closed ones devnull
        try:
            stream.flush()
        except BrokenPipeError:  # the reader left: as a broken pipe during the command
            pass
        except ValueError:  # already closed: nothing is buffered
            pass
        except OSError as exc:  # the output is lost
            if stream is sys.stdout:
                from ..spec.errors import EXIT_BAD_INPUT

                code = EXIT_BAD_INPUT  # only planning commands end here: as `_lost_output_code`
                try:
                    sys.stderr.write(_lost_output(exc) + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
    os._exit(code if isinstance(code, int) and 0 <= code <= 255 else 1)
