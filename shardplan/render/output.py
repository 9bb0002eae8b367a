"""Where output goes: documents and tables on stdout, diagnostics on stderr."""

from __future__ import annotations

import json
import sys
from typing import Iterable


SCHEMA_VERSION = 1


def stdout_console():
    """A rich console on the current stdout (resolved per call so redirected stdout is
    honoured; rich is imported only by commands that print tables)."""
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False, soft_wrap=False)


def emit_line(text: str) -> None:
    """One line of plain text on stdout, never wrapped."""
    sys.stdout.write(f"{text}\n")


def emit_json(document: dict) -> None:
    """Print one JSON document (CONTRACT: `schema_version` first) and nothing else."""
    sys.stdout.write(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2))
    sys.stdout.write("\n")


def emit_diagnostics(lines: Iterable[object]) -> None:
    """One plain line per problem on stderr (no markup, no wrapping: scripts read it)."""
    for line in lines:
        sys.stderr.write(f"{line}\n")
