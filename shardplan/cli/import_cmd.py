"""`shardplan import FILE [-o F] [plan flags]`: a DeepSpeed config JSON, a torchtitan job
config TOML or an accelerate config YAML as a shardplan job file."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from ..io.files import Document
from ..io.interop.common import Imported, model_parallel_size
from ..io.interop.source import FORMATS, Referenced, read_referenced, read_source
from ..io.job import resolve_document
from ..io.overrides import apply_overrides
from ..io.presets import find_preset
from ..io.writing import job_folders, output_target, refuse_overwriting_input, relocate_job_paths, write_text
from ..render.output import emit_diagnostics, emit_json
from ..spec.errors import InputError, Problem
from ..spec.model import SHAPE_KEYS, SOURCE_KEYS
from .options import JsonFlag, PlanFlags, WorldOption, plan_flags

# Tables in the order a person reads a job file.
_TABLE_ORDER = ("model", "parallel", "zero", "offload", "train", "lora", "data", "checkpoint", "cluster")


def _model_value(overrides: list[tuple[str, object]], preset: str | None, key: str) -> int | None:
    """A shape key of the model (`num_layers`, `hidden_size`) where it is known before
    validation (an inline shape or a preset given on the command line, else the preset the
    source names)."""
    model = {path.split(".")[1]: value for path, value in overrides if path.startswith("model.")}
    if isinstance(model.get(key), int):
        return model[key]
    name = model.get("preset") if isinstance(model.get("preset"), str) else preset
    if not name or any(k in model for k in ("hf_config", "params", "family")):
        return None
    try:
        from ..io.files import read_document

        value = read_document(find_preset(name, "models").path).data.get("model", {}).get(key)
    except InputError:
        return None
    return value if isinstance(value, int) else None


def check_degrees(overrides: list[tuple[str, object]], labels: dict[str, str]) -> None:
    """The parallel degrees given on the command line (`--dp 0`, `--set parallel.tp=x`), checked
    before an importer compares them with the config: a bad one is the flag's fault, named as
    the job's own validation names it (`--dp 0: parallel.dp: must be >= 1 (got 0)`), not the
    config's key it disagrees with. (--world is checked by its option: at least 1.)"""
    from pydantic import ValidationError

    from ..io.problems import problems_from_validation
    from ..spec.job import JobSpec

    given = dict(overrides)  # the last of a key given twice, as apply_overrides keeps it
    degrees = {key: given[f"parallel.{key}"] for key in ("dp", "tp", "pp", "cp") if f"parallel.{key}" in given}
    if not degrees:
        return
    try:
        JobSpec.model_validate({"parallel": degrees})
    except ValidationError as exc:
        problems = problems_from_validation(JobSpec, exc)
        raise InputError([p.at(labels.get(p.path, "--set")) for p in problems]) from None


def convert(fmt: str, data: dict, overrides: list[tuple[str, object]], world: int | None = None,
            referenced: dict[str, Referenced] | None = None) -> Imported:
    """Run the importer of `fmt` with what the command line already decides. Without --dp,
    --world gives the data-parallel size as DeepSpeed and torchtitan derive it: the world
    over tp x pp x cp; an accelerate config takes --world (or --dp) as the number of processes
    when it leaves num_processes to `accelerate launch`. `referenced`: the files the config
    names (source.py `read_referenced`)."""
    given = dict(overrides)
    dp = given.get("parallel.dp") if isinstance(given.get("parallel.dp"), int) else None
    said = ""
    if dp is None and world is not None and fmt in ("deepspeed", "torchtitan"):
        importer = importlib.import_module(f"..io.interop.{fmt}", __package__)
        model_parallel = model_parallel_size(importer.model_parallel_degrees(data), given)
        if world % model_parallel:
            raise InputError(Problem("--world", f"{world} is not a multiple of tp x pp x cp = {model_parallel} "
                                                "(the config's degrees and the command line's)"))
        dp = world // model_parallel
        said = f"--world {world} / tp x pp x cp {model_parallel} makes dp {dp}"
    model_given = any(path.split(".")[1] in (*SOURCE_KEYS, *SHAPE_KEYS) for path in given if path.startswith("model."))
    # The Hugging Face Trainer fills DeepSpeed's "auto" buckets from the hidden size.
    hidden = _model_value(overrides, None, "hidden_size")
    if fmt == "deepspeed":
        from ..io.interop.deepspeed import from_deepspeed

        return from_deepspeed(data, dp, said, hidden_size=hidden, given=given.keys())
    if fmt == "torchtitan":
        from ..io.interop.torchtitan import from_torchtitan, model_preset

        layers = _model_value(overrides, None if model_given else model_preset(data), "num_layers")
        return from_torchtitan(data, dp, layers, model_given, said)
    from ..io.interop.accelerate import from_accelerate

    return from_accelerate(data, referenced, world, dp, hidden_size=hidden, given=given.keys())


def job_text(tables: dict, source: str, fmt: str) -> str:
    import tomli_w

    ordered = {name: tables[name] for name in _TABLE_ORDER if tables.get(name)}
    header = f"# shardplan job imported from {source} ({FORMATS[fmt]})\n\n"
    return header + tomli_w.dumps(ordered)


@plan_flags
def import_config(
    file: Annotated[str, typer.Argument(help="a DeepSpeed config JSON, torchtitan job config TOML or accelerate config YAML")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the job file here (default, or -: stdout)")] = None,
    world: WorldOption = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """A DeepSpeed, torchtitan or accelerate config as a shardplan job file (TOML).

    The format is told from the content. The model comes from the config where it names one
    (torchtitan), else from --set model.preset=NAME, --params or an inline shape. Keys that
    are not read are named on stderr, one line each.
    """
    output = output_target(output, "--output")
    refuse_overwriting_input(output, file, "--output", "the job file")
    fmt, doc = read_source(file)
    overrides = flags.overrides()
    check_degrees(overrides, flags.labels())
    imported = convert(fmt, doc.data, overrides, world, read_referenced(fmt, doc))

    def located(problem: Problem) -> Problem:  # in the source, unless it names a referenced file
        return problem if problem.file else problem.at(file, doc.line_of(problem.path) if problem.path else None)

    if imported.problems:
        raise InputError([located(p) for p in imported.problems])
    notes_at = [located(Problem(n.path, n.message, file=n.file, line=n.line)) for n in imported.notes]
    ordered = sorted(notes_at, key=lambda p: (p.file != file, p.file, p.line or 1 << 30))  # in the files' order
    notes = [f"import: {p}" for p in ordered]
    lines = {path: doc.line_of(key) for path, key in imported.origin.items()
             if key and path not in imported.elsewhere and doc.line_of(key)}
    built = Document(file, apply_overrides(imported.tables, overrides), lines)

    def named(problem: Problem) -> Problem:  # messages name the user's key, then shardplan's
        key = imported.origin.get(problem.path)
        if not key or problem.file != file:
            return problem
        there, line = imported.elsewhere.get(problem.path, (file, problem.line))
        return replace(problem, path=key, message=f"{problem.path}: {problem.message}", file=there, line=line)

    try:
        resolved = resolve_document(built, overrides, world=world, flag_labels=flags.labels())
    except InputError as exc:
        raise InputError([named(p) for p in exc.problems]) from None
    tables = built.data
    if output:  # its relative paths as the loader read them, now meant from where it is written
        tables = relocate_job_paths(tables, job_folders(file, overrides), output)
    text = job_text(tables, file, fmt)
    if output:
        write_text(output, text, "--output")
    if json_out:
        emit_json({"format": fmt, "file": output, "job": tables,
                   "notes": [{"path": p.path, "file": p.file, "line": p.line, "message": p.message}
                             for p in notes_at]})
    elif not output:
        sys.stdout.write(text)
    emit_diagnostics(notes)
    emit_diagnostics(named(p) for p in resolved.warnings)
    if resolved.shape is None and resolved.params_only is None:
        emit_diagnostics([f"import: model: {file} names no model shardplan knows: add [model] preset = ... "
                          "(or --set model.preset=NAME) before `shardplan estimate`"])


def register(app: typer.Typer) -> None:
    app.command("import")(import_config)
