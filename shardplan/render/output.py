"""Where output goes: documents and tables on stdout, diagnostics on stderr."""

from __future__ import annotations

import json
import sys
from typing import Iterable


SCHEMA_VERSION = 1

# One compact encoder for all items: json.dumps would build a new encoder per call.
_encode = json.JSONEncoder(separators=(", ", ": "), check_circular=False).encode


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


def error_document(problems: list, exit_code: int) -> dict:
    """CONTRACT's error document for `--json` (stdout), beside the usual lines on stderr."""
    rows = [{"file": p.file, "line": p.line, "path": p.path, "message": p.message} for p in problems]
    return {"error": {"exit_code": exit_code, "problems": rows}}
