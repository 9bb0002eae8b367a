"""What every target format shares: the plan an exporter reads, what an importer returns,
notes about keys a format cannot carry, and typed reading of a foreign config.

Exporters and importers are pure: dicts in, dicts out, no files and no printing. The CLI
(cli/export_cmd.py, cli/import_cmd.py) reads, writes and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import typing
from typing import Callable, Iterable

from ...spec.common import Size
from ...spec.errors import Problem
from ...spec.job import TABLES, JobSpec
from ...spec.model import ModelShape
from ...spec.units import format_bytes
from .offload import DOES_NOT_FIT, OffloadDecision, decided_offload


# How an export note says the target refuses the config whatever the training script does
# (deepspeed.py: "DeepSpeed refuses this config: ..."); one that refuses it only without
# something the script provides ("... refuses this config without a PipelineModule") is no
# failure of the config.
REFUSED = "refuses this config:"


@dataclass(frozen=True)
class Note:
    """One key a conversion could not carry (or carried approximately), and why.

    `path` is a dotted key: of the job file on export, of the source file on import. `file`
    and `line` are set for a key of a file the source refers to (accelerate's
    deepspeed_config_file); otherwise the key is in the source itself."""

    path: str
    message: str
    file: str | None = None
    line: int | None = None

    @property
    def fails(self) -> bool:
        """Whether the note says a run of the exported config fails as written: the target
        refuses it outright, or it runs out of memory (`export --strict` exits 1 on one)."""
        return REFUSED in self.message or f"{DOES_NOT_FIT} (" in self.message


@dataclass(frozen=True)
class Plan:
    """What an exporter reads: the validated job, its resolved model, the two layout facts a
    format may need (the ZeRO/FSDP shard group of hybrid sharding, the node count) and the
    offload as the estimate decided it (offload.py; by default the job's flags as written)."""

    job: JobSpec
    shape: ModelShape | None
    shard_group: int
    nodes: int
    offload: OffloadDecision = None  # type: ignore[assignment]  # None: the job's flags

    def __post_init__(self) -> None:
        if self.offload is None:
            object.__setattr__(self, "offload", decided_offload(self.job, None))

    @property
    def world(self) -> int:
        par = self.job.parallel
        return par.dp * par.tp * par.pp * par.cp

    def hybrid_degrees(self, replicas: int, target: str) -> tuple[int, int, str | None]:
        """(replicate, shard) sizes of hybrid sharding over `replicas` data-parallel ranks, as
        torchtitan and accelerate take them, and a note when the plan's cannot be written. Both
        shard with FSDP over dp_shard x cp (torchtitan's ParallelDims "dp_shard_cp" mesh,
        accelerate's ParallelismConfig), so the plan's shard group, the data- and context-
        parallel ranks of one node, is dp_shard x cp. A context-parallel group that spans nodes
        leaves only part of it in the node: no dp_shard gives that, and the nearest, 1, shards
        over every context-parallel rank."""
        cp = self.job.parallel.cp
        shard, rest = divmod(self.shard_group, cp)
        if shard and not rest and replicas % shard == 0:
            return replicas // shard, shard, None
        return replicas, 1, (f"{target} shards with FSDP over dp_shard x cp, and the {cp} context-parallel ranks "
                             f"span nodes: hybrid sharding over the {self.shard_group} data- and context-parallel "
                             f"ranks of a node cannot be written; written as dp_shard 1, so each rank keeps a "
                             f"smaller shard than planned and gathers it from {cp} ranks across nodes")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp * micro_batch_size * num_microbatches (what
        `train.global_batch_size` must equal when given, core/checks.py)."""
        par = self.job.parallel
        return par.dp * par.micro_batch_size * par.num_microbatches


@dataclass
class Exported:
    """A target's document (a dict, or a list of arguments) and the notes about it."""

    config: dict | list
    notes: list[Note] = field(default_factory=list)


@dataclass
class Imported:
    """Job-file tables built from a source config.

    `origin` maps each job key written to the source key it came from (messages about the
    job name the user's key); `notes` lists source keys that were not read or were read
    approximately; `problems` the source keys that cannot be read at all (exit 2)."""

    tables: dict[str, dict] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # job key -> (file, line) of its source key, for keys read from a file the source refers to
    elsewhere: dict[str, tuple[str, int | None]] = field(default_factory=dict)

    def set(self, job_path: str, value: object, source_key: str) -> None:
        table, key = job_path.split(".")
        self.tables.setdefault(table, {})[key] = value
        self.origin[job_path] = source_key

    def note(self, source_key: str, message: str) -> None:
        note = Note(source_key, message)
        if note not in self.notes:  # a key read by two rules is named once
            self.notes.append(note)

    def problem(self, source_key: str, message: str) -> None:
        self.problems.append(Problem(source_key, message))

    def merge(self, other: Imported, file: str, line_of: Callable[[str], int | None]) -> None:
        """Take in what an importer read from `file`, a file the source refers to: its tables
        (over this import's), its notes and problems located in that file (`line_of`: the line
        of a dotted key there), and where each job key it wrote came from."""
        for table, values in other.tables.items():
            for key, value in values.items():
                job_path = f"{table}.{key}"
                self.tables.setdefault(table, {})[key] = value
                source_key = other.origin.get(job_path, "")
                if source_key:  # else the value came from the caller (a size it passed in)
                    self.origin[job_path] = source_key
                    self.elsewhere[job_path] = (file, line_of(source_key))
        for note in other.notes:
            located = Note(note.path, note.message, file, line_of(note.path) if note.path else None)
            if located not in self.notes:
                self.notes.append(located)
        self.problems += [p.at(file, line_of(p.path) if p.path else None) for p in other.problems]


# Tables and keys that never reach a framework's config, whatever the target:
# `[cluster]` describes the machines (each launcher takes them from its own flags or
# hostfile), `zero.framework` chooses shardplan's own memory accounting, and
# `offload.strategy` is exported as what it decided (the Plan's offload; no framework
# offloads on its own, so a strategy that adds nothing is exported exactly).
_NOT_PLAN_KEYS = {"cluster", "zero.framework", "offload.strategy"}


def unexpressed(plan: Plan, covered: Iterable[str], target: str) -> list[Note]:
    """A note for every job key whose value differs from its default and that the target's
    format has no key for (`covered` lists the job keys it does carry, as `table.key` or a
    whole `table`). Nothing the user set is dropped without a line saying so."""
    covered = set(covered) | _NOT_PLAN_KEYS
    job = plan.job
    notes = []
    if job.lora is not None and "lora" not in covered:
        nf4 = ", its weights not in NF4" if job.lora.base_dtype == "nf4" else ""
        notes.append(Note("lora", f"{target} has no LoRA setting: the adapters are not exported; unless the "
                                  "training script adds them (peft), a run of this config trains every parameter "
                                  f"(a full fine-tune{nf4}), which needs far more memory than this plan's estimate"))
    for table, spec in TABLES.items():
        if table in covered or table in ("model", "lora"):
            continue
        value = getattr(job, table)
        defaults = spec()
        sizes = _size_fields(spec)
        for key in spec.model_fields:
            path = f"{table}.{key}"
            if path in covered:
                continue
            mine = getattr(value, key)
            if mine != getattr(defaults, key):
                notes.append(Note(path, f"{target} cannot express it ({_shown(mine, key in sizes)} is not exported)"))
    return notes


def _size_fields(spec) -> set[str]:
    """The keys of a job table written as sizes (spec/common.py `Size`: bytes, shown in GiB)."""
    hints = typing.get_type_hints(spec, include_extras=True)
    return {key for key in spec.model_fields if hints.get(key) is Size}


def _shown(value: object, size: bool = False) -> str:
    if size and isinstance(value, int):
        return format_bytes(value)
    if isinstance(value, bool):
        return str(value).lower()  # as the job file writes it
    return repr(value) if isinstance(value, str) else str(value)


def model_parallel_size(source: dict[str, object], given: dict[str, object]) -> int:
    """tp x pp x cp of an imported plan: each degree as the command line gives it
    (`parallel.tp`, ...), else as the source config states it (`source`, by the same job
    keys), else 1; a value that is not a positive integer counts as 1 (the importer says why)."""
    product = 1
    for key in ("parallel.tp", "parallel.pp", "parallel.cp"):
        value = integral(given.get(key, source.get(key, 1)))
        product *= value if value is not None and value >= 1 else 1
    return product


def integral(value: object) -> int | None:
    """An integer written as such or as an integral float (`5e8` in JSON), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


AUTO = "'auto' is filled in by the Hugging Face Trainer; not read"

# DeepSpeed, torchtitan and accelerate offload only what their config asks for (DeepSpeed
# 0.19.8 zero/offload_config.py: `device` defaults to "none"; torchtitan 0.2.2
# job_config.py: `training.enable_cpu_offload` defaults to false; accelerate 1.15
# utils/dataclasses.py: `fsdp_offload_params` defaults to false). shardplan's default
# strategy ("balanced") offloads on its own when memory is short; an imported job asks for
# none ("conservative" adds nothing to what the job asks, core/memory.py), so that `estimate`
# answers whether the config fits as its framework runs it, and an export writes no offload
# the source did not have.
OFFLOAD_AS_WRITTEN = "conservative"


def offload_as_written(out: Imported) -> None:
    """Plan the offload of an imported config as its framework runs it: what it asks for, no more."""
    out.set("offload.strategy", OFFLOAD_AS_WRITTEN, "")


def float8_not_modelled(precision: str | None, what: str = "float8") -> str:
    """What shardplan does with float8 training (torchao's Float8Linear behind torchtitan's
    float8 converter, accelerate's fp8; `what` names it, or MX formats): it has no 8-bit
    datatype, so the linears' matmuls, the activations they save and FSDP's all-gathers are
    estimated at the job's precision."""
    bits = 32 if precision == "fp32" else 16
    kept = f"train.precision = {precision!r}" if precision else "the job's train.precision"
    return (f"{what} is not modelled: memory and step time are estimated as the same run without it "
            f"({kept}: matmuls, saved activations and all-gathers in {bits} bits)")


class Reader:
    """Typed reads from one table of a foreign config; wrong types become problems, keys
    never read become notes (`unread`)."""

    def __init__(self, data: dict, prefix: str, out: Imported, written_as: dict[str, str] | None = None):
        self.data = data
        self.prefix = prefix
        self.out = out
        self.seen: set[str] = set()
        # name -> the dotted key the source wrote it as, where that differs (an older name)
        self.written_as = written_as or {}

    def key(self, name: str) -> str:
        if name in self.written_as:
            return self.written_as[name]
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> object:
        self.seen.add(name)
        return self.data.get(name)

    def _typed(self, name: str, check: Callable[[object], object | None], what: str,
               sized: bool = False) -> object | None:
        value = self.raw(name)
        if value is None:
            return None
        if value == "auto" and sized:
            # Hugging Face Trainer / accelerate configs leave sizes to the launcher, which fills
            # them in from the model and its own arguments (transformers integrations/deepspeed.py).
            self.out.note(self.key(name), AUTO)
            return None
        typed = check(value)
        if typed is None:
            self.out.problem(self.key(name), f"expected {what}, got {_shown(value)}")
        return typed

    def int(self, name: str, minimum: int = 0) -> int | None:
        value = self._typed(name, integral, "an integer", sized=True)
        if value is not None and value < minimum:
            self.out.problem(self.key(name), f"must be >= {minimum} (got {value})")
            return None
        return value

    def bool(self, name: str) -> bool | None:
        return self._typed(name, lambda v: v if isinstance(v, bool) else None, "true or false")

    def str(self, name: str) -> str | None:
        return self._typed(name, lambda v: v if isinstance(v, str) else None, "a string")

    def number(self, name: str) -> float | None:
        def check(v: object) -> float | None:
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        return self._typed(name, check, "a number", sized=True)

    def table(self, name: str) -> dict | None:
        return self._typed(name, lambda v: v if isinstance(v, dict) else None, "a table")

    def choice(self, name: str, choices: Iterable[str], fold: bool = True) -> str | None:
        value = self.str(name)
        if value is None:
            return None
        options = list(choices)
        match = next((c for c in options if (c.lower() == value.lower() if fold else c == value)), None)
        if match is None:
            self.out.problem(self.key(name), f"must be one of {', '.join(options)} (got {value!r})")
        return match

    def unread(self, why: str = "not read: shardplan has no setting for it") -> None:
        """A note for every key of this table that no read touched."""
        for name in self.data:
            if name not in self.seen:
                self.out.note(self.key(name), why)
