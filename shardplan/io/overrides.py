"""Command-line overrides of the job file: `--set section.key=value` and the shortcut flags.

Values are read as TOML (`2`, `true`, `"x"`, `3e-4`, `[1, 2]`); a value that is not TOML is
taken as a plain string, so `--set train.precision=fp32` works without quotes.
"""

from __future__ import annotations

import copy
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..spec.errors import InputError, Problem
from ..spec.names import SHAPE_KEYS, SOURCE_KEYS

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


def parse_value(text: str) -> object:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_set(expression: str) -> Override:
    """`parallel.tp=4` -> ("parallel.tp", 4)."""
    key, sep, raw = expression.partition("=")
    key = key.strip()
    if not sep:
        raise InputError(Problem("--set", f"{expression!r} is not of the form section.key=value"))
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise InputError(Problem(
            "--set", f"{key!r} is not a key of the job file (write section.key, e.g. parallel.tp)"
        ))
    return key, parse_value(raw.strip())


def collect_overrides(shortcuts: dict[str, object], sets: list[str]) -> list[Override]:
    """Shortcut flags first, then `--set` in the order given: a later `--set` of the same key
    wins, also over a shortcut flag (`override_warnings` says so; the planner's "to fit"
    suggestions are `--set` flags meant to be appended to the command). Two model sources on
    the command line (`--params` and `--set model.preset=...`) are bad input: which one was
    meant is not ours to guess."""
    flagged = {SHORTCUTS[name]: (value, f"--{name.replace('_', '-')} {value}")
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
    `--params 7.5B` works on a job file that names a preset.
    """
    result = copy.deepcopy(data)
    for path, value in overrides:
        section, key = path.split(".")
        table = result.get(section)
        if not isinstance(table, dict):
            table = result[section] = {}
        if section == "model" and key in SOURCE_KEYS:
            for other in (*SOURCE_KEYS, *SHAPE_KEYS):
                table.pop(other, None)
        table[key] = value
    return result


def override_warnings(shortcuts: dict[str, object], sets: list[str]) -> list[Problem]:
    """A warning for every `--set` that gives a shortcut flag's key another value (it wins)."""
    found = []
    for expression in sets or []:
        path, value = parse_set(expression)
        for name, given in shortcuts.items():
            if given is not None and SHORTCUTS[name] == path and given != value:
                flag = f"--{name.replace('_', '-')} {given}"
                found.append(Problem("--set", f"{path}={value!r} overrides {flag}", severity="warning"))
    return found
