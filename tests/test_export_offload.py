"""`export` writes the offload the estimate decided, not only what the job file states.

A job may leave offload to its strategy (`[offload] strategy`, core/memory.py
`decide_offload`): the plan fits only with what the strategy moves to the CPU, so the exported
config must move it too, in the target's own keys, or say on stderr what it writes instead and
whether that still fits. Explicit offload exports as it always has. The frameworks' own config
code reads the exports where it is installed (the `interop` extra), as in test_interop_*.py.
"""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from conftest import DATA, run_cli
from shardplan.spec.units import format_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGETS = ("deepspeed", "torchtitan", "accelerate", "megatron")

# Llama 2 13B with ZeRO-3 over 8 GPUs, GPU memory cut so that the balanced strategy must offload
# (`shardplan estimate`): at 24 GiB the optimizer states only (fsdp2: peak 18.26 GiB), at 10 GiB
# also the gradients and the parameters of 21 of 40 layers, at 7 GiB every layer's (6.80 GiB).
OPTIMIZER = """
[model]
preset = "llama-2-13b"
[parallel]
dp = 8
[zero]
stage = 3
[train]
seq_len = 2048
activation_checkpointing = "full"
[cluster]
preset = "a100-40gb"
gpu_memory = "24GiB"
"""
LAYERS = OPTIMIZER.replace('"24GiB"', '"10GiB"')
EVERY_LAYER = OPTIMIZER.replace('"24GiB"', '"7GiB"')
# The same plan under DeepSpeed's accounting: the strategy offloads the optimizer states
# (offload_optimizer), which DeepSpeed can write exactly.
DEEPSPEED_OPTIMIZER = OPTIMIZER.replace("stage = 3\n", 'stage = 3\nframework = "deepspeed"\n')

# docs/plan.md's walk-through: `shardplan plan finetune-70b.toml --write best.toml`. ZeRO-0, tp 4 x
# pp 4 on 16 A100 80GB: it fits only with the optimizer states offloaded.
PIPELINE = """
[model]
preset = "llama-3-70b"
[train]
seq_len = 4096
activation_checkpointing = "none"
global_batch_size = 64
[cluster]
preset = "a100-80gb"
nodes = 2
[parallel]
dp = 1
tp = 4
pp = 4
cp = 1
sequence_parallel = true
micro_batch_size = 1
num_microbatches = 64
pipeline_schedule = "interleaved-1f1b"
virtual_stages = 4
[zero]
stage = 0
hybrid = false
"""

# docs/finetune.md: `shardplan plan qlora-70b.toml --set lora.base_dtype=bf16 --gpus 1 --write
# l.toml`. LoRA on a bf16 Llama-3 70B on one H100: it fits only with the optimizer states,
# the gradients and the parameters of 66 of 80 layers on the CPU.
LORA_BASE_ON_CPU = """
[model]
preset = "llama-3-70b"
[train]
seq_len = 2048
precision = "bf16-mixed"
activation_checkpointing = "full"
global_batch_size = 16
[lora]
rank = 16
alpha = 32
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
base_dtype = "bf16"
[cluster]
preset = "h100-80gb"
[parallel]
dp = 1
tp = 1
pp = 1
cp = 1
sequence_parallel = false
micro_batch_size = 8
num_microbatches = 2
[zero]
stage = 3
hybrid = false
"""
QLORA_70B = """
[model]
preset = "llama-3-70b"
[train]
seq_len = 2048
global_batch_size = 16
precision = "bf16-mixed"
[lora]
rank = 16
alpha = 32
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
base_dtype = "nf4"
[cluster]
preset = "h100-80gb"
"""
WHOLE_OFFLOAD = ["--set", "offload.params=true", "--set", "offload.grads=true", "--set", "offload.optimizer=true",
                 "--set", "offload.gpu_param_budget=0"]
# What the estimate documents are compared on (decisions and warnings name how the plan was reached).
FIGURES = ("params", "devices", "peak_gpu_bytes", "cpu_bytes_per_node", "fits", "host")


def export(path: str, target: str, *flags: str) -> tuple[dict | list, dict[str, str]]:
    """(the exported config, {job key: note}); stderr carries the same notes as the JSON."""
    result = run_cli("export", path, "--to", target, "--json", *flags)
    assert result.code == 0, result.err
    notes = result.json["notes"]
    assert [f"export: {n['path']}: {n['message']}" for n in notes] == \
        [line for line in result.err_lines if line.startswith("export: ")]
    config = result.json["config"]
    return (config["args"] if target == "megatron" else config), {n["path"]: n["message"] for n in notes}


def estimate(path: str, *flags: str) -> dict:
    result = run_cli("estimate", path, "--json", *flags)
    assert result.code == 0, result.err
    return result.json


def decided(path: str) -> dict:
    """The offload the estimate decided (`assumptions.offload`), checked to be more than the job asks."""
    doc = estimate(path)
    assert doc["fits"] and doc["decisions"], doc["decisions"]
    return doc["assumptions"]["offload"]


def peak_in(note: str) -> str:
    """The peak a note's fit states: `peak 6.80 GiB of 24.00 GiB per GPU` -> `6.80 GiB`."""
    match = re.search(r"peak (\S+ \S+) of", note)
    assert match, note
    return match.group(1)


def test_jobs_leave_offload_to_the_strategy(write):
    """The jobs below state no offload; their estimates decide it (what the tests rely on)."""
    assert decided(write("o.toml", OPTIMIZER)) == {"params": False, "grads": False, "optimizer": True,
                                                   "resident_layers": [40], "cpu_compression": "none"}
    [kept] = decided(write("l.toml", LAYERS))["resident_layers"]
    assert 0 < kept < 40  # some layers' parameters offloaded, not all (the notes below say how many)
    assert decided(write("e.toml", EVERY_LAYER))["resident_layers"] == [0]
    assert decided(write("p.toml", PIPELINE))["optimizer"] is True
    lora = decided(write("lora.toml", LORA_BASE_ON_CPU))
    assert lora["params"] and 0 < lora["resident_layers"][0] < 80


def offloaded_layers(path: str) -> int:
    """How many layers' parameters the strategy offloads (its decision, which the notes name)."""
    [kept] = decided(path)["resident_layers"]
    return LAYER_COUNTS[path.rsplit("/", 1)[-1]] - kept


LAYER_COUNTS = {"job.toml": 40, "l.toml": 80}  # llama-2-13b, llama-3-70b


# -- what each target writes -------------------------------------------------------------------
def test_deepspeed_writes_the_decided_optimizer_offload(write):
    config, notes = export(write("job.toml", OPTIMIZER), "deepspeed")
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero
    # fsdp2 decided the optimizer states alone; ZeRO-Offload moves the gradient partitions too.
    assert notes["offload"].startswith("the balanced strategy offloads optimizer states: written as optimizer "
                                       "states and gradients (offload_optimizer moves")
    assert "which fits (deepspeed accounting: peak" in notes["offload"]


def test_deepspeed_exact_decision_needs_no_note(write):
    config, notes = export(write("job.toml", DEEPSPEED_OPTIMIZER), "deepspeed")
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload" not in notes and "offload.grads" not in notes


def test_deepspeed_pin_memory_as_the_job_says(write):
    config, _ = export(write("job.toml", DEEPSPEED_OPTIMIZER), "deepspeed", "--set", "offload.pin_memory=false")
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


def test_deepspeed_writes_parameter_offload_of_every_layer(write):
    """DeepSpeed's offload_param moves every parameter: the strategy's share of the 40 layers becomes all 40."""
    path = write("job.toml", LAYERS)
    config, notes = export(path, "deepspeed")
    zero = config["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert f"the parameters of {offloaded_layers(path)} of 40 layers: written as optimizer states, gradients and the parameters of " \
           "every layer (offload_param offloads every layer's parameters)" in notes["offload"]
    assert "offload.gpu_param_budget" not in notes  # the budget did not decide: the strategy did


def test_deepspeed_zero0_offload_is_written_at_stage_1(write):
    """DeepSpeed offloads optimizer states with ZeRO stages 1-3 only (offload_optimizer,
    deepspeed/runtime/zero/offload_config.py): the ZeRO-0 plan is written at stage 1, which over
    one data-parallel rank shards nothing, and fits as DeepSpeed allocates it."""
    config, notes = export(write("job.toml", PIPELINE), "deepspeed")
    zero = config["zero_optimization"]
    assert zero["stage"] == 1 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert notes["zero.stage"].startswith("deepspeed offloads optimizer states only with ZeRO stages 1-3")
    assert "which fits (deepspeed accounting" in notes["offload"]


@pytest.mark.parametrize("target, key", [("torchtitan", "enable_cpu_offload"), ("accelerate", "fsdp_offload_params")])
def test_fsdp2_targets_write_whole_offload_for_the_optimizer(write, target, key):
    """FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states of every layer;
    it cannot offload the optimizer alone, so the nearest setting is all of it, and it fits."""
    config, notes = export(write("job.toml", OPTIMIZER), target)
    section = config["training"] if target == "torchtitan" else config["fsdp_config"]
    assert section[key] is True
    assert notes["offload"].startswith(f"{key} moves the parameters, gradients and optimizer states of every layer "
                                       "together; the balanced strategy offloads optimizer states: written as "
                                       f"{key} = true")
    assert "which fits (fsdp2 accounting: peak" in notes["offload"]


@pytest.mark.parametrize("target, key", [("torchtitan", "enable_cpu_offload"), ("accelerate", "fsdp_offload_params")])
def test_fsdp2_targets_exact_whole_offload_needs_no_note(write, target, key):
    config, notes = export(write("job.toml", EVERY_LAYER), target)
    section = config["training"] if target == "torchtitan" else config["fsdp_config"]
    assert section[key] is True and "offload" not in notes


def test_accelerate_offloads_the_lora_base_of_every_layer(write):
    """docs/finetune.md's LoRA with a bf16 base on one H100: the strategy keeps 14 of 80 layers
    on the GPU; FSDP2 offloads all of them, which fits too."""
    path = write("l.toml", LORA_BASE_ON_CPU)
    config, notes = export(path, "accelerate")
    assert config["fsdp_config"]["fsdp_offload_params"] is True
    assert f"the balanced strategy offloads optimizer states, gradients and the parameters of {offloaded_layers(path)} of 80 layers: " \
           "written as fsdp_offload_params = true" in notes["offload"]
    assert "which fits" in notes["offload"]


def test_torchtitan_says_the_lora_plan_does_not_fit_without_fsdp(write):
    """torchtitan applies FSDP, and its CPU offload, only over more than one shard rank: on one
    GPU it cannot offload, and the export says the plan then does not fit."""
    config, notes = export(write("l.toml", LORA_BASE_ON_CPU), "torchtitan")
    assert config["training"]["enable_cpu_offload"] is False
    assert notes["offload"].startswith("torchtitan offloads to the CPU only under FSDP")
    assert "written as enable_cpu_offload = false, which does not fit (fsdp2 accounting: peak" in notes["offload"]
    assert notes["offload"].endswith("; as written, a run stops out of memory: give torchtitan more data-parallel "
                                     "ranks to shard over (`shardplan plan --gpus N`), or export to deepspeed, which "
                                     "offloads on one data-parallel rank")
    # The advice holds: the DeepSpeed export of the same plan offloads, and fits.
    config, notes = export(write("l.toml", LORA_BASE_ON_CPU), "deepspeed")
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "which fits (deepspeed accounting" in notes["offload"]


def test_accelerate_zero0_cannot_offload_and_says_what_would(write):
    """FSDP2's offload moves parameters too, which shardplan plans only at ZeRO-3: the ZeRO-0
    pipeline plan is written without offload, with the fit and the stage that would fit."""
    config, notes = export(write("job.toml", PIPELINE), "accelerate")
    assert config["fsdp_config"]["fsdp_offload_params"] is False
    assert "which shardplan plans only with zero.stage = 3 (got 0)" in notes["offload"]
    assert "which does not fit" in notes["offload"]
    assert notes["offload"].endswith("; as written, a run stops out of memory: export it with --zero 3, with "
                                     "which fsdp_offload_params = true fits")
    # The advice holds: the export it names writes the offload, and says it fits.
    config, notes = export(write("job.toml", PIPELINE), "accelerate", "--zero", "3")
    assert config["fsdp_config"]["fsdp_offload_params"] is True
    assert "written as fsdp_offload_params = true" in notes["offload"] and "which fits" in notes["offload"]


def test_torchtitan_pipeline_plan_without_fsdp_says_it_does_not_fit(write):
    config, notes = export(write("job.toml", PIPELINE), "torchtitan")
    assert config["training"]["enable_cpu_offload"] is False
    assert "the balanced strategy offloads optimizer states: written as enable_cpu_offload = false, which does " \
           "not fit" in notes["offload"]


def megatron_args(args: list[str]) -> dict[str, str | None]:
    """{--flag: value or None}, every flag checked against Megatron-LM's parser as recorded
    (tests/data/interop/megatron_arguments.json, as in test_interop_megatron.py)."""
    record = json.loads((DATA / "interop" / "megatron_arguments.json").read_text())["arguments"]
    parsed, i = {}, 0
    while i < len(args):
        flag = args[i]
        assert flag in record, f"{flag} is not a Megatron-LM argument"
        takes = record[flag]["takes_value"]
        parsed[flag] = args[i + 1] if takes else None
        i += 2 if takes else 1
    return parsed


def test_megatron_writes_the_decided_optimizer_offload(write):
    args, notes = export(write("job.toml", OPTIMIZER), "megatron")
    parsed = megatron_args(args)
    assert parsed["--optimizer-cpu-offload"] is None and parsed["--optimizer-offload-fraction"] == "1.0"
    assert "--use-precision-aware-optimizer" in parsed  # Megatron's validate_args requires it
    assert parsed["--data-parallel-sharding-strategy"] == "optim_grads_params"  # Megatron-FSDP: distributed optimizer
    assert "offload" not in notes  # the optimizer alone, as decided, and it fits


def test_megatron_zero0_offload_uses_the_distributed_optimizer(write):
    """--use-precision-aware-optimizer, which Megatron's CPU offload runs on, requires the
    distributed optimizer (megatron/core/optimizer/__init__.py, `get_megatron_optimizer`)."""
    args, notes = export(write("job.toml", PIPELINE), "megatron")
    parsed = megatron_args(args)
    assert "--use-distributed-optimizer" in parsed and "--optimizer-cpu-offload" in parsed
    assert notes["zero.stage"].startswith("megatron offloads the optimizer only with its distributed optimizer")


def test_megatron_says_what_it_cannot_offload(write):
    path = write("job.toml", LAYERS)
    args, notes = export(path, "megatron")
    assert "--optimizer-cpu-offload" in args
    assert notes["offload"].startswith("megatron offloads optimizer states only (--optimizer-cpu-offload); the "
                                       "balanced strategy offloads optimizer states, gradients and the parameters "
                                       f"of {offloaded_layers(path)} of 40 layers: written as optimizer states, which does not fit")
    assert notes["offload"].endswith("; as written, a run stops out of memory: search again with more GPUs "
                                     "(`shardplan plan --gpus N`)")


@pytest.mark.parametrize("target", TARGETS)
def test_the_docs_lora_plan_exports_its_offload(write, target):
    """The command lines of the defect: plan, write, export; whatever plan the search picks,
    when its estimate offloads, the export carries the offload or a note on it."""
    job = write("qlora-70b.toml", QLORA_70B)
    best = job.replace("qlora-70b.toml", "l.toml")
    result = run_cli("plan", job, "--set", "lora.base_dtype=bf16", "--gpus", "1", "--write", best)
    assert result.code == 0, result.err
    offload = decided(best)
    config, notes = export(best, target)
    text = json.dumps(config)
    carried = {"deepspeed": '"offload_optimizer": {"device": "cpu"', "torchtitan": '"enable_cpu_offload": true',
               "accelerate": '"fsdp_offload_params": true', "megatron": "--optimizer-cpu-offload"}[target]
    assert carried in text or "offload" in notes, notes
    assert offload["params"] or offload["optimizer"]


# -- explicit offload exports unchanged ---------------------------------------------------------
# gpt2-xl-offload-a100-40gb states its offload (parameters beyond a 1 GiB budget, gradients,
# optimizer) and fits with it: the strategy adds nothing. Its exports, as before this change.
EXPLICIT = {
    "deepspeed": ({"stage": 3, "reduce_bucket_size": 500000000, "stage3_prefetch_bucket_size": 50000000,
                   "stage3_max_live_parameters": 1000000000, "stage3_param_persistence_threshold": 100000,
                   "sub_group_size": 1000000000,
                   "offload_optimizer": {"device": "cpu", "pin_memory": True},
                   "offload_param": {"device": "cpu", "pin_memory": True}},
                  {"offload.gpu_param_budget": "deepspeed's offload_param offloads every layer's parameters; the "
                                               "plan keeps 8 of 48 layers on the GPU"}),
    "torchtitan": (False, {"offload": "torchtitan offloads to the CPU only under FSDP, which it applies only with "
                                      "data_parallel_shard_degree or context_parallel_degree above 1; written as "
                                      "enable_cpu_offload = false"}),
    "accelerate": (True, {"offload.gpu_param_budget": "FSDP2's CPU offload offloads every layer's parameters; the "
                                                      "plan keeps 8 of 48 layers on the GPU"}),
    "megatron": (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--use-precision-aware-optimizer"],
                 {"offload.optimizer": "megatron offloads the optimizer with its distributed optimizer "
                                       "(--use-distributed-optimizer, ZeRO-1)",
                  "offload.params": "megatron cannot offload params to the CPU",
                  "offload.grads": "megatron cannot offload grads to the CPU"}),
}


@pytest.mark.parametrize("target", TARGETS)
def test_explicit_offload_exports_unchanged(target):
    assert estimate("gpt2-xl-offload-a100-40gb")["decisions"] == []
    config, notes = export("gpt2-xl-offload-a100-40gb", target)
    written, expected_notes = EXPLICIT[target]
    if target == "deepspeed":
        assert config["zero_optimization"] == written
    elif target == "torchtitan":
        assert config["training"]["enable_cpu_offload"] is written
    elif target == "accelerate":
        assert config["fsdp_config"]["fsdp_offload_params"] is written
    else:
        at = config.index("--optimizer-cpu-offload")
        assert config[at:at + 4] == written and "--use-distributed-optimizer" not in config
    for path, message in expected_notes.items():
        assert notes[path] == message
    assert not any("strategy" in message for message in notes.values())


def test_the_kept_layers_are_the_estimates():
    """The 1 GiB budget of gpt2-xl-offload-a100-40gb keeps 8 of GPT-2 XL's 48 layers (12 h^2 +
    13 h = 30.7M fp32 parameters per layer at h = 1,600: 8 x 30.7M x 4 bytes fit 1 GiB, 9 do
    not), as the estimate decides them; the notes above name those layers, not the budget's
    bytes."""
    assert estimate("gpt2-xl-offload-a100-40gb")["assumptions"]["offload"]["resident_layers"] == [8]


@pytest.mark.parametrize("target", ["deepspeed", "accelerate", "torchtitan"])
def test_a_deepspeed_job_keeps_no_layer_to_note(write, target):
    """Under the `deepspeed` accounting parameter offload keeps no layer on the GPU (offload_param
    moves every partition), whatever `gpu_param_budget` says: no export says that the plan keeps
    layers there (each said it kept the default budget's 2 GiB)."""
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n[zero]\nstage = 3\n'
                            'framework = "deepspeed"\n[offload]\nparams = true\noptimizer = true\n')
    assert estimate(job)["assumptions"]["offload"]["resident_layers"] == [0]
    _, notes = export(job, target)
    assert "offload.gpu_param_budget" not in notes


@pytest.mark.parametrize("target", TARGETS)
def test_conservative_strategy_exports_the_job_as_written(write, target):
    """The same job, its strategy told to add nothing (`conservative`): no offload is written,
    so the offload above is the strategy's."""
    config, notes = export(write("job.toml", OPTIMIZER), target, "--set", "offload.strategy=conservative")
    text = json.dumps(config)
    assert "offload_optimizer" not in text and "--optimizer-cpu-offload" not in text
    assert '"enable_cpu_offload": true' not in text and '"fsdp_offload_params": true' not in text
    assert "offload" not in notes


# -- round trips: import of the export estimates as the exported plan --------------------------
def test_deepspeed_round_trip_estimates_the_decided_plan(write):
    """Exact: the strategy's offload_optimizer, imported, is the plan the estimate decided."""
    job = write("job.toml", DEEPSPEED_OPTIMIZER)
    out = job.replace("job.toml", "ds.json")
    assert run_cli("export", job, "--to", "deepspeed", "-o", out).code == 0
    back = run_cli("import", out, "--set", "model.preset=llama-2-13b", "--set", "cluster.preset=a100-40gb",
                   "--set", "cluster.gpu_memory=24GiB", "--set", "train.seq_len=2048")
    assert back.code == 0, back.err
    imported = estimate(write("back.toml", back.out))
    original = estimate(job)
    assert imported["decisions"] == [] and original["decisions"]
    for key in FIGURES:
        assert imported[key] == original[key], key


@pytest.mark.parametrize("target", ["deepspeed", "torchtitan", "accelerate"])
def test_round_trip_estimates_what_the_note_says(write, target):
    """Approximate: the import of the export estimates as the setting the note names, with the
    note's figures (DeepSpeed: its own accounting; FSDP2 targets: the whole-model offload)."""
    job = write("job.toml", OPTIMIZER)
    out = job.replace("job.toml", f"exported.{target}")
    result = run_cli("export", job, "--to", target, "-o", out)
    assert result.code == 0, result.err
    note = next(line for line in result.err_lines if line.startswith("export: offload: "))
    flags = ["--set", "model.preset=llama-2-13b", "--set", "cluster.preset=a100-40gb", "--set",
             "cluster.gpu_memory=24GiB"]
    back = run_cli("import", out, *flags, *(["--dp", "8"] if target == "deepspeed" else []))
    assert back.code == 0, back.err
    imported = estimate(write("back.toml", back.out))
    if target == "deepspeed":
        written = estimate(job, "--framework", "deepspeed", "--set", "offload.optimizer=true",
                           "--set", "offload.grads=true")
    else:
        written = estimate(job, *WHOLE_OFFLOAD)
    assert imported["decisions"] == [] and written["decisions"] == []
    for key in FIGURES:
        assert imported[key] == written[key], key
    assert imported["fits"] is True
    assert peak_in(note) == format_bytes(imported["peak_gpu_bytes"])


@pytest.mark.parametrize("target", ["torchtitan", "accelerate"])
def test_fsdp2_round_trip_of_an_exact_decision(write, target):
    """Every layer offloaded, as the strategy decided: the import's estimate is the plan's."""
    job = write("job.toml", EVERY_LAYER)
    out = job.replace("job.toml", f"exported.{target}")
    assert run_cli("export", job, "--to", target, "-o", out).code == 0
    back = run_cli("import", out, "--set", "model.preset=llama-2-13b", "--set", "cluster.preset=a100-40gb",
                   "--set", "cluster.gpu_memory=7GiB")
    assert back.code == 0, back.err
    offload = tomllib.loads(back.out)["offload"]
    # The offload as the config writes it, and nothing more (an imported job offloads only as
    # written: io/interop/common.py `offload_as_written`).
    assert offload == {"params": True, "grads": True, "optimizer": True, "gpu_param_budget": 0,
                       "strategy": "conservative"}
    imported, original = estimate(write("back.toml", back.out)), estimate(job)
    for key in FIGURES:
        assert imported[key] == original[key], key


# -- the frameworks' own config code (the `interop` extra) ----------------------------------------
@pytest.mark.interop
@pytest.mark.parametrize("job, stage, param", [(OPTIMIZER, 3, False), (LAYERS, 3, True), (PIPELINE, 1, False)])
def test_deepspeed_reads_the_decided_offload(write, monkeypatch, job, stage, param):
    ds_config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is in the `interop` extra")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda group=None: 0)
    path = write("job.toml", job)
    config, _ = export(path, "deepspeed", "--set", "offload.pin_memory=false")
    zero = DeepSpeedZeroConfig(**config["zero_optimization"])  # extra="forbid": unknown keys raise
    assert zero.stage == stage
    assert zero.offload_optimizer.device == OffloadDeviceEnum.cpu and zero.offload_optimizer.pin_memory is False
    assert (zero.offload_param is not None) == param
    if param:
        assert zero.offload_param.device == OffloadDeviceEnum.cpu and zero.offload_param.pin_memory is False

    class DataParallelUnit:  # what DeepSpeedConfig asks of Megatron's mpu
        def get_data_parallel_world_size(self) -> int:
            return tomllib.loads(job)["parallel"]["dp"]

    parsed = ds_config.DeepSpeedConfig(config, mpu=DataParallelUnit())
    assert parsed.zero_optimization_stage == stage and parsed.zero_config.offload_optimizer.device == "cpu"


@pytest.mark.interop
def test_accelerate_builds_cpu_offload_from_the_export(write, monkeypatch):
    pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    job = write("job.toml", OPTIMIZER)
    out = job.replace("job.toml", "accelerate.yaml")
    assert run_cli("export", job, "--to", "accelerate", "-o", out).code == 0
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", out, "train.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"


@pytest.mark.interop
def test_torchtitan_reads_enable_cpu_offload(write):
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    job = write("job.toml", OPTIMIZER)
    out = job.replace("job.toml", "tt.toml")
    assert run_cli("export", job, "--to", "torchtitan", "-o", out).code == 0
    config = config_module.ConfigManager().parse_args(["--job.config_file", out])
    assert config.training.enable_cpu_offload is True
    assert config.parallelism.data_parallel_shard_degree == 8  # FSDP applies, and its offload with it


def test_megatron_export_is_shell_ready(write):
    """The Megatron export with the decided offload still splits into the recorded arguments."""
    result = run_cli("export", write("job.toml", PIPELINE), "--to", "megatron")
    assert result.code == 0, result.err
    megatron_args(shlex.split(result.out.replace("\\\n", " ")))


def test_a_stated_optimizer_offload_at_zero_0_exports_what_the_frameworks_run():
    """DeepSpeed ignores offload_optimizer at stage 0 (ZeRO-Offload runs on ZeRO's optimizer,
    zero/offload_config.py), and Megatron-LM's --use-precision-aware-optimizer, which its CPU
    offload needs, requires the distributed optimizer (megatron/core/optimizer/__init__.py): a
    job stating the offload at ZeRO 0 is written at stage 1, with a note."""
    args = ("export", "llama-3-8b-h100", "--zero", "0", "--set", "offload.optimizer=true", "--json")
    ds = run_cli(*args[:2], "--to", "deepspeed", *args[2:])
    assert ds.code == 0
    zero = ds.json["config"]["zero_optimization"]
    assert zero["stage"] == 1 and zero["offload_optimizer"]["device"] == "cpu"
    assert any(n["path"] == "zero.stage" and n["message"].startswith("deepspeed offloads optimizer states only")
               for n in ds.json["notes"])
    mg = run_cli(*args[:2], "--to", "megatron", *args[2:])
    assert mg.code == 0
    flags = mg.json["config"]["args"]
    assert "--use-distributed-optimizer" in flags and "--optimizer-cpu-offload" in flags
    assert [n["path"] for n in mg.json["notes"] if n["path"] in ("zero.stage", "offload.optimizer")] == ["zero.stage"]


@pytest.mark.parametrize("target", ["accelerate", "torchtitan"])
def test_the_fit_of_a_zero_1_export_is_the_stage_written(target):
    """FSDP2 writes ZeRO-1 as reshard_after_forward false, which shards the gradients too
    (ZeRO-2): the note's fit is that stage's estimate, not ZeRO-1's."""
    zero2 = run_cli("estimate", "llama-3-8b-h100", "--zero", "2", "--json").json["peak_gpu_bytes"]
    result = run_cli("export", "llama-3-8b-h100", "--zero", "1", "--to", target, "--json")
    assert result.code == 0
    notes = [n["message"] for n in result.json["notes"] if n["path"] == "offload"]
    assert notes and f"peak {format_bytes(zero2)}" in notes[0] and "which fits" in notes[0], notes


FSDP2_BEST = """
[model]
preset = "llama-3-8b"
[train]
seq_len = 8192
activation_checkpointing = "none"
global_batch_size = 64
[cluster]
preset = "h100-80gb"
nodes = 1
[parallel]
dp = 8
micro_batch_size = 1
num_microbatches = 8
[zero]
stage = 3
"""


def test_a_plan_that_does_not_fit_deepspeed_says_so(write):
    """`plan`'s best Llama-3 8B plan on 8 H100s (seq 8192, ZeRO-3, no recomputation) fits the
    fsdp2 accounting it was planned under but not DeepSpeed's (its flat buffers and bucket
    copies, docs/estimate.md): the export writes it as planned and says so, with the figures
    `estimate --framework deepspeed` gives; a plan that fits DeepSpeed gets no such note."""
    job = write("best.toml", FSDP2_BEST)
    assert run_cli("estimate", job, "--json").json["fits"] is True
    # as written (offload.strategy conservative: the export writes no offload the job does not ask for)
    ds = run_cli("estimate", job, "--framework", "deepspeed", "--set", "offload.strategy=conservative", "--json").json
    assert ds["fits"] is False
    notes = run_cli("export", job, "--to", "deepspeed", "--json").json["notes"]
    said = [n["message"] for n in notes if n["path"] == "zero.framework"]
    assert len(said) == 1 and "which does not fit (deepspeed accounting: peak" in said[0], notes
    assert format_bytes(ds["peak_gpu_bytes"]) in said[0]
    fits = write("fits.toml", FSDP2_BEST.replace('activation_checkpointing = "none"', 'activation_checkpointing = "full"'))
    assert run_cli("estimate", fits, "--framework", "deepspeed", "--set", "offload.strategy=conservative",
                   "--json").json["fits"] is True
    assert not any(n["path"] == "zero.framework" for n in run_cli("export", fits, "--to", "deepspeed", "--json").json["notes"])


def test_accelerate_checks_the_fit_of_the_layout_it_writes(write):
    """accelerate has no pipeline parallel: the tp 4 x pp 4 plan is written as 16 processes of
    dp_shard 4 x tp 4 (`parallelism_config`), each with the whole model. The offload note's
    figures are that layout's, estimated as `estimate` gives them for the job that says it
    (they were the pipelined plan's, 47.49 GiB where the written layout needs another peak)."""
    config, notes = export(write("job.toml", PIPELINE), "accelerate", "--zero", "3")
    assert config["parallelism_config"]["parallelism_config_dp_shard_size"] == 4
    assert config["fsdp_config"]["fsdp_offload_params"] is True
    written = (PIPELINE.replace("dp = 1\n", "dp = 4\n").replace("pp = 4\n", "pp = 1\n")
               .replace('pipeline_schedule = "interleaved-1f1b"\nvirtual_stages = 4\n', "")
               .replace("stage = 0\n", "stage = 3\n")
               .replace("global_batch_size = 64\n", ""))  # the note's micro batch 1 x 64 steps, per rank
    figures = estimate(write("written.toml", written), *WHOLE_OFFLOAD, "--set", "offload.strategy=conservative")
    assert peak_in(notes["offload"]) == format_bytes(figures["peak_gpu_bytes"])
    assert "which fits" in notes["offload"]
