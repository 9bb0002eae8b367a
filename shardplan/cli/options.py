"""Options shared by the commands that read a job: the shortcut flags, `--set`, `--json`.

`plan_flags` appends the shared flags to a command's signature (typer reads signatures), so
each command declares only its own options and receives the shared ones as one `PlanFlags`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Callable, List, Optional

import typer

from ..io.overrides import SHORTCUTS, collect_overrides, flag_label, override_warnings, parse_value, set_key
from ..spec.common import MAX_WORLD_SIZE

if TYPE_CHECKING:
    from ..io.job import ResolvedJob

JsonFlag = Annotated[bool, typer.Option("--json", help="print one JSON document on stdout")]
# The world size a job must fill, within the largest one the degrees allow (spec/common.py).
WorldOption = Annotated[Optional[int], typer.Option("--world", min=1, max=MAX_WORLD_SIZE,
                                                    help="world size the job must fill")]

_FLAG_HELP = {
    "dp": "data-parallel degree",
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "cp": "context-parallel degree",
    "zero": "ZeRO stage 0-3, or an FSDP name (full_shard, ...)",
    "framework": "memory accounting: fsdp2, deepspeed or zero-paper",
    "params": "parameter count without an architecture, e.g. 7.5B",
    "gpus_per_node": "GPUs per node",
}
_INT_FLAGS = ("dp", "tp", "pp", "cp", "gpus_per_node")


def _flag_annotation(name: str) -> object:
    kind = int if name in _INT_FLAGS else str
    option = typer.Option(
        "--" + name.replace("_", "-"),
        help=f"{_FLAG_HELP[name]} (sets {SHORTCUTS[name]})",
        rich_help_panel="Plan overrides",
        show_default=False,
    )
    return Annotated[Optional[kind], option]  # type: ignore[valid-type]


_SET_ANNOTATION = Annotated[
    Optional[List[str]],
    typer.Option(
        "--set",
        help="override any job-file key: section.key=value (repeatable); a plan key =auto is left to the search",
        rich_help_panel="Plan overrides",
        show_default=False,
    ),
]


@dataclass
class PlanFlags:
    """The overrides given on the command line."""

    shortcuts: dict[str, object] = field(default_factory=dict)
    sets: list[str] = field(default_factory=list)

    def _values(self) -> dict[str, object]:
        return {k: (parse_value(v) if isinstance(v, str) else v) for k, v in self.shortcuts.items()}

    def overrides(self):
        return collect_overrides(self._values(), self.sets)

    def labels(self) -> dict[str, str]:
        """Dotted path -> the flag that set it (for messages)."""
        overridden = {set_key(expression) for expression in self.sets or []}
        return {
            SHORTCUTS[k]: flag_label(k, v)
            for k, v in self.shortcuts.items()
            if v is not None and SHORTCUTS[k] not in overridden  # a later --set gives that key
        }

    def load(self, source: str | None, world: int | None = None, check_paths: bool = False,
             warn_only=None) -> ResolvedJob:
        overrides = self.overrides()
        resolved = load_job_checked(
            source, overrides, world=world, flag_labels=self.labels(), check_paths=check_paths,
            warn_only=warn_only,
        )
        resolved.warnings[:0] = self.override_warnings()
        return resolved

    def override_warnings(self, flagged: dict[str, tuple[object, str]] | None = None) -> list:
        """A warning for every `--set` that overrides a flag: a shortcut, or one of `flagged`
        (key -> value and label) that the command sets the key with."""
        return override_warnings(self._values(), self.sets, flagged)


def load_job_checked(source: str | None, overrides, **options) -> ResolvedJob:
    """`load_job`, where a path the job names that cannot even be looked at (a name too long
    for the file system, a folder this user may not search) is bad input, not a crash."""
    from ..io.files import unreadable
    from ..io.job import load_job  # pydantic loads here, not when the command is registered

    try:
        return load_job(source, overrides, **options)
    except OSError as exc:
        raise unreadable(exc) from None


def plan_flags(func: Callable) -> Callable:
    """Give `func` the shortcut flags and `--set`; it receives them as `flags: PlanFlags`."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "flags"]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_flag_annotation(name))
        for name in SHORTCUTS
    ]
    extra.append(inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_SET_ANNOTATION))

    @functools.wraps(func)
    def wrapper(**kwargs):
        shortcuts = {name: kwargs.pop(name) for name in SHORTCUTS}
        flags = PlanFlags({k: v for k, v in shortcuts.items() if v is not None}, kwargs.pop("set_") or [])
        return func(**kwargs, flags=flags)

    params = own + extra
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer must see the new signature, not the original
    return wrapper
