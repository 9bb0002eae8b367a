"""pydantic validation errors -> one readable `Problem` per error, with "did you mean"."""

from __future__ import annotations

import datetime
import difflib
import re
import typing

from pydantic import BaseModel, ValidationError

from ..spec.errors import Problem
from ..spec.units import counted, cut, quoted

_TYPE_NAMES = {
    bool: "a boolean", int: "an integer", float: "a float", str: "a string",
    dict: "a table", list: "an array", type(None): "null",
    # TOML's dates and times (`--set train.seq_len=2024-01-01` reads one)
    datetime.datetime: "a date-time", datetime.date: "a date", datetime.time: "a time",
}
_EXPECTED = {
    "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
    "string_type": "a string", "model_type": "a table", "dict_type": "a table", "list_type": "a list",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"), "less_than": ("<", "lt"),
}


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """` (did you mean 'tp'?)` or an empty string. Case does not count (`BF16-mixed` is
    'bf16-mixed'), and a word every choice of one family starts with names them all (`h100`:
    'h100-pcie' or 'h100-sxm')."""
    names = [str(c) for c in choices]
    lowered = {name.lower(): name for name in names}
    text = str(word).strip().lower()
    if text in lowered:
        return f" (did you mean {lowered[text]!r}?)"
    started = [name for name in names if text and name.lower().startswith(text)]
    if 1 <= len(started) <= 3:
        return f" (did you mean {' or '.join(repr(name) for name in started)}?)"
    # A name's first word is its family (`h100` of 'h100-sxm'): a word of a known family is
    # matched within it, so 'h100-80gb' is not taken for 'a100-sxm-80gb'.
    head = re.split(r"[-_.]", text, maxsplit=1)[0]
    family = [name for name in lowered if head and re.split(r"[-_.]", name, maxsplit=1)[0] == head]
    if family and head != text:
        close = difflib.get_close_matches(text, family, n=1, cutoff=0.5)
        if close:
            return f" (did you mean {lowered[close[0]]!r}?)"
        if len(family) <= 3:
            return f" (did you mean {' or '.join(repr(lowered[name]) for name in family)}?)"
    close = difflib.get_close_matches(text, list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def shown_value(value: object) -> str:
    """A value as a message quotes it: its repr (a boolean, a date or time as TOML writes it;
    JSON's null as null), cut at 60 characters."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, (datetime.date, datetime.time)):
        text = value.isoformat()
    else:
        return "null" if value is None else quoted(value)  # an integer too long to print by its size
    return cut(text)


def _type_name(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the last element of `loc` (None past a leaf)."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        # An optional table (`Optional[RopeScalingSpec]`) is the table inside.
        tables = [c for c in (annotation, *typing.get_args(annotation))
                  if isinstance(c, type) and issubclass(c, BaseModel)]
        if not tables:
            return None
        model = tables[0]
    return model


def _tables(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The tables of a document model (`[parallel]` -> ParallelSpec), optional ones included."""
    tables = {}
    for name, field in root.model_fields.items():
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                tables[name] = candidate
    return tables


def _other_table(root: type[BaseModel], owner: type[BaseModel] | None, key: str) -> str:
    """` (it belongs in [parallel]: parallel.micro_batch_size)` for a key written in the
    wrong table, or at the top; else a close key of another table; else empty."""
    tables = {name: model for name, model in _tables(root).items() if model is not owner}
    homes = [name for name, model in tables.items() if key in model.model_fields]
    if homes:
        where = " or ".join(f"[{name}]" for name in homes)
        return f" (it belongs in {where}: {homes[0]}.{key})"
    if owner is not None and did_you_mean(key, list(owner.model_fields)):
        return ""  # a misspelling in its own table: that hint reads better
    dotted = [f"{name}.{field}" for name, model in tables.items() for field in model.model_fields]
    close = difflib.get_close_matches(key, [d.split(".", 1)[1] for d in dotted], n=1, cutoff=0.75)
    return f" (did you mean {next(d for d in dotted if d.endswith('.' + close[0]))!r}?)" if close else ""


def problem_from_error(root: type[BaseModel], err: dict) -> Problem:
    loc = tuple(err.get("loc", ()))
    path = ".".join(str(p) for p in loc)
    kind = err.get("type", "")
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        owner = _model_at(root, loc)
        choices = list(owner.model_fields) if owner else []
        table = len(loc) == 1 and isinstance(value, dict)
        what = "unknown table" if table else "unknown key"
        if not str(loc[-1]).strip():  # a name of no letters: the path shows nothing, the message does
            what += f" {shown_value(loc[-1])}"
        hint = "" if table else _other_table(root, owner, str(loc[-1]))
        hint = hint or did_you_mean(str(loc[-1]), choices)
        if not hint and choices:
            hint = f" (known: {', '.join(choices)})"
        return Problem(path, what + hint)
    if kind == "missing":
        return Problem(path, "required")
    if kind in _EXPECTED:
        got = "null" if value is None else f"{_type_name(value)} {shown_value(value)}"
        return Problem(path, f"expected {_EXPECTED[kind]}, got {got}")
    if kind in _BOUNDS and isinstance(value, float) and value != value:
        return Problem(path, "must be a number (got nan)")  # NaN fails every bound
    if kind in _BOUNDS:
        symbol, key = _BOUNDS[kind]
        return Problem(path, f"must be {symbol} {ctx.get(key)} (got {shown_value(value)})")
    if kind in ("too_short", "too_long"):
        bound, word = ("min_length", "at least") if kind == "too_short" else ("max_length", "at most")
        count = ctx.get(bound)
        return Problem(path, f"must hold {word} {counted(count, 'item')} (got {shown_value(value)})")
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ", ").split(",")]
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return Problem(path, f"must be one of {expected} (got {shown_value(value)}){hint}")
    message = str(err.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    return Problem(path, message)


# Unknown keys reported one by one, each with its hint (a close match costs a difflib search
# over every key of every table); the rest are counted per table. A file of 30,000 unknown keys
# took 5.6 s to validate with every one hinted, and printed 30,000 lines.
MAX_UNKNOWN_KEYS = 20
# Likewise the bad items of one array (`lora.targets`): a list of 200,000 unknown names took
# 51 s and printed 200,000 lines.
MAX_ITEM_PROBLEMS = 20


def problems_from_validation(root: type[BaseModel], exc: ValidationError) -> list[Problem]:
    problems, unknown, more, items = [], 0, {}, {}
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        parent = ".".join(str(p) for p in loc[:-1])
        if err.get("type") == "extra_forbidden":
            unknown += 1
            if unknown > MAX_UNKNOWN_KEYS:
                more[parent] = more.get(parent, 0) + 1
                continue
        elif loc and isinstance(loc[-1], int):  # an item of an array
            items[parent] = items.get(parent, 0) + 1
            if items[parent] > MAX_ITEM_PROBLEMS:
                continue
        problems.append(problem_from_error(root, err))
    for parent, count in more.items():
        where = "" if parent else " at the top level"
        problems.append(Problem(parent, f"and {counted(count, 'more unknown key')}{where}"))
    for parent, count in items.items():
        if count > MAX_ITEM_PROBLEMS:
            problems.append(Problem(parent, f"and {counted(count - MAX_ITEM_PROBLEMS, 'more bad item')}"))
    return problems
