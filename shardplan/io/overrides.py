"""Command-line overrides of the job file: `--set section.key=value` and the shortcut flags.

Values are read as TOML (`2`, `true`, `"x"`, `3e-4`, `[1, 2]`); a value that is not TOML is
taken as a plain string, so `--set train.precision=fp32` works without quotes. `auto` for a
plan key (spec/names.py PLAN_KEYS) takes the key out of the job, as if it were not written:
`plan` searches it (a job preset's fixed degrees can be freed so), other commands take its
default.
"""

from __future__ import annotations

import copy
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..spec.errors import InputError, Problem
from ..spec.names import AUTO, PLAN_KEYS, SHAPE_KEYS, SOURCE_KEYS
from ..spec.units import cut, quoted
from .files import longest_int_digits

# CONTRACT: shortcut flags and the job-file key each one sets.
SHORTCUTS = {
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "zero": "zero.stage",
    "framework": "zero.framework",
    "params": "model.params",
    "gpus_per_node": "cluster.gpus_per_node",
}

Override = tuple[str, object]


def _read_value(text: str) -> object:
    """`text` as a TOML value, else the plain string; a ValueError for an integer of more
    digits than Python converts (`sys.set_int_max_str_digits`)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_value(text: str) -> object:
    try:
        return _read_value(text)
    except ValueError:  # a number too long to read: checked as the string it is (`--params`)
        return text


def flag_label(name: str, value: object) -> str:
    """`--dp 4`: a flag and its value as messages name them (an empty value as '', a long one
    cut as `quoted` cuts it)."""
    text = str(value) if value != "" else repr("")
    return f"--{name.replace('_', '-')} {cut(text)}"


def set_key(expression: str) -> str:
    """The dotted key of `--set section.key=value` (`parallel . tp = 2` is parallel.tp)."""
    return ".".join(part.strip() for part in expression.partition("=")[0].split("."))


def parse_set(expression: str) -> Override:
    """`parallel.tp=4` -> ("parallel.tp", 4)."""
    _, sep, raw = expression.partition("=")
    if not sep:
        raise InputError(Problem("--set", f"{quoted(expression)} is not of the form section.key=value"))
    key = set_key(expression)
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise InputError(Problem(
            "--set", f"{quoted(key)} is not a key of the job file (write section.key, e.g. parallel.tp)"
        ))
    try:
        return key, _read_value(raw.strip())
    except ValueError:
        raise InputError(Problem("--set", f"{key}: a number of more than {longest_int_digits()} digits")) from None


def collect_overrides(shortcuts: dict[str, object], sets: list[str]) -> list[Override]:
    """Shortcut flags first, then `--set` in the order given: a later `--set` of the same key
    wins, also over a shortcut flag (`override_warnings` says so; the planner's "to fit"
    suggestions are `--set` flags meant to be appended to the command). Two model sources on
    the command line (`--params` and `--set model.preset=...`) are bad input: which one was
    meant is not ours to guess."""
    flagged = {SHORTCUTS[name]: (value, flag_label(name, value))
               for name, value in shortcuts.items() if value is not None}
    overrides: list[Override] = [(path, value) for path, (value, _) in flagged.items()]
    parsed = [parse_set(s) for s in sets or []]
    problems = []
    named = {}
    for path, value in overrides + parsed:
        section, _, key = path.partition(".")
        if section == "model" and key in SOURCE_KEYS:
            label = flagged[path][1] if path in flagged else f"--set {path}={value}"
            named.setdefault(key, label)
    if len(named) > 1:
        problems.append(Problem("--set", f"two model sources on the command line ({', '.join(named.values())}): "
                                         "give one of them"))
    if problems:
        raise InputError(problems)
    return overrides + parsed


def apply_overrides(data: dict, overrides: list[Override]) -> dict:
    """A copy of `data` with the overrides written in.

    Setting a model source (preset, hf_config, params) replaces the file's model source, so
    `--params 7.5B` works on a job file that names a preset. A plan key set to `auto` is
    taken out.
    """
    result = copy.deepcopy(data)
    for path, value in overrides:
        section, key = path.split(".")
        table = result.get(section)
        if value == AUTO and path in PLAN_KEYS:
            if isinstance(table, dict):
                table.pop(key, None)
            continue
        if not isinstance(table, dict):
            table = result[section] = {}
        if section == "model" and key in SOURCE_KEYS:
            for other in (*SOURCE_KEYS, *SHAPE_KEYS):
                table.pop(other, None)
        table[key] = value
    return result


def override_warnings(shortcuts: dict[str, object], sets: list[str],
                      flagged: dict[str, tuple[object, str]] | None = None) -> list[Problem]:
    """A warning for every `--set` that gives a shortcut flag's key another value (it wins);
    `flagged`: a command's own flags, key -> (value, label), as `--order` sets parallel.order."""
    given = {SHORTCUTS[name]: (value, flag_label(name, value)) for name, value in shortcuts.items()
             if value is not None}
    given.update(flagged or {})
    found = []
    for expression in sets or []:
        path, value = parse_set(expression)
        if path in given and given[path][0] != value:
            found.append(Problem("--set", f"{path}={value!r} overrides {given[path][1]}", severity="warning"))
    return found
