"""Reading job files (TOML or JSON) into plain dicts, with the line of every key.

Every failure becomes an `InputError` naming the file: missing, a directory, unreadable,
not text, too large, malformed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..spec.errors import InputError, Problem
from ..spec.units import quoted

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


def _read_text(path: Path, shown: str) -> str:
    def fail(message: str) -> InputError:
        return InputError(Problem("", message, file=shown))

    try:
        if path.is_dir():
            raise fail("is a directory, not a file")
        if not path.exists():
            raise fail("no such file")
        size = path.stat().st_size
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
        raise InputError(Problem("", f"invalid TOML: {message}", file=shown, line=line)) from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise InputError(Problem("", "invalid TOML: nested too deeply", file=shown)) from None
    except ValueError:  # an integer longer than Python converts (TOML's are 64-bit)
        raise _long_number(text, "TOML", shown) from None
    return Document(shown, data, toml_key_lines(text))


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different: `json` keeps the last of a repeated key
    without a word, where a job file in TOML refuses it."""
    data = {}
    for key, value in pairs:
        if key in data:
            raise _RepeatedKey(key)
        data[key] = value
    return data


def parse_json(text: str, shown: str, unique_keys: bool = False) -> Document:
    """`unique_keys`: a key given twice in one object is refused (a job file), not the last
    one kept (as `json`, and transformers reading a config.json, keep it)."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None)
    except json.JSONDecodeError as exc:
        raise InputError(Problem("", f"invalid JSON: {exc.msg}", file=shown, line=exc.lineno)) from None
    except RecursionError:
        raise InputError(Problem("", "invalid JSON: nested too deeply", file=shown)) from None
    except _RepeatedKey as exc:
        raise InputError(Problem("", f"invalid JSON: key {quoted(exc.args[0])} given twice in one object",
                                 file=shown)) from None
    except ValueError:  # an integer longer than Python converts
        raise _long_number(text, "JSON", shown) from None
    if not isinstance(data, dict):
        raise InputError(Problem("", "expected a JSON object at the top", file=shown))
    return Document(shown, data)


def read_json(path: str | Path, shown: str | None = None) -> Document:
    """Parse a JSON file whatever its name."""
    shown = shown or str(path)
    return parse_json(_read_text(Path(path), shown), shown)


def read_document(path: str | Path) -> Document:
    """Parse a TOML file (JSON when its name ends in .json) into a `Document`."""
    shown = str(path)
    text = _read_text(Path(path), shown)
    if shown.lower().endswith(".json"):
        return parse_json(text, shown, unique_keys=True)
    return parse_toml(text, shown)
