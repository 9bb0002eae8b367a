"""`shardplan export` / `shardplan import`: formats, notes, errors and round trips.

These need no framework installed; the targets' own code checks the same files in
test_interop_deepspeed.py, test_interop_torchtitan.py, test_interop_accelerate.py and
test_interop_megatron.py.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from conftest import DATA, run_cli
from interop_plans import PLANS
from shardplan.io.files import json_key_lines
from shardplan.io.interop.torchtitan import stage_fqns, torchtitan_split

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGETS = ("deepspeed", "torchtitan", "accelerate", "megatron")


def export(path: str, target: str, *flags: str) -> tuple[dict, list[str]]:
    result = run_cli("export", path, "--to", target, "--json", *flags)
    assert result.code == 0, result.err
    doc = result.json
    notes = [line for line in result.err_lines if line.startswith("export: ")]
    assert [f"export: {n['path']}: {n['message']}" for n in doc["notes"]] == notes
    return doc["config"], notes


def imported(path: str, *flags: str) -> tuple[dict, list[dict]]:
    result = run_cli("import", path, "--json", *flags)
    assert result.code == 0, result.err
    return result.json["job"], result.json["notes"]


def flat(value: object, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out.update(flat(inner, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: value}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_export_writes_each_target(write, target, plan):
    path = write("job.toml", PLANS[plan])
    config, notes = export(path, target)
    assert config
    for line in notes:  # one line per key, named by its dotted job path
        assert line.startswith("export: ") and line.count(": ") >= 2
    text = run_cli("export", path, "--to", target)
    assert text.code == 0
    if target == "deepspeed":
        assert json.loads(text.out) == config
    elif target == "torchtitan":
        assert tomllib.loads(text.out) == config
    elif target == "accelerate":
        import yaml

        assert yaml.safe_load(text.out) == config
    else:
        assert shlex.split(text.out.replace("\\\n", " ")) == config["args"]


def test_export_to_a_file(write, tmp_path):
    path = write("job.toml", PLANS["zero3_dp8"])
    out = tmp_path / "ds.json"
    result = run_cli("export", path, "--to", "deepspeed", "-o", str(out))
    assert result.code == 0 and result.out == ""
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 3


def test_export_deepspeed_batch_arithmetic(write):
    """train_batch_size = micro batch * accumulation * data-parallel size (DeepSpeed's
    config-json docs, "Batch Size Related Parameters")."""
    config, _ = export(write("job.toml", PLANS["zero2_offload_fp16"]), "deepspeed")
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (4 * 2 * 4, 2, 4)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (200_000_000, 100_000_000)
    assert config["fp16"] == {"enabled": True} and "bf16" not in config


def test_export_names_what_the_target_cannot_express(write):
    _, notes = export(write("job.toml", PLANS["pp4_interleaved"]), "deepspeed")
    paths = [line.split(": ")[1] for line in notes]
    # DeepSpeed's config has no pipeline stages (PipelineModule takes them in code), no
    # sequence length, steps or checkpoint folder.
    for key in ("parallel.pp", "parallel.pipeline_schedule", "parallel.virtual_stages", "parallel.first_stage_layers",
                "train.seq_len", "train.steps", "checkpoint.dir", "model"):
        assert key in paths, key
    assert len(paths) == len(set(paths))
    _, notes = export(write("job.toml", PLANS["pp4_interleaved"]), "megatron")
    # Megatron-LM carries every key but the split: see test_export_megatron_arguments.
    said = [line.split(": ")[1] for line in notes if line.split(": ")[1].startswith(("parallel.", "checkpoint.dir", "train."))]
    assert said == ["parallel.first_stage_layers"], notes


def test_export_torchtitan_stages(write):
    config, _ = export(write("job.toml", PLANS["pp4_interleaved"]), "torchtitan")
    par = config["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    parts = par["module_fqns_per_model_part"]
    counts = [sum(name.startswith("layers.") for name in part) for part in parts]
    assert len(parts) == 8 and counts[0] == 9 and counts[-1] == 9 and sum(counts) == 80  # llama-3-70b: 80 layers
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    # pipeline: the local batch is cut into microbatches of pipeline_parallel_microbatch_size
    assert config["training"]["local_batch_size"] == 16 and par["pipeline_parallel_microbatch_size"] == 1
    # torchtitan saves to {job.dump_folder}/{folder}, dump_folder "./outputs" by default
    # (torchtitan/components/checkpoint.py, CheckpointManager: os.path.join(base_folder, folder)).
    assert config["checkpoint"] == {"enable": True, "folder": "../ckpt", "interval": 50, "keep_latest_k": 3}


def test_export_megatron_arguments(write):
    result = run_cli("export", write("job.toml", PLANS["pp4_interleaved"]), "--to", "megatron")
    args = result.out.replace("\\\n", " ").split()
    pairs = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert pairs["--num-virtual-stages-per-pipeline-rank"] == "2"
    # The plan's 9 layers on the first and the last of 8 virtual stages (9/11/11/10/10/10/10/9): Megatron-LM
    # gives --decoder-first/last-pipeline-num-layers to the end ranks' chunks together and needs them
    # divisible by the virtual stages (transformer_config.py: "number of layers at first stage:
    # ... must be divisible by virtual pipeline parallel degree"), so the split is not written
    # and the note says Megatron-LM refuses it (`export --strict` exits 1 on it).
    assert "--decoder-first-pipeline-num-layers" not in pairs
    assert "megatron refuses this config: its interleaved schedule here needs the layers split evenly over pp x " \
           "virtual stages (arguments.py); the plan's 8 stages hold 9/11/11/10/10/10/10/9" in result.err
    assert pairs["--global-batch-size"] == str(2 * 1 * 16)
    assert pairs["--num-query-groups"] == "8"  # llama-3-70b: 8 key/value heads
    assert "--sequence-parallel" in args


@pytest.mark.parametrize("bad,message", [
    (["--to", "deepspeeed"], "--to: must be one of deepspeed, torchtitan, accelerate, megatron"),
    (["--to", "deepspeeed"], "did you mean 'deepspeed'"),
    ([], "--to: required: the target format, one of deepspeed, torchtitan, accelerate, megatron"),
])
def test_export_bad_target(write, bad, message):
    result = run_cli("export", write("job.toml", PLANS["zero3_dp8"]), *bad)
    assert result.code == 2 and message in result.err


def test_export_bad_job_and_json_error(write):
    path = write("job.toml", "[parallel]\ndp = 0\n")
    result = run_cli("export", path, "--to", "deepspeed", "--json")
    assert result.code == 2
    assert "job.toml:2: parallel.dp: must be >= 1" in result.err
    assert result.json["error"] == {"exit_code": 2, "problems": [
        {"file": path, "line": 2, "path": "parallel.dp", "message": "must be >= 1 (got 0)"}]}


# -- import ---------------------------------------------------------------------------------
DS_CONFIGS = {
    "all_three": {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e7, "stage3_max_live_parameters": 3e8,
                              "stage3_param_persistence_threshold": 1e4, "reduce_bucket_size": 2e8,
                              "sub_group_size": 1e8,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}},
    },
    "zero2_fp16": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True},
        # sub_group_size is the stage 3 optimizer's alone (deepspeed/runtime/engine.py line 2775):
        # not read at stage 2, and not written back.
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8,
                              "sub_group_size": 1e8},
        "activation_checkpointing": {"partition_activations": False},
    },
    "zero1_tp": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    },
    # BF16_Optimizer at stage 1 (DeepSpeed's data_types.grad_accum_dtype, runtime/config.py line
    # 556) and overlap_comm, both carried as zero.grad_accum_dtype and zero.overlap_comm.
    "zero1_bf16_fp32_accumulation": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 1, "overlap_comm": True},
    },
    "offload_unpinned": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "offload_param": {"device": "cpu", "pin_memory": False}},
    },
}
# DeepSpeed's config names no world size: these need --dp (the two that give all three batch
# keys derive it, 64 / (2 * 4) = 8, 32 / (2 * 2) = 8 and 16 / 1 = 16).
DS_FLAGS = {"all_three": [], "zero2_fp16": ["--dp", "4"], "zero1_tp": ["--dp", "4"], "offload_unpinned": [],
            "zero1_bf16_fp32_accumulation": []}


@pytest.mark.parametrize("name", sorted(DS_CONFIGS))
def test_deepspeed_round_trip(write, name):
    """import then export keeps every key the import read (the notes name the others)."""
    source = DS_CONFIGS[name]
    path = write("ds.json", json.dumps(source, indent=2))
    job, notes = imported(path, "--set", "model.preset=llama-2-7b", *DS_FLAGS[name])
    unread = {n["path"] for n in notes if n["message"].startswith("not read")}
    assert job["zero"]["framework"] == "deepspeed"
    out = write("job.toml", run_cli("import", path, "--set", "model.preset=llama-2-7b", *DS_FLAGS[name]).out)
    config, _ = export(out, "deepspeed")
    exported_keys = flat(config)
    for key, value in flat(source).items():
        if key in unread:
            continue
        assert key in exported_keys, key
        assert exported_keys[key] == value, key


def test_deepspeed_mics_is_hybrid(write):
    """MiCS (removed in DeepSpeed 0.19, runtime/config.py) shards inside groups of
    mics_shard_size ranks: read as hybrid sharding; the export says it cannot write it back."""
    path = write("ds.json", json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                                        "gradient_accumulation_steps": 1,
                                        "zero_optimization": {"stage": 3, "mics_shard_size": 4}}))
    job, notes = imported(path, "--set", "model.preset=llama-2-7b")
    assert job["zero"]["hybrid"] is True and job["cluster"]["gpus_per_node"] == 4
    assert any(n["path"] == "zero_optimization.mics_shard_size" for n in notes)
    _, lines = export(write("job.toml", run_cli("import", path, "--set", "model.preset=llama-2-7b").out), "deepspeed")
    assert any(line.startswith("export: zero.hybrid: deepspeed 0.19 has no hybrid sharding") for line in lines)


def test_deepspeed_batch_needs_dp(write):
    path = write("ds.json", json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}))
    result = run_cli("import", path)
    assert result.code == 2
    assert result.err_lines == [f"{path}:1: train_batch_size: with train_micro_batch_size_per_gpu but not "
                                "gradient_accumulation_steps the number of GPUs decides the rest: give --dp or --world"]
    job, _ = imported(path, "--dp", "8")
    assert job["parallel"] == {"dp": 8, "micro_batch_size": 2, "num_microbatches": 4}  # 64 / (2 * 8)
    # --world gives dp as DeepSpeed derives it: the world over the model-parallel degrees
    # (deepspeed/runtime/config.py `_set_batch_related_parameters` with the data-parallel
    # world size): 16 GPUs at tp 2 are 8 data-parallel ranks.
    job, _ = imported(path, "--world", "16", "--tp", "2")
    assert job["parallel"] == {"dp": 8, "micro_batch_size": 2, "num_microbatches": 4, "tp": 2}
    alone = write("alone.json", json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}))
    job, _ = imported(alone, "--world", "8")
    assert job["parallel"] == {"dp": 8, "micro_batch_size": 4, "num_microbatches": 2}
    three = write("three.json", json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                            "gradient_accumulation_steps": 2}))
    result = run_cli("import", three, "--world", "16")
    # A config exported from a pipeline plan: DeepSpeed's pipeline engine takes the stages from
    # the PipelineModule in code (deepspeed/runtime/pipe/module.py, `num_stages`), so the
    # message names the --pp that makes the batch add up.
    assert result.code == 2 and result.err_lines == [
        f"{three}:1: train_batch_size: 64 = 4 * 2 * 8 GPUs, but --world 16 / tp x pp x cp 1 makes dp 16; the "
        "pipeline stages of a PipelineModule are not in the config: with 2 times the --pp given (--pp 2 without "
        "one) it adds up"]
    job, _ = imported(three, "--world", "16", "--pp", "2")
    assert job["parallel"]["dp"] == 8 and job["parallel"]["pp"] == 2
    # Batch keys the Hugging Face Trainer fills in ("auto") leave dp to --world alone.
    auto = write("auto.json", json.dumps(dict.fromkeys(("train_batch_size", "train_micro_batch_size_per_gpu",
                                                        "gradient_accumulation_steps"), "auto")))
    job, _ = imported(auto, "--world", "8", "--set", "model.preset=llama-3-8b")
    assert job["parallel"]["dp"] == 8
    # A world the model-parallel degrees do not divide is said as such.
    result = run_cli("import", path, "--world", "9", "--tp", "2")
    assert result.code == 2 and result.err_lines == [
        "--world: 9 is not a multiple of tp x pp x cp = 2 (the config's degrees and the command line's)"]
    result = run_cli("import", path, "--world", "24", "--tp", "2")
    assert result.err_lines == [f"{path}:1: train_batch_size: 64 is not divisible by 2 * dp "
                                "(--world 24 / tp x pp x cp 2 makes dp 12)"]


@pytest.mark.parametrize("text,message", [
    ('{\n  "zero_optimization": {\n    "stage": 5\n  }\n}', ":3: zero_optimization.stage: must be 0, 1, 2 or 3 (got 5)"),
    ('{\n  "train_batch_size": 10,\n  "train_micro_batch_size_per_gpu": 3,\n  "gradient_accumulation_steps": 1\n}',
     ":2: train_batch_size: 10 is not train_micro_batch_size_per_gpu (3) * gradient_accumulation_steps (1) * "
     "a number of GPUs"),
    ('{\n  "zero_optimization": {"stage": "three"}\n}', ":2: zero_optimization.stage: expected an integer, got 'three'"),
    ('{\n  "bf16": {"enabled": true},\n  "fp16": {"enabled": true}\n}', ":3: fp16.enabled: bf16 and fp16 cannot both"),
    ('{\n  "zero_optimization": {\n    "offload_optimizer": {"device": "disk"}\n  }\n}',
     ":3: zero_optimization.offload_optimizer.device: must be one of cpu, nvme, none (got 'disk')"),
    ('{"train_batch_size": 8,}', ":1: invalid JSON"),
])
def test_deepspeed_bad_input(write, text, message):
    path = write("ds.json", text)
    result = run_cli("import", path, "--json")
    assert result.code == 2
    assert message in result.err, result.err
    assert result.json["error"]["exit_code"] == 2
    assert result.json["error"]["problems"][0]["file"] == path


@pytest.mark.parametrize("text,message", [
    ("", "not a DeepSpeed config (JSON), a torchtitan job config (TOML) or an accelerate config (YAML)"),
    ('{"hello": 1}', "a JSON object without DeepSpeed's keys"),
    ("[parallel]\ndp = 2\n", "is a shardplan job file already"),
    ("[server]\nport = 1\n", "TOML without torchtitan's tables"),
    ("name: x\nitems: [1, 2\n", "invalid YAML"),
    ("a: " + "[" * 100_000 + "\n", "invalid YAML: nested too deeply"),
    ("distributed_type: FSDP\nnum_processes: 8\nnum_processes: 16\n", "num_processes: given twice (lines 2 and 3)"),
    ("just: yaml\n", "not a DeepSpeed config (JSON)"),
    (b"\x00\x01", "is a binary file"),
])
def test_import_what_is_none_of_them(write, text, message):
    result = run_cli("import", write("config", text))
    assert result.code == 2 and len(result.err_lines) == 1
    assert message in result.err


def test_import_missing_file():
    result = run_cli("import", "no/such/ds.json")
    assert result.code == 2 and result.err_lines == ["no/such/ds.json: no such file"]


def test_import_notes_unread_keys_with_lines(write):
    path = write("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10,
                                        "gradient_clipping": 1.0, "zero_optimization": {"stage": 2,
                                                                                        "round_robin_gradients": True}},
                                       indent=2))
    result = run_cli("import", path)
    assert result.code == 0
    assert f"import: {path}:3: steps_per_print: not read: shardplan has no setting for it" in result.err_lines
    assert f"import: {path}:7: zero_optimization.round_robin_gradients: not read: shardplan has no setting for it" \
        in result.err_lines
    assert any("names no model" in line for line in result.err_lines)


def test_import_writes_a_job_that_validates(write, tmp_path):
    path = write("ds.json", json.dumps(DS_CONFIGS["all_three"]))
    out = tmp_path / "job.toml"
    result = run_cli("import", path, "-o", str(out), "--set", "model.preset=llama-3-8b")
    assert result.code == 0 and result.out == ""
    check = run_cli("validate", str(out))
    assert check.code == 0, check.err
    assert "dp 8" in check.out


def test_imported_deepspeed_estimate_equals_hand_written(write):
    """`estimate` of an imported DeepSpeed config equals `estimate --framework deepspeed` of
    the same plan written by hand."""
    path = write("ds.json", json.dumps(DS_CONFIGS["all_three"]))
    job = write("imported.toml", run_cli("import", path, "--set", "model.preset=llama-3-8b").out)
    hand = write("hand.toml", """
[model]
preset = "llama-3-8b"
[parallel]
dp = 8
micro_batch_size = 2
num_microbatches = 4
[zero]
stage = 3
reduce_bucket_size = 200000000
prefetch_bucket_size = 10000000
max_live_parameters = 300000000
param_persistence_threshold = 10000
sub_group_size = 100000000
[offload]
params = true
grads = true
optimizer = true
gpu_param_budget = 0
[train]
precision = "bf16-mixed"
lr = 2e-4
""")
    mine = run_cli("estimate", job, "--json")
    theirs = run_cli("estimate", hand, "--framework", "deepspeed", "--json")
    assert mine.code == theirs.code == 0
    assert mine.json == theirs.json


def test_deepspeed_documentation_example(write):
    """The ZeRO-Infinity config of DeepSpeed's ZeRO tutorial
    (https://www.deepspeed.ai/tutorials/zero/, "Offloading to CPU and NVMe with ZeRO-Infinity")."""
    path = write("ds_config.json", DEEPSPEED_TUTORIAL_ZERO_INFINITY)
    job, notes = imported(path, "--dp", "8", "--set", "model.preset=gpt2-xl")
    assert job["zero"] == {"framework": "deepspeed", "stage": 3, "prefetch_bucket_size": 10_000_000,
                           "max_live_parameters": 1_000_000_000, "param_persistence_threshold": 100_000,
                           "sub_group_size": 1_000_000_000, "reduce_bucket_size": 10_000_000}
    # strategy: DeepSpeed offloads what the config says and nothing more (common.py OFFLOAD_AS_WRITTEN)
    assert job["offload"] == {"optimizer": True, "grads": True, "params": True, "gpu_param_budget": 0,
                              "strategy": "conservative"}
    assert {n["path"] for n in notes if n["message"].startswith("not read")} == {
        "zero_optimization.contiguous_gradients", "zero_optimization.stage3_max_reuse_distance"}


# Copied from the tutorial's page into tests/data/interop/ds_zero_infinity.json.
DEEPSPEED_TUTORIAL_ZERO_INFINITY = (DATA / "interop" / "ds_zero_infinity.json").read_text()

TORCHTITAN_CONFIGS = {
    "fsdp_8b": """
[model]
name = "llama3"
flavor = "8B"
[optimizer]
name = "AdamW"
lr = 3e-4
[training]
local_batch_size = 2
global_batch_size = 64
seq_len = 8192
steps = 1000
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = 8
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
[activation_checkpoint]
mode = "full"
""",
    "hsdp_tp_70b": """
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 1
seq_len = 8192
enable_cpu_offload = true
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 4
tensor_parallel_degree = 8
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
[comm]
train_timeout_seconds = 600
""",
    "pp_405b": """
[model]
name = "llama3"
flavor = "405B"
[training]
local_batch_size = 16
seq_len = 8192
dtype = "bfloat16"
[parallelism]
data_parallel_shard_degree = 2
tensor_parallel_degree = 8
pipeline_parallel_degree = 8
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 1
fsdp_reshard_after_forward = "always"
[checkpoint]
enable = true
folder = "ckpt"
interval = 100
keep_latest_k = 2
[debug]
seed = 42
""",
}


def _reshard_bool(config: dict) -> bool:
    """torchtitan's fsdp_reshard_after_forward as the bool it applies: "default" reshards
    unless pipeline parallel is on (llama3/infra/parallelize.py, apply_fsdp)."""
    par = config.get("parallelism", {})
    policy = par.get("fsdp_reshard_after_forward", "default")
    return policy == "always" or (policy == "default" and par.get("pipeline_parallel_degree", 1) == 1)


@pytest.mark.parametrize("name", sorted(TORCHTITAN_CONFIGS))
def test_torchtitan_round_trip(write, name):
    source = tomllib.loads(TORCHTITAN_CONFIGS[name])
    path = write("tt.toml", TORCHTITAN_CONFIGS[name])
    job, notes = imported(path)
    assert job["model"]["preset"] in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
    noted = {n["path"] for n in notes}
    config, _ = export(write("job.toml", run_cli("import", path).out), "torchtitan")
    assert _reshard_bool(config) == _reshard_bool(source)
    mine = flat(config)
    for key, value in flat(source).items():
        if key in noted or key == "parallelism.fsdp_reshard_after_forward":
            continue
        assert mine.get(key) == value, key


def test_torchtitan_round_trips_single_rank_offload(write, tmp_path):
    """gpt2-xl-offload-a100-40gb (ZeRO-3 offload on one GPU): torchtitan applies FSDP, and
    enable_cpu_offload with it, only when data_parallel_shard_degree or context_parallel_degree
    is above 1 (torchtitan/distributed/parallel_dims.py `fsdp_enabled`,
    llama3/infra/parallelize.py). The export says so instead of writing an offload torchtitan
    would not do, and importing it gives back a job that validates, every key that was not
    named in a note equal to the preset's."""
    from shardplan.io.job import load_job

    out = str(tmp_path / "tt.toml")
    result = run_cli("export", "gpt2-xl-offload-a100-40gb", "--to", "torchtitan", "-o", out)
    assert result.code == 0, result.err
    noted = {line.split(": ")[1] for line in result.err_lines if line.startswith("export: ")}
    assert {"offload", "zero.stage"} <= noted, result.err
    config = tomllib.loads(open(out).read())
    assert config["training"]["enable_cpu_offload"] is False
    assert config["parallelism"]["data_parallel_shard_degree"] == 1
    back = run_cli("import", out, "--set", "model.preset=gpt2-xl")
    assert back.code == 0, back.err
    job = tomllib.loads(back.out)
    preset = load_job("gpt2-xl-offload-a100-40gb").job.model_dump()
    for table in ("parallel", "zero", "offload", "train"):
        for key, value in job.get(table, {}).items():
            if table in noted or f"{table}.{key}" in noted:
                continue
            assert value == preset[table][key], f"{table}.{key}"
    assert job["parallel"]["dp"] == 1 and job["train"]["activation_checkpointing"] == "full"
    assert run_cli("validate", write("job.toml", back.out)).code == 0


def test_torchtitan_offload_without_fsdp_is_said(write):
    text = "[parallelism]\ndata_parallel_shard_degree = 1\n[training]\nenable_cpu_offload = true\n"
    result = run_cli("import", write("tt.toml", text), "--set", "model.preset=llama-3-8b")
    assert result.code == 0, result.err
    assert any(":4: training.enable_cpu_offload: torchtitan offloads only under FSDP" in line
               for line in result.err_lines), result.err


def test_torchtitan_default_split_is_read(write):
    """Without module_fqns_per_model_part torchtitan splits the layers itself: Interleaved1F1B
    defaults to 2 stages per rank, embedding and head weigh one layer each
    (pipeline_parallel.py, `pipeline_llm` and `generate_llm_fqn_per_model_part`)."""
    job, _ = imported(write("tt.toml", TORCHTITAN_CONFIGS["pp_405b"]))
    par = job["parallel"]
    counts = torchtitan_split(16, 126, 1, 1)
    assert par["virtual_stages"] == 2 and par["pp"] == 8
    assert (par["first_stage_layers"], par["last_stage_layers"]) == (counts[0], counts[-1])
    assert par["num_microbatches"] == 16 and par["micro_batch_size"] == 1


def test_torchtitan_shard_degree_left_over(write):
    text = "[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 2\n"
    path = write("tt.toml", text)
    job, notes = imported(path, "--dp", "4", "--set", "model.preset=llama-3-8b")
    assert job["parallel"]["dp"] == 4 and job["zero"]["stage"] == 3
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b")
    assert result.code == 2  # docs/interop.md: -1 needs --dp or --world
    assert any("-1 takes the ranks left over" in line and ":2:" in line for line in result.err_lines)
    # --world: the shard degree is what the world leaves over tp x pp x cp and the replicate
    # degree (torchtitan/distributed/parallel_dims.py, ParallelDims._validate: dp_shard = -1
    # becomes world_size // (dp_replicate * cp * tp * pp)); --tp replaces the file's degree.
    job, _ = imported(path, "--world", "16", "--set", "model.preset=llama-3-8b")
    assert (job["parallel"]["dp"], job["parallel"]["tp"]) == (8, 2)
    job, _ = imported(path, "--world", "16", "--tp", "4", "--set", "model.preset=llama-3-8b")
    assert (job["parallel"]["dp"], job["parallel"]["tp"]) == (4, 4)
    hybrid = write("hsdp.toml", text + "data_parallel_replicate_degree = 2\n")
    job, _ = imported(hybrid, "--world", "16", "--set", "model.preset=llama-3-8b")
    assert job["parallel"]["dp"] == 8 and job["zero"]["hybrid"] is True
    result = run_cli("import", write("odd.toml", text + "data_parallel_replicate_degree = 3\n"), "--world", "16",
                     "--set", "model.preset=llama-3-8b")
    assert result.code == 2 and "3 does not divide --world 16 / tp x pp x cp 2 makes dp 8" in result.err


def test_torchtitan_unknown_flavor_is_said(write):
    result = run_cli("import", write("tt.toml", '[model]\nname = "llama3"\nflavor = "debugmodel"\n'), "--dp", "1")
    assert result.code == 0
    assert any("flavor 'debugmodel' has no shardplan preset" in line for line in result.err_lines)


@pytest.mark.parametrize("text,message", [
    ('[parallelism]\ntensor_parallel_degree = "two"\n', ":2: parallelism.tensor_parallel_degree: expected an integer"),
    ('[activation_checkpoint]\nmode = "sometimes"\n', ":2: activation_checkpoint.mode: must be one of"),
    ('[training]\nlocal_batch_size = 3\nglobal_batch_size = 10\n', ":3: training.global_batch_size: 10 is not a multiple"),
    ('[parallelism]\ndata_parallel_shard_degree = 0\n', ":2: parallelism.data_parallel_shard_degree: must be -1"),
])
def test_torchtitan_bad_input(write, text, message):
    result = run_cli("import", write("tt.toml", text), "--set", "model.preset=llama-3-8b")
    assert result.code == 2 and message in result.err, result.err


ACCELERATE_CONFIGS = {
    "fsdp2": """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 2
num_processes: 16
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: false
  fsdp_offload_params: false
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
""",
    "fsdp2_nd": """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: fp16
num_machines: 2
num_processes: 16
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_offload_params: true
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 100000000
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 4
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
""",
    "ddp": """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: 'no'
num_machines: 1
num_processes: 8
""",
}


@pytest.mark.parametrize("name", sorted(ACCELERATE_CONFIGS))
def test_accelerate_round_trip(write, name):
    import yaml

    source = yaml.safe_load(ACCELERATE_CONFIGS[name])
    path = write("acc.yaml", ACCELERATE_CONFIGS[name])
    _, notes = imported(path, "--set", "model.preset=llama-3-8b")
    noted = {n["path"] for n in notes}
    config, _ = export(write("job.toml", run_cli("import", path, "--set", "model.preset=llama-3-8b").out),
                       "accelerate")
    mine = flat(config)
    for key, value in flat(source).items():
        if key not in noted:
            assert mine.get(key) == value, key


def test_accelerate_fsdp1_strategies(write):
    """FSDP1's sharding strategies are ZeRO stages (torch ShardingStrategy; spec/job.py)."""
    expected = {"FULL_SHARD": (3, None), "SHARD_GRAD_OP": (2, None), "NO_SHARD": (0, None),
                "HYBRID_SHARD": (3, True), "HYBRID_SHARD_ZERO2": (2, True), "2": (2, None)}
    for strategy, (stage, hybrid) in expected.items():
        text = ("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nfsdp_config:\n  fsdp_version: 1\n"
                f"  fsdp_sharding_strategy: {strategy}\n")
        job, _ = imported(write("acc.yaml", text))
        assert job["zero"]["stage"] == stage and job["zero"].get("hybrid") == hybrid, strategy


def test_accelerate_bad_input(write):
    result = run_cli("import", write("acc.yaml", "distributed_type: FSDP\nnum_machines: 3\nnum_processes: 16\n"))
    assert result.code == 2
    assert ":3: num_processes: 16 processes do not fill 3 machines evenly" in result.err
    result = run_cli("import", write("acc.yaml", "distributed_type: TPU_POD\nnum_processes: 8\n"))
    assert result.code == 2 and ":1: distributed_type: must be one of" in result.err
    # Sizes that do not multiply to num_processes: accelerate rejects them
    # (ParallelismConfig._validate_accelerator); dp_shard_size is never dropped for dp = 64 / tp.
    text = ("distributed_type: FSDP\nnum_machines: 8\nnum_processes: 64\nparallelism_config:\n"
            "  parallelism_config_dp_replicate_size: 1\n  parallelism_config_dp_shard_size: 2\n"
            "  parallelism_config_tp_size: 8\n")
    result = run_cli("import", write("acc.yaml", text), "--set", "model.preset=llama-2-70b")
    assert result.code == 2, result.err
    assert (":6: parallelism_config.parallelism_config_dp_shard_size: dp_replicate 1 * dp_shard 2 * tp 8 * cp 1 "
            "= 16 does not match num_processes (64)") in result.err


def test_json_key_lines():
    text = '{\n "a": 1,\n "b": {\n  "c": [ {"x": 1} ],\n  "d\\"e": 2\n },\n "f": "g:h"\n}'
    assert json_key_lines(text) == {"a": 2, "b": 3, "b.c": 4, 'b.d"e': 5, "f": 7}


@pytest.mark.parametrize("layers,stages,first,last", [(32, 4, 1, 1), (80, 8, 1, 1), (126, 16, 1, 1), (7, 3, 2, 0),
                                                     (61, 4, 0, 0)])
def test_stage_fqns_cover_every_layer_once(layers, stages, first, last):
    counts = torchtitan_split(stages, layers, first, last)
    parts = stage_fqns(counts)
    names = [n for part in parts for n in part if n.startswith("layers.")]
    assert names == [f"layers.{i}" for i in range(layers)]


def test_torchtitan_operator_policy_round_trips(write):
    # torchtitan's selective recomputation with selective_ac_option = "op" is its operator
    # policy (torchtitan/config/job_config.py, ActivationCheckpoint): shardplan's "op".
    job = write("op.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n[zero]\nstage = 3\n'
                           '[train]\nactivation_checkpointing = "op"\n')
    exported = run_cli("export", job, "--to", "torchtitan")
    assert exported.code == 0, exported.err
    assert 'mode = "selective"' in exported.out and 'selective_ac_option = "op"' in exported.out
    titan = write("titan.toml", exported.out)
    imported = run_cli("import", titan, "--set", "model.preset=llama-3-8b")
    assert imported.code == 0, imported.err
    assert 'activation_checkpointing = "op"' in imported.out
    korthikanti = run_cli("export", job, "--to", "torchtitan", "--set", "train.activation_checkpointing=selective")
    assert "written as its operator policy" in korthikanti.err
