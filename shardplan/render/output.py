"""Where output goes: documents and tables on stdout, diagnostics on stderr."""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable


SCHEMA_VERSION = 1

# One compact encoder for all items: json.dumps would build a new encoder per call.
_encode = json.JSONEncoder(separators=(", ", ": "), check_circular=False).encode


def _colour_wanted() -> bool:
    """rich's rule for styled output: a terminal, or FORCE_COLOR / TTY_COMPATIBLE set."""
    if os.environ.get("FORCE_COLOR") or os.environ.get("TTY_COMPATIBLE", "") == "1":
        return True
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


class PlainConsole:
    """What rich's `Console` writes when stdout is not a terminal, for plain text: the
    characters of each `Text`, no styles and no wrapping. Importing `rich.console` costs a
    planning command about a tenth of its run, for output nobody sees styled; any other
    renderable (tables, panels) still goes through rich."""

    def __init__(self) -> None:
        self._rich = None

    @property
    def width(self) -> int:
        """rich's width: COLUMNS, else the terminal of stdin, stdout or stderr, else 80."""
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit() and int(columns):
            return int(columns)
        for descriptor in (0, 1, 2):
            try:
                width = os.get_terminal_size(descriptor).columns
            except (AttributeError, ValueError, OSError):
                continue
            return width or 80
        return 80

    def print(self, *objects: object, **options: object) -> None:
        texts = [getattr(o, "plain", None) for o in objects]  # rich.text.Text (str would be markup)
        if None not in texts and set(options) <= {"soft_wrap", "no_wrap", "overflow"}:
            sys.stdout.write(" ".join(texts) + "\n")  # type: ignore[arg-type]
            return
        if self._rich is None:
            self._rich = _rich_console()
        self._rich.print(*objects, **options)


class Line:
    """One line of text in one style. Without a terminal `PlainConsole` prints its `plain`
    characters; on one, rich turns it into its `Text` (rich's `__rich__` protocol). A command
    whose output is only such lines (plan) then never imports rich's text machinery, a tenth of
    its run, for styles nobody sees."""

    __slots__ = ("plain", "style")

    def __init__(self, plain: str, style: str = "") -> None:
        self.plain, self.style = plain, style

    def __rich__(self):
        from rich.text import Text

        return Text(self.plain, style=self.style)

    def __repr__(self) -> str:
        return f"Line({self.plain!r}, style={self.style!r})"


def _rich_console():
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own answer to a reader that left is SystemExit(1) (rich/console.py,
            # `on_broken_pipe`); the CLI treats it as no failure (cli/app.py).
            raise BrokenPipeError

    return _Console(file=sys.stdout, highlight=False, soft_wrap=False)


def stdout_console():
    """A console on the current stdout (resolved per call so redirected stdout is honoured):
    rich on a terminal, `PlainConsole` otherwise."""
    return _rich_console() if _colour_wanted() else PlainConsole()


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


# -- large documents (layout, shards): one item per line -------------------------------------------------------------------------------
def _is_container(value: object) -> bool:
    return isinstance(value, (dict, list))


_NUMBERS = (int, float, type(None))  # bool is an int


def _numbers_only(items: list) -> bool:
    """True when every item is a dict of numbers/booleans/null or a list of them: encoded
    items then hold no strings, so `}, {` and `], [` occur only between items."""
    if isinstance(items[0], dict):
        return all(type(row) is dict and all(isinstance(v, _NUMBERS) for v in row.values()) for row in items)
    return all(type(row) is list and all(isinstance(v, _NUMBERS) for v in row) for row in items)


def _block(value: object, indent: str) -> str:
    """Objects key per line; lists of objects or lists item per line; the rest compact."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        body = ",\n".join(f"{inner}{_encode(str(k))}: {_block(v, inner)}" for k, v in value.items())
        return "{\n" + body + "\n" + indent + "}"
    if isinstance(value, list) and value and _is_container(value[0]):
        if _numbers_only(value):  # one C call for the whole list, then a line per item
            between = "}, {" if isinstance(value[0], dict) else "], ["
            body = _encode(value)[1:-1].replace(between, between[0] + ",\n" + inner + between[-1])
            return "[\n" + inner + body + "\n" + indent + "]"
        body = ",\n".join(inner + _encode(item) for item in value)
        return "[\n" + body + "\n" + indent + "]"
    return _encode(value)


def dumps_document(document: dict) -> str:
    """A CONTRACT JSON document (`schema_version` first), one item of each long list a line."""
    return _block({"schema_version": SCHEMA_VERSION, **document}, "") + "\n"


def write_document(document: dict) -> None:
    """A large CONTRACT document on stdout, one rank (one group) per line, through the C JSON
    encoder: for a 16,384-rank layout (~340,000 numbers) about 3x faster than
    `json.dumps(indent=2)`, which falls back to the pure-Python encoder, and the file stays
    readable and diffable."""
    sys.stdout.write(dumps_document(document))


def error_document(problems: Iterable[object], exit_code: int) -> dict:
    """CONTRACT's error document for `--json` (stdout), beside the usual lines on stderr: one
    entry per error (warnings and notes stay on stderr); a plain line of text has no file,
    line or path. A problem with a value given on the command line has no file either, and
    names the flag (`"flag": "--set"`, `"--dp 0"`), as its stderr line does where a file goes."""
    rows = []
    for problem in problems:
        if getattr(problem, "severity", "error") != "error":
            continue
        if hasattr(problem, "path"):
            row = {"file": problem.file, "line": problem.line, "path": problem.path, "message": problem.message}
            if problem.file and problem.file.startswith("--"):  # a command-line flag, not a file
                row.update(file=None, flag=problem.file)
            rows.append(row)
        else:
            rows.append({"file": None, "line": None, "path": "", "message": str(problem)})
    return {"error": {"exit_code": exit_code, "problems": rows}}
