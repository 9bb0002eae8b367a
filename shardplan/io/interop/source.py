"""Reading a foreign config and telling which framework wrote it, from its content.

A DeepSpeed config is a JSON object, a torchtitan job config a TOML file, an accelerate
config a YAML file; each parses into a `Document` whose `lines` map dotted keys to lines,
so problems point at the user's line. The file's name is not trusted: a `ds_config.txt` or
a YAML file without a suffix are read for what they contain. A file a source refers to
(accelerate's `deepspeed_config_file`) is read here too, so that importers stay pure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...spec.errors import InputError, Problem
from ..files import Document, _read_text, json_key_lines, parse_json, parse_toml, refuse_surrogates

# Keys that only each format's configs have at the top (DeepSpeed's config-json docs,
# torchtitan's JobConfig tables, accelerate's ClusterConfig).
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "gradient_clipping",
    "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "tensor_parallel", "flops_profiler", "comms_logger", "data_types", "communication_data_type",
}
TORCHTITAN_TABLES = {
    "job", "parallelism", "training", "activation_checkpoint", "lr_scheduler", "metrics", "profiling",
    "checkpoint", "compile", "float8", "mx", "quantize", "comm", "memory_estimation", "fault_tolerance",
    "experimental", "validation", "debug", "optimizer", "model",
}
ACCELERATE_KEYS = {
    "compute_environment", "distributed_type", "mixed_precision", "num_processes", "num_machines",
    "fsdp_config", "deepspeed_config", "parallelism_config", "machine_rank", "main_training_function",
    "use_cpu", "downcast_bf16", "gpu_ids", "rdzv_backend", "same_network",
}
# Tables of a shardplan job file that a torchtitan config never has.
_SHARDPLAN_TABLES = {"parallel", "zero", "offload", "train", "lora", "cluster"}

FORMATS = {
    "deepspeed": "DeepSpeed config (JSON)",
    "torchtitan": "torchtitan job config (TOML)",
    "accelerate": "accelerate config (YAML)",
}
_NONE_OF_THEM = "not a DeepSpeed config (JSON), a torchtitan job config (TOML) or an accelerate config (YAML)"


def yaml_document(text: str, shown: str) -> Document:
    """Parse YAML with PyYAML's safe loader, keeping the line of every mapping key."""
    import yaml  # imported here: planning commands never pay for it

    lines: dict[str, int] = {}

    def walk(current, prefix: str) -> None:
        """Every mapping key's line; a key given twice in one mapping is refused (PyYAML
        keeps the last silently, so one of the two settings would be lost)."""
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                dotted = f"{prefix}.{key.value}" if prefix else str(key.value)
                if key.tag != _YAML_STR:  # `2:`, `true:`, `null:` are numbers, booleans, nothing
                    kind = _YAML_KINDS.get(key.tag.rsplit(":", 1)[-1], "something else")
                    raise InputError(Problem(dotted, f"a key must be a name, and YAML reads {key.value!r} as "
                                                     f"{kind} (quote it)", file=shown, line=key.start_mark.line + 1))
                if dotted in lines:
                    raise InputError(Problem(dotted, f"given twice (lines {lines[dotted]} and "
                                                     f"{key.start_mark.line + 1})", file=shown,
                                             line=key.start_mark.line + 1))
                lines[dotted] = key.start_mark.line + 1
                walk(value, dotted)

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
        walk(node, "")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(Problem("", f"invalid YAML: {problem}", file=shown,
                                 line=mark.line + 1 if mark else None)) from None
    except RecursionError:
        raise InputError(Problem("", "invalid YAML: nested too deeply", file=shown)) from None
    document = Document(shown, data if isinstance(data, dict) else {"": data}, lines)
    refuse_surrogates(document.data, shown, "YAML")
    return document


_YAML_STR = "tag:yaml.org,2002:str"
_YAML_KINDS = {"int": "a number", "float": "a number", "bool": "a boolean", "null": "no value",
               "timestamp": "a date"}


def detect(doc: Document, kind: str) -> str | None:
    """The framework whose config `doc` is (`kind`: the syntax it parsed as), else None."""
    keys = set(doc.data)
    if kind == "json" and keys & DEEPSPEED_KEYS:
        return "deepspeed"
    if kind == "toml" and keys & TORCHTITAN_TABLES and not keys & _SHARDPLAN_TABLES:
        if all(isinstance(doc.data[k], dict) for k in keys & TORCHTITAN_TABLES):
            return "torchtitan"
    if kind == "yaml" and keys & ACCELERATE_KEYS:
        return "accelerate"
    return None


def read_source(path: str) -> tuple[str, Document]:
    """(format, document) of a foreign config; one clear InputError when it is none of them."""
    text = _read_text(Path(path), path)
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = parse_json(text, path)
        except InputError as json_error:
            # YAML's flow style opens with `{` too (gpt-neox's *.yml configs, with comments):
            # a file not named *.json is read as YAML when it is not JSON.
            if path.lower().endswith(".json"):
                raise json_error from None
            return _yaml_source(text, path, json_error)
        doc.lines = json_key_lines(text, path)  # outside the try: a key given twice is refused as such
        found = detect(doc, "json")
        if found:
            return found, doc
        raise InputError(Problem("", f"{_NONE_OF_THEM}: a JSON object without DeepSpeed's keys "
                                     "(train_batch_size, zero_optimization, bf16, ...)", file=path))
    try:
        doc = parse_toml(text, path)
    except InputError as toml_error:
        doc = None
        if path.lower().endswith(".toml"):
            raise toml_error from None
    if doc is not None:
        found = detect(doc, "toml")
        if found:
            return found, doc
        if set(doc.data) & _SHARDPLAN_TABLES:
            raise InputError(Problem("", "is a shardplan job file already (use it as it is)", file=path))
        if doc.data:
            raise InputError(Problem("", f"{_NONE_OF_THEM}: TOML without torchtitan's tables "
                                         "([parallelism], [training], [model], ...)", file=path))
    return _yaml_source(text, path)


def _yaml_source(text: str, path: str, json_error: InputError | None = None) -> tuple[str, Document]:
    """(format, document) of a text read as YAML; `json_error`: why it is not JSON, the one
    problem given when it is no YAML config either (a JSON file with a typo, whatever its name)."""
    try:
        doc = yaml_document(text, path)
    except InputError:
        _refuse_arguments(text, path)
        if json_error is not None:
            raise json_error from None
        raise
    found = detect(doc, "yaml")
    if found:
        return found, doc
    if json_error is not None and set(doc.data) & DEEPSPEED_KEYS and not path.lower().endswith((".yml", ".yaml")):
        raise json_error from None  # a DeepSpeed config that is not valid JSON
    if set(doc.data) == {""}:  # not a mapping: a YAML scalar, as a shell script's words parse
        _refuse_arguments(text, path)
    raise InputError(Problem("", _NONE_OF_THEM, file=path))


# A long option (`--tensor-model-parallel-size`, `--bf16`, `--lr=3e-4`), not YAML's `---`.
_FLAG = re.compile(r"--[A-Za-z][\w-]*")


# torchrun's own options (torch/distributed/run.py `get_args_parser`), in both spellings: a
# launch script gives them before the training script's.
_LAUNCHER_FLAGS = frozenset("--" + name.replace("{}", sep) for name in (
    "nnodes", "nproc{}per{}node", "node{}rank", "master{}addr", "master{}port", "rdzv{}backend", "rdzv{}endpoint",
    "rdzv{}id", "rdzv{}conf", "standalone", "max{}restarts", "monitor{}interval", "start{}method", "role",
    "no{}python", "run{}path", "log{}dir", "redirects", "tee", "local{}addr", "local{}ranks{}filter")
    for sep in "-_")


def _refuse_arguments(text: str, path: str) -> None:
    """One clear line for a file of command-line arguments (what `export --to megatron` writes,
    or a launch script): it names the first option given to the training script (the first
    after a `*.py` word, else the first that is not torchrun's, else the first) and its line.
    Nothing happens when the text has none."""
    first = after_script = not_launcher = None
    seen_script = False
    for number, line in enumerate(text.splitlines(), start=1):
        for word in line.split("#", 1)[0].split():
            if word.endswith(".py"):
                seen_script = True
                continue
            flag = _FLAG.fullmatch(word.split("=", 1)[0])
            if flag is None:
                continue
            first = first or (number, flag.group(0))
            if flag.group(0) not in _LAUNCHER_FLAGS:
                not_launcher = not_launcher or (number, flag.group(0))
            if seen_script:
                after_script = after_script or (number, flag.group(0))
    found = after_script or not_launcher or first
    if found is None:
        return
    line, flag = found
    raise InputError(Problem(flag, "command-line arguments (Megatron-LM's pretrain_gpt.py takes these) are not "
                                   "imported: `shardplan import` reads a DeepSpeed JSON, a torchtitan TOML or an "
                                   "accelerate YAML config; `shardplan export --to megatron` writes Megatron-LM "
                                   "arguments", file=path, line=line))


DEEPSPEED_CONFIG_FILE = "deepspeed_config.deepspeed_config_file"


@dataclass(frozen=True)
class Referenced:
    """A file a source config names, as read, and how its path was resolved where that is
    not plain (a sentence for a note at the source's key; empty otherwise)."""

    doc: Document
    resolved: str = ""


def read_referenced(fmt: str, doc: Document) -> dict[str, Referenced]:
    """The files a source config names and its importer reads, by the source's dotted key:
    accelerate's `deepspeed_config_file` under `distributed_type: DEEPSPEED`.

    accelerate opens that path as it is, from the working directory of `accelerate launch`
    (accelerate/utils/deepspeed.py, `HfDeepSpeedConfig`: `os.path.exists(config_file_or_dict)`,
    then `open`); a relative path not found there is looked for beside the YAML file. Where
    the two folders differ, the note says which file was read. Found in neither: one problem
    naming the path, at the YAML's key."""
    if fmt != "accelerate":
        return {}
    kind = doc.data.get("distributed_type")
    section = doc.data.get("deepspeed_config")
    name = section.get("deepspeed_config_file") if isinstance(section, dict) else None
    if not (isinstance(kind, str) and kind.upper() == "DEEPSPEED" and isinstance(name, str) and name):
        return {}  # a value that is not a path: the importer names what is wrong with it
    beside = os.path.join(os.path.dirname(doc.path), name)
    here, there = os.path.isfile(name), os.path.isfile(beside)
    same_folder = os.path.isabs(name) or os.path.realpath(beside) == os.path.realpath(name)
    if not (here or there):
        places = name if same_folder else f"{name} (the working directory) and {beside}"
        raise InputError(Problem(DEEPSPEED_CONFIG_FILE, f"{name}: no such file (accelerate opens it from the "
                                                        f"working directory of `accelerate launch`; looked for "
                                                        f"{places})", file=doc.path,
                                 line=doc.line_of(DEEPSPEED_CONFIG_FILE)))
    found, resolved = (name if here else beside), ""
    if not same_folder and here:
        other = f", not {beside} beside this file" if there else ""
        resolved = f"read {name} from the working directory, where accelerate opens it{other}"
    elif not same_folder:
        resolved = (f"{name} is not in the working directory, where accelerate opens it (from where "
                    f"`accelerate launch` runs): read {beside}, beside this file")
    text = _read_text(Path(found), found)
    referenced = parse_json(text, found, key_lines=True)
    return {DEEPSPEED_CONFIG_FILE: Referenced(referenced, resolved)}
