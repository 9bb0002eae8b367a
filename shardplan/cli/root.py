"""The typer application: `shardplan`'s own options and the commands registered on it.

Imported only once a command line needs typer (`cli/app.py` answers `--version` without it).
"""

from __future__ import annotations

import importlib
from typing import Annotated, Optional

import typer

from .. import __version__

HELP = "Plan, estimate and run distributed training jobs: layouts, shards, memory, schedules."


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"shardplan {__version__}")
        raise typer.Exit()


def _root(
    debug: Annotated[bool, typer.Option(
        "--debug", help="show tracebacks of errors, same exit codes (also after the command, or SHARDPLAN_DEBUG=1)")] = False,
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_show_version, is_eager=True, help="print the version")] = None,
) -> None:
    """Declares the options for `--help`; `main` reads `--debug` itself, wherever it stands."""


def build_app(modules: list[str]) -> typer.Typer:
    """The application with the commands of the named modules (`shardplan.cli.<module>`,
    each with a `register(app)`) in the order given."""
    app = typer.Typer(
        name="shardplan",
        help=HELP,
        no_args_is_help=True,
        add_completion=True,  # --install-completion / --show-completion
        pretty_exceptions_enable=False,
        rich_markup_mode="markdown",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    for module in modules:
        importlib.import_module(f"{__package__}.{module}").register(app)
    return app
