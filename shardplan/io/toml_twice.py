"""A TOML key or table given twice, named as the JSON loader names one: tomllib's error says
only "Cannot overwrite a value" (or quotes a tuple) at the line of the second; this follows the
keys of the text as far as that line to name the dotted key and both its lines."""

from __future__ import annotations

import ast
import json
import re
from bisect import bisect_left

from ..spec.errors import InputError, Problem


# tomllib's errors (_parser.py) for a key or table given twice; the tuple or the name they quote
# is the key, or a table that holds it.
_TOML_TWICE = re.compile(r"^(?:Cannot overwrite a value|Cannot declare (\(.*\)) twice|Cannot mutate immutable "
                         r"namespace (\(.*\))|Cannot redefine namespace (\(.*\))|Duplicate inline table key (.+))$")
_BARE_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_SCALAR = re.compile(r"[^,\]}#\n]*")  # a number, boolean or date runs to the next delimiter


class _Twice(Exception):
    """A key or table given again: its parts, the lines where it was given first and again, and
    the line where the second statement ends (where tomllib reports it)."""

    def __init__(self, parts: tuple[str, ...], first: int, second: int, end: int, inline: bool):
        super().__init__(parts)
        self.parts, self.first, self.second, self.end, self.inline = parts, first, second, end, inline


class _Unsure(Exception):
    """The text holds what the key scanner does not follow: the key stays unnamed."""


def toml_given_twice(text: str, message: str, line: int, shown: str) -> InputError | None:
    """tomllib's error for a key or table given twice (at `line`, where it says only "Cannot
    overwrite a value" or quotes a tuple) as the JSON one (`json_key_lines`): the dotted key
    and both its lines. None unless the scan finds that very key at that line."""
    said = _TOML_TWICE.match(message)
    if not said:
        return None
    try:
        _TomlKeys(text, line).scan()
        return None  # no key given twice: the scan missed what tomllib saw
    except _Twice as twice:
        found = twice
    except (_Unsure, IndexError, RecursionError):
        return None
    if not found.second <= line <= found.end:
        return None
    try:
        quoted = next((ast.literal_eval(g) for g in said.groups()[:3] if g is not None), None)
        stem = ast.literal_eval(said.group(4)) if said.group(4) is not None else None
    except (ValueError, SyntaxError):
        return None
    if quoted is not None and (not isinstance(quoted, tuple) or quoted[:len(found.parts)] != found.parts):
        return None  # tomllib names the key or a table under it
    if stem is not None and not (found.inline and found.parts[-1] == stem):
        return None
    lines = f"lines {found.first} and {found.second}" if found.first != found.second else f"both on line {found.first}"
    return InputError(Problem(".".join(found.parts), f"given twice ({lines})", file=shown, line=found.second))


class _TomlKeys:
    """Follows the keys and tables of a TOML text as tomllib defines them, as far as the first
    given twice, which it raises (`_Twice`); `_Unsure` where it cannot follow (an array of
    tables, a key with TOML-only escapes). Only for a text tomllib refused at `stop`: all
    before that line is valid TOML, so the scan checks no syntax tomllib checked."""

    def __init__(self, text: str, stop: int):
        self.text, self.pos, self.stop = text, 0, stop
        self.newlines = [i for i, char in enumerate(text) if char == "\n"]
        # key -> (how it was given, line): "value", "inline" (an inline table and all in it:
        # frozen), "header" ([table]), "implicit" (a table a header's key passes through),
        # "dotted" (a table a dotted key passes through)
        self.defined: dict[tuple[str, ...], tuple[str, int]] = {}

    def line(self) -> int:
        return bisect_left(self.newlines, self.pos) + 1

    def scan(self) -> None:
        table: tuple[str, ...] = ()
        while True:
            self.skip(newlines=True)
            if self.pos >= len(self.text):
                return
            if self.line() > self.stop:
                raise _Unsure
            if self.text.startswith("[[", self.pos):
                raise _Unsure  # arrays of tables: each element is a namespace of its own
            if self.text[self.pos] == "[":
                line = self.line()
                self.pos += 1
                table = self.key()
                self.expect("]")
                self.declare(table, line)
            else:
                self.pair(table, self.defined, inline=False)
            self.skip(newlines=False)
            if self.pos < len(self.text) and self.text[self.pos] != "\n":
                raise _Unsure

    def skip(self, newlines: bool) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char in " \t\r" or (newlines and char == "\n"):
                self.pos += 1
            else:
                return

    def expect(self, char: str) -> None:
        self.skip(newlines=False)
        if self.text[self.pos] != char:
            raise _Unsure
        self.pos += 1

    def key(self) -> tuple[str, ...]:
        parts = []
        while True:
            self.skip(newlines=False)
            char = self.text[self.pos]
            if char in "\"'":
                start = self.pos
                self.string()
                raw = self.text[start + 1:self.pos - 1]
                if char == '"' and "\\" in raw:
                    try:
                        raw = json.loads(f'"{raw}"')  # TOML's escapes but \e and \U
                    except ValueError:
                        raise _Unsure from None
                parts.append(raw)
            else:
                bare = _BARE_KEY.match(self.text, self.pos)
                if not bare:
                    raise _Unsure
                parts.append(bare.group())
                self.pos = bare.end()
            self.skip(newlines=False)
            if self.text[self.pos] != ".":
                return tuple(parts)
            self.pos += 1

    def pair(self, table: tuple[str, ...], defined: dict, inline: bool) -> None:
        line = self.line()
        parts = self.key()
        self.expect("=")
        self.skip(newlines=False)
        try:  # tomllib reads the value (an inline table's own keys) before storing the key
            inner = self.value()
        except _Twice as twice:
            twice.parts = table + parts + twice.parts
            raise
        full = table + parts
        for end in range(len(table) + 1, len(full)):  # the tables a dotted key passes through
            given = defined.setdefault(full[:end], ("dotted", line))
            if given[0] in ("value", "inline", "header"):
                raise _Twice(full[:end], given[1], line, self.line(), inline)
        if full in defined:
            raise _Twice(full, defined[full][1], line, self.line(), inline)
        defined[full] = ("value" if inner is None else "inline", line)
        defined.update({full + key: ("inline", at) for key, (_, at) in (inner or {}).items()})

    def declare(self, table: tuple[str, ...], line: int) -> None:
        for end in range(1, len(table)):
            given = self.defined.setdefault(table[:end], ("implicit", line))
            if given[0] in ("value", "inline"):
                raise _Twice(table[:end], given[1], line, line, False)
        given = self.defined.get(table)
        if given is not None and given[0] != "implicit":
            raise _Twice(table, given[1], line, line, False)
        self.defined[table] = ("header", line)

    def value(self) -> dict | None:
        """Steps over a value: an inline table's keys (relative to it), else None."""
        char = self.text[self.pos]
        if char == "{":
            return self.inline_table()
        if char == "[":
            self.array()
        elif char in "\"'":
            self.string()
        else:
            scalar = _SCALAR.match(self.text, self.pos)
            if not scalar.group().strip():
                raise _Unsure
            self.pos = scalar.end()
        return None

    def inline_table(self) -> dict:
        self.pos += 1
        keys: dict[tuple[str, ...], tuple[str, int]] = {}
        self.skip(newlines=False)
        if self.text[self.pos] == "}":
            self.pos += 1
            return keys
        while True:
            self.pair((), keys, inline=True)
            self.skip(newlines=False)
            char = self.text[self.pos]
            self.pos += 1
            if char == "}":
                return keys
            if char != ",":
                raise _Unsure

    def array(self) -> None:
        self.pos += 1
        while True:
            self.skip(newlines=True)
            if self.text[self.pos] == "]":
                self.pos += 1
                return
            try:
                self.value()
            except _Twice:
                raise _Unsure from None  # a key twice in a table inside an array: not followed
            self.skip(newlines=True)
            char = self.text[self.pos]
            self.pos += 1
            if char == "]":
                return
            if char != ",":
                raise _Unsure

    def string(self) -> None:
        text, quote = self.text, self.text[self.pos]
        if text.startswith(quote * 3, self.pos):
            i = self.pos + 3
            while not text.startswith(quote * 3, i):
                if i >= len(text):
                    raise _Unsure
                i += 2 if quote == '"' and text[i] == "\\" else 1
            i += 3
            for _ in range(2):  # up to two quotes just before the closing three are content
                if i < len(text) and text[i] == quote:
                    i += 1
        else:
            i = self.pos + 1
            while text[i] != quote:
                if text[i] == "\n":
                    raise _Unsure
                i += 2 if quote == '"' and text[i] == "\\" else 1
            i += 1
        self.pos = i
