"""DeepSpeed configs in the forms users have them: the Hugging Face Trainer's templates with
"auto" values, and the deprecated offload booleans, read as DeepSpeed itself reads them."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

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
