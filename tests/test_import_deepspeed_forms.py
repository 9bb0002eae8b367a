"""DeepSpeed configs in the forms users have them: the Hugging Face Trainer's templates with
"auto" values, and the deprecated offload booleans, read as DeepSpeed itself reads them."""

from __future__ import annotations

import json

import pytest

from conftest import DATA, run_cli

# The ZeRO-3 template of the Hugging Face Trainer's DeepSpeed integration (transformers docs,
# "DeepSpeed", ZeRO-3 example config): every size left "auto" for the Trainer to fill in.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hugging_face_trainer_auto_values_are_named_not_refused(write):
    path = write("ds_z3.json", json.dumps(HF_ZERO3, indent=2))
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--world", "8", "--json")
    assert result.code == 0, result.err
    notes = [line for line in result.err_lines if "'auto' is filled in by the Hugging Face Trainer" in line]
    keys = [line.split(": ")[2] for line in notes]  # import: FILE:LINE: KEY: message
    for key in ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold", "optimizer.params.lr", "train_batch_size"):
        assert keys.count(key) == 1, (key, keys)  # each named once
    job = result.json["job"]
    assert job["zero"]["stage"] == 3 and job["offload"]["params"] and job["offload"]["optimizer"]
    # sub_group_size 1e9, a float in JSON, is read as the integer DeepSpeed makes of it
    # (zero/config.py line 182: `sub_group_size: int`).
    assert job["zero"]["sub_group_size"] == 1_000_000_000
    assert job["train"]["precision"] == "fp32"
    assert any("planned as fp32" in line for line in result.err_lines)


@pytest.mark.parametrize("key, section, job_keys", [
    ("cpu_offload", "offload_optimizer", ("optimizer", "grads")),
    ("cpu_offload_param", "offload_param", ("params",)),
])
def test_deprecated_offload_booleans_read_as_deepspeed_reads_them(write, key, section, job_keys):
    """DeepSpeed maps `cpu_offload` to offload_optimizer and `cpu_offload_param` to
    offload_param with device "cpu" (deepspeed/runtime/zero/config.py, their new_param_fn):
    checked with DeepSpeed's own config class, and the import reads the same offload."""
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3, key: True}}
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    parsed = zero_config.DeepSpeedZeroConfig(**config["zero_optimization"])
    assert getattr(parsed, section).device == "cpu"
    result = run_cli("import", write("ds.json", json.dumps(config)), "--set", "model.preset=llama-3-8b", "--dp", "8",
                     "--json")
    assert result.code == 0, result.err
    assert all(result.json["job"]["offload"][k] is True for k in job_keys)
    exported = run_cli("export", "llama-3-8b-h100", "--zero", "3",
                       *[a for k in job_keys for a in ("--set", f"offload.{k}=true")], "--to", "deepspeed", "--json")
    assert exported.json["config"]["zero_optimization"][section]["device"] == "cpu"


# -- published configs (copied verbatim into tests/data/interop/) ------------------------------
# axolotl-ai-cloud/axolotl deepspeed_configs/zero3_bf16.json (067b021c8): ZeRO-3, bf16, no offload,
# bucket sizes and batch "auto".
AXOLOTL_ZERO3 = DATA / "interop" / "axolotl_zero3_bf16.json"
# huggingface/transformers docs/source/en/trainer.md, "DeepSpeed with Accelerate plugin": ZeRO-2
# with offload_optimizer_device cpu and offload_param_device cpu, 4 processes on 1 machine.
HF_DOCS_PLUGIN = DATA / "interop" / "hf_trainer_docs_accelerate_deepspeed_plugin.yaml"


def test_imported_config_offloads_only_what_it_asks_for(tmp_path):
    """AXOLOTL_ZERO3 has no offload_* (DeepSpeed 0.19.8 zero/offload_config.py: device defaults to
    "none"): Llama-3 70B over 16 H100s does not fit as DeepSpeed runs it, so `estimate` says so
    (exit 1) instead of letting the default "balanced" strategy offload the optimizer states and
    answer "fits"; and the export adds no offload_optimizer the source did not have."""
    job = str(tmp_path / "job.toml")
    result = run_cli("import", str(AXOLOTL_ZERO3), "--world", "16", "--set", "model.preset=llama-3-70b",
                     "--set", "cluster.preset=h100-80gb", "-o", job)
    assert result.code == 0, result.err
    assert 'strategy = "conservative"' in open(job).read()
    estimate = run_cli("estimate", job, "--json")
    assert estimate.code == 1 and estimate.json["fits"] is False and not estimate.json["decisions"]
    exported = run_cli("export", job, "--to", "deepspeed", "--json")
    assert exported.code == 0
    zero = exported.json["config"]["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert not [n for n in exported.json["notes"] if n["path"].startswith("offload")]


def test_torchtitan_and_accelerate_imports_offload_only_what_they_ask_for(write):
    """torchtitan 0.2.2 job_config.py `enable_cpu_offload: bool = False` and accelerate 1.15
    `fsdp_offload_params` (default false): the imported jobs ask for no offload of their own."""
    titan = write("tt.toml", "[model]\nname = \"llama3\"\nflavor = \"8B\"\n[parallelism]\n"
                             "data_parallel_shard_degree = 8\n")
    acc = write("acc.yaml", "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n")
    for path in (titan, acc):
        result = run_cli("import", path, "--json")
        assert result.code == 0, result.err
        assert result.json["job"]["offload"] == {"strategy": "conservative"}, path


def test_zero2_parameter_offload_is_read_as_deepspeed_ignores_it(write):
    """ZeRO-2 with offload_param: DeepSpeed 0.19.8 parses it (zero/config.py accepts
    offload_param at any stage) and builds the stage 1-2 optimizer with offload_optimizer only
    (deepspeed/runtime/engine.py:2655-2688; offload_param is read on the stage-3 path, :2731,
    :2773). It was refused (offload.params needs stage 3); it is ZeRO-2 + ZeRO-Offload."""
    config = {"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}}
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    assert zero_config.DeepSpeedZeroConfig(**config["zero_optimization"]).offload_param.device == "cpu"
    path = write("ds.json", json.dumps(config, indent=2))
    result = run_cli("import", path, "--dp", "8", "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["offload"] == {"optimizer": True, "grads": True, "strategy": "conservative"}
    notes = {(n["line"], n["path"]): n["message"] for n in result.json["notes"]}
    assert notes[(9, "zero_optimization.offload_param.device")].startswith(
        "not read: DeepSpeed ignores parameter offload below ZeRO stage 3 (deepspeed/runtime/engine.py:2655-2688")
    assert notes[(10, "zero_optimization.offload_param.pin_memory")].startswith("not read: DeepSpeed ignores")


def test_accelerate_plugin_with_parameter_offload_at_zero2(tmp_path):
    """HF_DOCS_PLUGIN: accelerate's DeepSpeedPlugin writes zero_optimization.offload_param next to
    stage 2 (accelerate 1.15.0 utils/dataclasses.py:1306-1317); it is read as ZeRO-2 with the
    optimizer offloaded, exit 0 (was: refused, exit 2), and the export writes no offload_param."""
    job = str(tmp_path / "job.toml")
    result = run_cli("import", str(HF_DOCS_PLUGIN), "--set", "model.preset=llama-3-8b", "-o", job)
    assert result.code == 0, result.err
    assert f"import: {HF_DOCS_PLUGIN}:6: deepspeed_config.offload_param_device: not read: DeepSpeed ignores " \
           "parameter offload below ZeRO stage 3" in result.err
    exported = run_cli("export", job, "--to", "deepspeed", "--json")
    zero = exported.json["config"]["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero


def test_parameter_offload_at_stage_3_set_to_2_is_refused_at_the_source_key(write):
    """The rule itself stands: a job that offloads parameters below stage 3 is bad input, named
    by the source's key first (the import read offload_param at stage 3; --set makes it 2)."""
    path = write("ds.json", '{\n  "zero_optimization": {\n    "stage": 3,\n    "offload_param": {"device": "cpu"}\n'
                            '  }\n}')
    result = run_cli("import", path, "--set", "zero.stage=2")
    assert result.code == 2 and result.err_lines == [
        f"{path}:4: zero_optimization.offload_param.device: offload.params: offloading parameters requires "
        "zero.stage = 3 (got 2)"]


def test_auto_bucket_sizes_are_the_trainers_for_a_known_hidden_size():
    """AXOLOTL_ZERO3 leaves three bucket keys "auto": transformers 5.23.0
    integrations/deepspeed.py:232-242 (`trainer_config_finalize`) and accelerate 1.15.0
    accelerator.py:2323-2325 fill reduce_bucket_size = h * h, stage3_prefetch_bucket_size =
    int(0.9 * h * h), stage3_param_persistence_threshold = 10 * h. Llama-3 8B: h = 4096
    (meta-llama/Meta-Llama-3-8B config.json hidden_size)."""
    from shardplan.io.interop.deepspeed import from_deepspeed

    hidden = 4096
    out = from_deepspeed(json.loads(AXOLOTL_ZERO3.read_text()), 8, hidden_size=hidden)
    zero = out.tables["zero"]
    assert (zero["reduce_bucket_size"], zero["prefetch_bucket_size"], zero["param_persistence_threshold"]) == (
        16_777_216, 15_099_494, 40_960)
    notes = {n.path: n.message for n in out.notes}
    assert notes["zero_optimization.reduce_bucket_size"] == (
        "'auto' is filled in by the Hugging Face Trainer and accelerate: read as hidden_size * hidden_size = "
        "16,777,216 (hidden size 4,096)")
    # Below stage 3 the Trainer fills reduce_bucket_size only; the stage-3 keys are unused there.
    stage2 = from_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                   "stage3_prefetch_bucket_size": "auto"}}, 8, hidden_size=hidden)
    assert stage2.tables["zero"] == {"framework": "deepspeed", "stage": 2, "reduce_bucket_size": 16_777_216}


@pytest.mark.parametrize("written, field", [("stage3_max_live_parameters", "max_live_parameters"),
                                            ("sub_group_size", "sub_group_size")])
def test_auto_the_trainer_does_not_fill_is_deepspeeds_default(written, field):
    """DeepSpeedExamples inference/sglang/ds_offload_nvme_aio.json (45b4b715) has
    stage3_max_live_parameters "auto", which neither the Trainer nor accelerate fills in (the
    note said the Trainer did); nor do they fill sub_group_size (transformers 5.23.0
    integrations/deepspeed.py and accelerate 1.15.0 accelerator.py never name it). DeepSpeed's
    config model drops an "auto" value, leaving its default, 1e9 for both (zero/config.py lines
    182 and 245; deepspeed/runtime/config_utils.py:55-56): checked with DeepSpeed's own class."""
    from shardplan.io.interop.deepspeed import from_deepspeed

    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    parsed = zero_config.DeepSpeedZeroConfig(stage=3, **{written: "auto"})
    out = from_deepspeed({"zero_optimization": {"stage": 3, written: "auto"}}, 8)
    assert field not in out.tables["zero"]  # the job keeps the default, DeepSpeed's
    assert getattr(parsed, field) == 1_000_000_000
    message = {n.path: n.message for n in out.notes}[f"zero_optimization.{written}"]
    assert message.startswith("'auto' is filled in by neither the Hugging Face Trainer nor accelerate") \
        and "planned at DeepSpeed's default 1,000,000,000" in message


def test_sub_group_size_is_read_as_deepspeed_reads_it():
    """sub_group_size (zero/config.py line 182, `Field(pp_int(1e9), ge=0)`): AXOLOTL_ZERO3 writes
    0, which DeepSpeed accepts and which then gives every tensor a sub-group of its own
    (stage3.py line 1226); a negative one DeepSpeed refuses, and so does the import (exit 2).
    Below stage 3 DeepSpeed does not read it (engine.py line 2775 hands it to the stage 3
    optimizer alone): a note, and the job keeps the default."""
    from shardplan.io.interop.deepspeed import from_deepspeed

    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    assert zero_config.DeepSpeedZeroConfig(stage=3, sub_group_size=0).sub_group_size == 0
    with pytest.raises(ValueError):  # pydantic's ValidationError
        zero_config.DeepSpeedZeroConfig(stage=3, sub_group_size=-1)
    assert from_deepspeed(json.loads(AXOLOTL_ZERO3.read_text()), 8).tables["zero"]["sub_group_size"] == 0
    assert from_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": 1e8}}, 8).tables["zero"][
        "sub_group_size"] == 100_000_000
    refused = from_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": -1}}, 8)
    assert [(p.path, p.message) for p in refused.problems] == [("zero_optimization.sub_group_size",
                                                                "must be >= 0 (got -1)")]
    stage2 = from_deepspeed({"zero_optimization": {"stage": 2, "sub_group_size": 1e8}}, 8)
    assert "sub_group_size" not in stage2.tables["zero"]
    assert {n.path: n.message for n in stage2.notes}["zero_optimization.sub_group_size"] == (
        "not read: DeepSpeed does not use it at stage 2")


def test_precision_advice_is_not_given_when_the_command_line_sets_it():
    """m1: with bf16/fp16 "auto", the note asked for --set train.precision=bf16-mixed even when
    the command line gave it; the importer is told which job keys the command line sets."""
    from shardplan.io.interop.deepspeed import from_deepspeed

    config = {"train_batch_size": 8, "bf16": {"enabled": "auto"}}
    asked = {n.path: n.message for n in from_deepspeed(config, 8).notes}["bf16.enabled"]
    assert "give --set train.precision=bf16-mixed" in asked
    given = from_deepspeed(config, 8, given={"train.precision"})
    assert "precision" not in given.tables.get("train", {})
    assert {n.path: n.message for n in given.notes}["bf16.enabled"] == (
        "the Trainer's --bf16 decides the precision: train.precision is the command line's")


def test_auto_bf16_beside_disabled_fp16_is_said(write):
    """The Trainer's own template writes `"bf16": {"enabled": "auto"}` beside
    `"fp16": {"enabled": false}`: the Trainer fills bf16.enabled from its --bf16 flag
    (transformers/integrations/deepspeed.py `trainer_config_process`: fill_match("bf16.enabled",
    args.bf16 or args.bf16_full_eval)), so the import plans DeepSpeed's fp32 default and says
    which flag decides, as when both are "auto" (it planned fp32 without a word)."""
    from shardplan.io.interop.deepspeed import from_deepspeed

    config = {"train_batch_size": 8, "bf16": {"enabled": "auto"}, "fp16": {"enabled": False, "loss_scale": 0}}
    imported = from_deepspeed(config, 8)
    assert imported.tables["train"]["precision"] == "fp32"
    notes = [n.message for n in imported.notes if n.path == "bf16.enabled"]
    assert "the Trainer's --bf16 decides the precision: planned as fp32 (DeepSpeed's default); give --set " \
           "train.precision=bf16-mixed for a bf16 run" in notes
    fp16 = from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": False}, "fp16": {"enabled": "auto"}}, 8)
    assert "the Trainer's --fp16 decides the precision: planned as fp32 (DeepSpeed's default); give --set " \
           "train.precision=fp16-mixed for an fp16 run" in [n.message for n in fp16.notes]
    both = from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, 8)
    assert "the Trainer's --bf16 / --fp16 decide the precision: planned as fp32 (DeepSpeed's default); give " \
           "--set train.precision=bf16-mixed for a bf16 run" in [n.message for n in both.notes]
    # Explicitly enabled still wins over the other's "auto".
    on = from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}, 8)
    assert on.tables["train"]["precision"] == "bf16-mixed"


# huggingface/accelerate examples/deepspeed_config_templates/zero_stage3_offload_config.json
# (16cb6eb80d): ZeRO-3 with both offloads, gradient_accumulation_steps 1 and the micro batch
# "auto" (the Trainer fills it from per_device_train_batch_size).
ACCELERATE_ZERO3_OFFLOAD = DATA / "interop" / "accelerate_zero_stage3_offload_config.json"


def test_a_micro_batch_left_to_the_launcher_is_not_written(tmp_path):
    """The template gives the accumulation alone: the import writes `num_microbatches = 1` and
    no micro batch, so `plan` chooses it (a micro batch written would be a key the job fixes);
    the dp note names the key that was read, not the "auto" one."""
    result = run_cli("import", str(ACCELERATE_ZERO3_OFFLOAD), "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    parallel = result.json["job"]["parallel"]
    assert parallel == {"num_microbatches": 1}
    (dp_note,) = [n for n in result.json["notes"] if "data-parallel degree is not in the config" in n["message"]]
    assert dp_note["path"] == "gradient_accumulation_steps"
    written = tmp_path / "job.toml"
    assert run_cli("import", str(ACCELERATE_ZERO3_OFFLOAD), "--set", "model.preset=llama-3-8b", "-o",
                   str(written)).code == 0
    # 64 sequences on 8 data-parallel GPUs in one microbatch: the micro batch is 8, found by the
    # search (a written micro batch 1 would fix the batch at 8).
    planned = run_cli("plan", str(written), "--gpus", "8", "--global-batch", "64", "--pp", "1", "--tp", "1",
                      "--set", "cluster.preset=a100-80gb", "--json")
    assert planned.code == 0, planned.err
    assert {p["job"]["parallel"]["micro_batch_size"] for p in planned.json["plans"]} == {8}
    # A micro batch alone is DeepSpeed's accumulation 1 (config.py, `_set_batch_related_parameters`).
    config = json.loads(ACCELERATE_ZERO3_OFFLOAD.read_text())
    config.update(train_micro_batch_size_per_gpu=4)
    del config["gradient_accumulation_steps"]
    alone = tmp_path / "micro.json"
    alone.write_text(json.dumps(config))
    job = run_cli("import", str(alone), "--set", "model.preset=llama-3-8b", "--json").json["job"]
    assert job["parallel"] == {"micro_batch_size": 4, "num_microbatches": 1}
