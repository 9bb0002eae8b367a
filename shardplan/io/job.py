"""From a file (or a job preset) and command-line flags to a checked, resolved job.

The order is: read the file, write the overrides in, expand a cluster preset, validate the
tables (pydantic), resolve the model (preset, config.json or inline shape), then check the
cross-field rules. Every problem found on the way is reported together, at its file, line
and dotted path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from pydantic import ValidationError

from ..core.checks import job_problems
from ..core.degrees import Degrees
from ..spec.errors import InputError, Problem
from ..spec.job import JobSpec
from ..spec.model import ModelShape, ModelSpec, resolve_shape
from ..spec.units import counted, quoted
from .files import Document, read_document, unreadable_path_kind
from .hf_config import config_key, looks_like_hf_config, model_kind, read_hf_config
from .overrides import Override, apply_overrides
from .presets import find_preset, list_presets
from .problems import did_you_mean, problems_from_validation
from .writing import job_folders


@dataclass(frozen=True)
class ResolvedJob:
    """A valid job with its model resolved, ready for the planner."""

    file: str
    job: JobSpec
    shape: ModelShape | None
    model_name: str
    worlds: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    data_file: str = ""  # data.path as `run` opens it: relative to the job file (io/writing.py `job_folders`)
    # Where each key came from, for problems found after resolving (`locate`).
    document: Document | None = field(default=None, repr=False, compare=False)
    flagged: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def degrees(self) -> Degrees:
        par = self.job.parallel
        return Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)

    @property
    def world(self) -> int:
        return self.degrees.world

    def locate(self, problems: list[Problem]) -> list[Problem]:
        """Problems found after resolving (a data file's contents, a key the plan search cannot
        keep), at the flag or the file line that gave their key, as the job's own are."""
        return _locate(problems, self.document or Document("", {}), self.flagged)

    @property
    def params_only(self) -> int | None:
        """The bare parameter count of a `params` model (no architecture), else None."""
        return self.job.model.params


def _why_not_a_file(path: Path) -> str | None:
    """Why `path` names no file to read ("no such file", "is a directory", or why it cannot
    even be looked at: a name too long, a folder this user may not search), else None."""
    try:
        if path.is_dir():
            return "is a directory"
        return None if path.exists() else "no such file"
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"


def open_job_source(source: str | None) -> Document:
    """A job file, else a job preset of that name; None gives an empty job (all defaults)."""
    if source is None:
        return Document("", {})
    if not source.strip():
        raise InputError(Problem("", "names no file: give a job file or a job preset name", file="''"))
    path = Path(source)
    looks_like_path = path.suffix in (".toml", ".json") or os.sep in source or "/" in source
    if looks_like_path or _why_not_a_file(path) != "no such file":  # read_document says what is wrong
        if _why_not_a_file(path) is None:
            _yaml_hint(path)
            _script_hint(path)
        return read_document(path)
    try:
        preset = find_preset(source, "jobs")
    except InputError:
        raise InputError(Problem("", "no such file or job preset" + _preset_hint(source), file=source)) from None
    return read_document(preset.path)


FRAMEWORK_NAMES = {"deepspeed": "a DeepSpeed config", "torchtitan": "a torchtitan config",
                   "accelerate": "an accelerate config"}


def _foreign_config(doc: Document) -> list[Problem]:
    """Another framework's config given where a job goes (io/interop/source.py `detect`): one
    line pointing to `shardplan import`, instead of every one of its keys called unknown."""
    if not doc.path:
        return []
    from .interop.source import TORCHTITAN_TABLES, detect

    framework = detect(doc, "json" if doc.path.lower().endswith(".json") else "toml")
    # `import` takes a lone [model] table as torchtitan's; where a job goes it is the job's own
    # [model] (or [checkpoint]): only a table torchtitan alone has makes it torchtitan's.
    if framework is None or (framework == "torchtitan"
                             and not set(doc.data) & (TORCHTITAN_TABLES - set(JobSpec.model_fields))):
        return []
    return [Problem("", f"{FRAMEWORK_NAMES[framework]}, not a shardplan job: `shardplan import {doc.path} -o "
                        "job.toml` turns it into one", file=doc.path)]


def _yaml_hint(path: Path) -> None:
    """A YAML file (an accelerate config) given where a job goes: TOML would call it invalid."""
    if path.suffix.lower() in (".yaml", ".yml"):
        raise InputError(Problem("", f"a YAML file, not a shardplan job (TOML): `shardplan import {path} -o job.toml` "
                                     "reads an accelerate config", file=str(path)))


def _script_hint(path: Path) -> None:
    """A shell script (a Megatron-LM or torchrun launch) given where a job goes: TOML would
    call it invalid at its first command."""
    if path.suffix.lower() not in (".sh", ".bash", ".slurm", ".sbatch"):
        if not path.is_file():
            return  # a named pipe or a device is not opened here (read_document refuses it)
        try:
            with path.open("rb") as handle:
                if handle.read(2) != b"#!":
                    return
        except OSError:
            return  # read_document says why it cannot be read
    raise InputError(Problem("", "a shell script, not a shardplan job (TOML): command-line arguments are not "
                                 "imported; `shardplan import` reads a DeepSpeed JSON, a torchtitan TOML or an "
                                 "accelerate YAML config", file=str(path)))


def _preset_hint(name: str) -> str:
    """What a name that is no job means: a model or cluster preset (how to give it), a job
    preset misspelt, or nothing known."""
    for kind, key in (("models", "model.preset"), ("clusters", "cluster.preset")):
        if any(p.name == name for p in list_presets(kind)):
            return f"; {name} is a {kind[:-1]} preset: give it as --set {key}={name}"
    return did_you_mean(name, [p.name for p in list_presets("jobs")]) or " (see `shardplan presets`)"


def hf_config_as_job(doc: Document) -> tuple[Document, list[Problem]]:
    """A Hugging Face config.json given where a job is expected: the job whose model it is
    (`[model] hf_config`, every other table at its defaults), and a note saying so."""
    if not doc.path or not looks_like_hf_config(doc.data):
        return doc, []
    name = Path(doc.path).name
    kind = model_kind(doc.data)
    what = f"a Hugging Face config.json ({kind})" if kind else "a Hugging Face config.json"
    note = Problem("", f"{what}: planned as the model of a job with default "
                       f"tables, as [model] hf_config = {name!r} would", severity="note", file=doc.path)
    return Document(doc.path, {"model": {"hf_config": doc.path}}), [note]  # as given: relative to here


def _expand_cluster_preset(data: dict) -> list[Problem]:
    """A cluster preset, then the GPU preset it or the job names (`cluster.gpu`), fill the
    `[cluster]` keys the job leaves unset."""
    problems = []
    for key, kind in (("preset", "clusters"), ("gpu", "gpus")):
        cluster = data.get("cluster")
        if not isinstance(cluster, dict) or not isinstance(cluster.get(key), str):
            continue
        try:
            preset = find_preset(cluster[key], kind, f"cluster.{key}")
        except InputError as exc:
            problems += exc.problems
            continue
        base = read_document(preset.path).data.get("cluster", {})
        if key == "preset":
            base = _without_other_gpu(base, cluster)
        data["cluster"] = {**base, **cluster}
    return problems


def _without_other_gpu(base: dict, cluster: dict) -> dict:
    """A cluster preset's keys, less its GPU's figures when the job names another GPU: the
    node's shape and RAM stay the preset's, the memory and speeds are the named GPU's (its
    preset fills them next)."""
    gpu = cluster.get("gpu")
    if not isinstance(gpu, str) or not isinstance(base.get("gpu"), str) or base["gpu"] == gpu:
        return base
    try:
        figures = read_document(find_preset(base["gpu"], "gpus", "cluster.gpu").path).data.get("cluster", {})
    except InputError:
        return base
    return {k: v for k, v in base.items() if k not in figures}


def _unknown_model_preset(data: dict) -> list[Problem]:
    """A model preset that cannot be found, listed with the other problems of tables that do
    not validate (a preset that hides nothing, as a cluster preset)."""
    model = data.get("model")
    name = model.get("preset") if isinstance(model, dict) else None
    if not isinstance(name, str):
        return []
    try:
        find_preset(name, "models", "model.preset")
    except InputError as exc:
        return list(exc.problems)
    return []


def _resolve_model(spec: ModelSpec, base_dir: Path) -> tuple[ModelShape | None, str, list[Problem]]:
    if spec.source == "preset":
        preset = find_preset(spec.preset or "", "models", "model.preset")
        table = read_document(preset.path).data.get("model", {})
        try:
            inline = ModelSpec.model_validate(table)
        except ValidationError as exc:
            problems = problems_from_validation(ModelSpec, exc)
            return None, "", [p.at(str(preset.path)) for p in problems]
        shape, problems = resolve_shape(inline.shape_table())
        return shape, spec.preset or "", [p.at(str(preset.path)) for p in problems]
    if spec.source == "hf_config":
        config_path = Path(spec.hf_config or "")
        if not config_path.is_absolute():
            config_path = base_dir / config_path
        why = _why_not_a_file(config_path)  # a device or a pipe is read as a file is
        if why:
            return None, "", [Problem("model.hf_config", f"{spec.hf_config!r}: {why}")]
        table, notes, config = read_hf_config(config_path, spec.hf_config or "")
        family = table.get("family", "")

        def named(problems: list[Problem]) -> list[Problem]:  # the config's own keys, at their lines
            out = []
            for problem in problems:
                key = config_key(family, problem.path)
                out.append(replace(problem, path=key).at(spec.hf_config, config.line_of(key) if key else None))
            return out

        try:  # the same bounds as a shape written in the job file
            ModelSpec.model_validate(table)
        except ValidationError as exc:
            return None, "", named(problems_from_validation(ModelSpec, exc))
        shape, problems = resolve_shape(table, where="")
        problems += notes  # keys the plan reads past (quantization_config, Gemma-2's soft-capping)
        return shape, table.get("name", config_path.name), named(problems)
    if spec.source == "shape":
        shape, problems = resolve_shape(spec.shape_table())
        return shape, spec.name or (f"{shape.family} (inline)" if shape else ""), problems
    if spec.source == "params":
        return None, f"{spec.params} parameters", []
    return None, "", []


def _default_seq_len(job: JobSpec, shape: ModelShape | None) -> JobSpec:
    """A seq_len nobody wrote never exceeds the model: it becomes the model's longest."""
    limit = shape.max_seq_len if shape else None
    if limit is None or "seq_len" in job.train.model_fields_set or job.train.seq_len <= limit:
        return job
    return job.model_copy(update={"train": job.train.model_copy(update={"seq_len": limit})})


def external_worlds(job: JobSpec, world: int | None, env: Mapping[str, str]) -> list[tuple[int, str]]:
    """World sizes given outside the degrees: --world, torchrun's WORLD_SIZE, the cluster."""
    worlds = []
    if world is not None:
        worlds.append((world, "from --world"))
    raw = env.get("WORLD_SIZE")
    if raw is not None:
        text = raw.strip()
        # ASCII digits only (str.isdigit takes "²"); more than 20 is past any world.
        if not (text.isascii() and text.isdigit()) or int(text[:20]) < 1:
            raise InputError(Problem("WORLD_SIZE", f"environment variable is {quoted(raw)}, not a positive integer"))
        if len(text) > 20:
            raise InputError(Problem("WORLD_SIZE", f"environment variable is {quoted(raw)}, more than the largest "
                                                   "supported world"))
        worlds.append((int(text), "from WORLD_SIZE"))
    if job.cluster_given():
        c = job.cluster
        worlds.append((c.nodes * c.gpus_per_node, f"from cluster: {counted(c.nodes, 'node')} * {counted(c.gpus_per_node, 'GPU')}"))
    return worlds


# Keys a validator sets from another key when they are not written (spec/job.py: an FSDP
# sharding name in zero.stage sets zero.hybrid): a problem at the first, unwritten, belongs
# to where the second was given.
IMPLIED_BY = {"zero.hybrid": "zero.stage"}


def _source_path(path: str, doc: Document, flagged: dict[str, str]) -> str:
    implied = IMPLIED_BY.get(path)
    if implied and path not in flagged and not _written(doc.data, path) and (
            implied in flagged or _written(doc.data, implied)):
        return implied
    return path


def _locate(problems: list[Problem], doc: Document, flagged: dict[str, str]) -> list[Problem]:
    located = []
    for problem in problems:
        path = _source_path(problem.path, doc, flagged) if problem.path else ""
        if problem.keys:  # a rule across keys: at the flag of one it checks, else at `path` in the file
            flag = next((flagged[key] for key in problem.keys if key in flagged), None)
        else:
            flag = _flag_of(path, doc, flagged) if path else None
        if problem.file:
            located.append(problem)
        elif flag is not None:
            located.append(problem.at(flag))
        else:
            line = doc.line_of(path) if path else None
            if line is None:  # a table the file does not write: the line of a key the rule checks
                line = next(filter(None, map(doc.line_of, problem.keys)), None)
            located.append(problem.at(doc.path or None, line))
    return located


def _flag_of(path: str, doc: Document, flagged: dict[str, str]) -> str | None:
    """The flag a problem at `path` comes from: the one that set `path`, or a value it holds
    (`lora.targets.1` of `--set lora.targets=[...]`), or the table it created (`paralel` of
    `--set paralel.dp=2`, when the file has no such table); else None (the file's)."""
    if path in flagged:
        return flagged[path]
    for key, flag in flagged.items():
        if path.startswith(key + "."):
            return flag
    if not _written(doc.data, path):
        for key, flag in flagged.items():
            if key.startswith(path + "."):
                return flag
    return None


def _written(data: dict, path: str) -> bool:
    """Whether the file itself holds `path` (a table or key), whatever its syntax."""
    node: object = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load_job(
    source: str | None,
    overrides: list[Override] | None = None,
    world: int | None = None,
    env: Mapping[str, str] | None = None,
    flag_labels: dict[str, str] | None = None,
    check_paths: bool = False,
    warn_only: Callable[[Problem], bool] | None = None,
) -> ResolvedJob:
    """Read, override, validate and resolve a job; raise `InputError` with every problem.

    `flag_labels` maps a dotted path set on the command line to the flag that set it, so a
    problem there names the flag instead of the file. With `check_paths`, files the job
    names for `run` (data.path) must exist. Cross-field problems for which `warn_only` holds
    are reported as warnings (a command that does not depend on them still runs).
    """
    return resolve_document(open_job_source(source), overrides, world, env, flag_labels, check_paths, warn_only)


def resolve_document(
    doc: Document,
    overrides: list[Override] | None = None,
    world: int | None = None,
    env: Mapping[str, str] | None = None,
    flag_labels: dict[str, str] | None = None,
    check_paths: bool = False,
    warn_only: Callable[[Problem], bool] | None = None,
) -> ResolvedJob:
    """`load_job` for tables already read (a job file, or one built by `shardplan import`)."""
    env = os.environ if env is None else env
    doc, notes = hf_config_as_job(doc)
    overrides = overrides or []
    flagged = {path: (flag_labels or {}).get(path, "--set") for path, _ in overrides}
    data = apply_overrides(doc.data, overrides)
    unknown_cluster = _expand_cluster_preset(data)
    try:
        job = JobSpec.model_validate(data)
    except ValidationError as exc:  # the tables must be valid before any rule relates them
        foreign = _foreign_config(doc)
        if foreign:
            raise InputError(foreign) from None
        found = unknown_cluster + _unknown_model_preset(data) + problems_from_validation(JobSpec, exc)
        raise InputError(notes + _locate(found, doc, flagged)) from None
    folders = job_folders(doc.path, overrides, config_as_job=bool(notes))
    try:
        shape, name, model_problems = _resolve_model(job.model, Path(folders["model", "hf_config"]))
    except InputError as exc:
        shape, name, model_problems = None, "", exc.problems
    job = job.model_copy(update={"lora": job.lora.for_model(shape)}) if job.lora else job  # peft's all-linear
    # A model that cannot be resolved hides nothing else: the rules that need no model still
    # run. The cross-field rules need the cluster a preset names, so an unknown one stops them.
    problems, worlds = [], []
    if not unknown_cluster:
        job = _default_seq_len(job, shape)
        worlds = external_worlds(job, world, env)
        problems = job_problems(job, shape, worlds)
    if "model" in job.model_fields_set and job.model.source is None:
        problems.append(Problem(
            "model", "the table names no model, so nothing model-dependent is checked (give preset, "
            "hf_config, params, or an inline shape with family)", severity="warning"))
    data_file = ""
    if job.data.path:
        data_path = Path(job.data.path)
        if not data_path.is_absolute():
            data_path = Path(folders["data", "path"]) / data_path
        data_file = str(data_path)
        kind = unreadable_path_kind(data_path)  # a named pipe's open() would wait for a writer
        why = _why_not_a_file(data_path) or (f"is {kind}, not a file of token ids" if kind else None)
        if why:
            problems.append(Problem(
                "data.path", f"{job.data.path!r}: " + ("is a directory, not a file" if why == "is a directory" else why),
                severity="error" if check_paths else "warning",
            ))
    problems = _locate(problems, doc, flagged)
    if warn_only is not None:
        problems = [replace(p, severity="warning") if warn_only(p) else p for p in problems]
    problems = _locate(unknown_cluster + model_problems, doc, flagged) + problems
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise InputError(notes + problems)
    return ResolvedJob(doc.path, job, shape, name, worlds, notes + problems, data_file, doc, flagged)
