"""The `shardplan` application: commands, global options, and errors -> exit codes.

CONTRACT, exit codes: 0 success, 1 infeasible, 2 bad input, 3 runtime failure. Bad input
never shows a traceback unless `--debug` (or SHARDPLAN_DEBUG=1) asks for one.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import NoArgsIsHelpError, UsageError

from .. import __version__
from ..spec.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, ShardplanError
from ..render.output import emit_diagnostics
from . import (
    estimate_cmd,
    export_cmd,
    import_cmd,
    layout_cmd,
    presets_cmd,
    run_cmd,
    schedule_cmd,
    schema_cmd,
    shards_cmd,
    validate_cmd,
)

app = typer.Typer(
    name="shardplan",
    help="Plan, estimate and run distributed training jobs: layouts, shards, memory, schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"shardplan {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks of errors")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="print the version")
    ] = None,
) -> None:
    if debug:
        _state["debug"] = True


# One module per command, in the order `--help` lists them.
for _module in (validate_cmd, layout_cmd, shards_cmd, estimate_cmd, schedule_cmd, run_cmd, export_cmd, import_cmd,
                presets_cmd, schema_cmd):
    _module.register(app)


def _debugging() -> bool:
    return _state["debug"] or os.environ.get("SHARDPLAN_DEBUG", "") not in ("", "0")


def _optional_values(argv: list[str]) -> list[str]:
    """`--resume` alone means the latest checkpoint; `--resume=PATH` names one (click has no
    options with an optional value)."""
    return ["--resume=latest" if arg == "--resume" else arg for arg in argv]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (the console script exits with it)."""
    argv = _optional_values(list(argv if argv is not None else sys.argv[1:]))
    _state["debug"] = "--debug" in argv
    if _state["debug"]:
        os.environ["SHARDPLAN_DEBUG"] = "1"  # workers started by `run` inherit it
    try:
        command = typer.main.get_command(app)
        result = command.main(args=argv, prog_name="shardplan", standalone_mode=False)
    except NoArgsIsHelpError:  # the help is already printed
        return EXIT_BAD_INPUT
    except UsageError as exc:
        command = exc.ctx.command_path if exc.ctx else "shardplan"
        emit_diagnostics([f"{command}: {exc.format_message()} (see {command} --help)"])
        return EXIT_BAD_INPUT
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        emit_diagnostics(["shardplan: interrupted"])
        return 130
    except ShardplanError as exc:
        if _debugging():
            raise
        emit_diagnostics(exc.lines())
        return exc.exit_code
    except KeyboardInterrupt:
        emit_diagnostics(["shardplan: interrupted"])
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # an internal error: say so in one line, never a traceback
        if _debugging():
            raise
        emit_diagnostics([f"shardplan: internal error: {type(exc).__name__}: {exc} (rerun with --debug)"])
        return EXIT_RUNTIME
    return result if isinstance(result, int) else 0


def main_exit() -> None:
    """Console-script entry point."""
    sys.exit(main())
