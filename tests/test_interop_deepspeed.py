"""Exported DeepSpeed configs read by DeepSpeed's own config class (the `interop` extra).

`deepspeed.runtime.config.DeepSpeedConfig` parses a config without a GPU; it asks
`deepspeed.comm` for the rank and takes the data-parallel size from the model-parallel unit
(`mpu.get_data_parallel_world_size()`, the interface Megatron-style codes hand to
`deepspeed.initialize`). The process group is stood in for (rank 0), nothing else.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from interop_plans import PLANS
from shardplan.io.job import load_job

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is in the `interop` extra")
ds_config = pytest.importorskip("deepspeed.runtime.config")

pytestmark = pytest.mark.interop


@pytest.fixture
def ds(deepspeed_parse):
    return deepspeed_parse


def exported(write, plan: str):
    """(DeepSpeed config, the validated job) of one of the shared plans."""
    path = write("job.toml", PLANS[plan])
    result = run_cli("export", path, "--to", "deepspeed", "--json")
    assert result.code == 0, result.err
    return result.json["config"], load_job(path).job


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deepspeed_reads_the_exported_config(write, ds, plan):
    config, job = exported(write, plan)
    par, zero, offload = job.parallel, job.zero, job.offload
    parsed = ds(config, par.dp)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (par.dp * par.micro_batch_size * par.num_microbatches, par.micro_batch_size, par.num_microbatches)
    assert parsed.zero_optimization_stage == zero.stage
    param, optimizer = parsed.zero_config.offload_param, parsed.zero_config.offload_optimizer
    assert (param is not None and param.device == "cpu") == offload.params
    assert (optimizer is not None and optimizer.device == "cpu") == (offload.optimizer or offload.grads)
    for state in (param, optimizer):
        if state is not None:
            assert state.pin_memory == offload.pin_memory
    assert parsed.zero_config.reduce_bucket_size == zero.reduce_bucket_size
    if zero.stage == 3:
        assert parsed.zero_config.prefetch_bucket_size == zero.prefetch_bucket_size
        assert parsed.zero_config.max_live_parameters == zero.max_live_parameters
        assert parsed.zero_config.param_persistence_threshold == zero.param_persistence_threshold
        assert parsed.zero_config.sub_group_size == zero.sub_group_size
    else:
        assert parsed.zero_config.allgather_bucket_size == zero.allgather_bucket_size
    precision = job.train.precision
    assert parsed.bfloat16_config.enabled == (precision in ("bf16-mixed", "bf16"))
    assert parsed.float16_config.enabled == (precision == "fp16-mixed")
    assert parsed.tensor_parallel_config.autotp_size == (par.tp if par.tp > 1 else 0)
    assert parsed.optimizer_name.lower() == ("sgd" if job.train.optimizer == "sgd" else "adamw")
    assert parsed.optimizer_params["lr"] == job.train.lr
    assert parsed.grad_accum_dtype == zero.grad_accum_dtype  # None: DeepSpeed's default, the model's dtype
    if zero.overlap_comm is not None:
        assert parsed.zero_config.overlap_comm == zero.overlap_comm


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deepspeed_infers_the_same_accumulation(write, ds, plan):
    """Given train_batch_size and the micro batch only, DeepSpeed derives the accumulation
    steps itself (config.py, `_set_batch_related_parameters`): the exported three agree."""
    config, job = exported(write, plan)
    two = {k: v for k, v in config.items() if k != "gradient_accumulation_steps"}
    assert ds(two, job.parallel.dp).gradient_accumulation_steps == config["gradient_accumulation_steps"]


def test_deepspeed_rejects_a_wrong_world(write, ds):
    """The check is live: the same config with another data-parallel size fails DeepSpeed's
    batch assertion."""
    config, _ = exported(write, "zero2_offload_fp16")
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        ds(config, 3)


def test_deepspeed_tutorial_config_round_trips(write, ds):
    """DeepSpeed's ZeRO-Infinity tutorial config, imported and exported again, reads in
    DeepSpeed as the original does (https://www.deepspeed.ai/tutorials/zero/)."""
    from test_interop import DEEPSPEED_TUTORIAL_ZERO_INFINITY

    original = json.loads(DEEPSPEED_TUTORIAL_ZERO_INFINITY)
    path = write("ds.json", DEEPSPEED_TUTORIAL_ZERO_INFINITY)
    job = write("job.toml", run_cli("import", path, "--dp", "8", "--set", "model.preset=gpt2-xl").out)
    again = run_cli("export", job, "--to", "deepspeed", "--json").json["config"]
    mine = ds(again, 8).zero_config
    theirs = ds({**original, "train_micro_batch_size_per_gpu": 1}, 8).zero_config
    for key in ("stage", "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold",
                "reduce_bucket_size", "sub_group_size"):
        assert getattr(mine, key) == getattr(theirs, key), key
    assert mine.offload_param.device == theirs.offload_param.device == "cpu"
    assert mine.offload_optimizer.device == theirs.offload_optimizer.device == "cpu"


# `shardplan plan q1.toml --gpus 8` for Llama-3 8B on H100s at seq 8192, global batch 512 (the
# search's best plan under fsdp2): dp 4 x pp 2 with ZeRO-3.
PIPELINE_ZERO3 = """
[model]
preset = "llama-3-8b"
[train]
seq_len = 8192
activation_checkpointing = "none"
global_batch_size = 512
[cluster]
preset = "h100-80gb"
[parallel]
dp = 4
pp = 2
micro_batch_size = 1
num_microbatches = 128
[zero]
stage = 3
"""
# Each DeepSpeed source line a note cites, and what that line of the installed DeepSpeed says.
CITED = {
    "deepspeed/runtime/pipe/engine.py:77": '"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"',
    "deepspeed/__init__.py:583": "mpu = model.mpu()",
    "deepspeed/runtime/config.py:471": "self.world_size = dist.get_world_size()",
    "deepspeed/runtime/config.py:602": "assert train_batch == micro_batch * grad_acc * self.world_size",
    "deepspeed/runtime/pipe/module.py:133": "partition_method='parameters'",
}
OVERLAP_LINE = ("deepspeed/runtime/engine.py:2665",
                "Pipeline parallelism does not support overlapped communication, will be disabled")


def export_notes(write, job: str, *flags: str) -> tuple[dict, dict[str, str]]:
    """(config, {job key: note}) of an export, its stderr lines checked to be the JSON's notes."""
    result = run_cli("export", write("job.toml", job), "--to", "deepspeed", "--json", *flags)
    assert result.code == 0, result.err
    notes = result.json["notes"]
    assert [f"export: {n['path']}: {n['message']}" for n in notes] == \
        [line for line in result.err_lines if line.startswith("export: ")]
    return result.json["config"], {n["path"]: n["message"] for n in notes}


def test_the_cited_deepspeed_lines_say_what_the_notes_quote(write):
    """Every `deepspeed/...:line` a pipeline note names is that line of the installed DeepSpeed."""
    from pathlib import Path

    _, notes = export_notes(write, PIPELINE_ZERO3)
    said = " ".join(notes.values())
    root = Path(deepspeed.__file__).parent.parent
    for where, text in CITED.items():
        assert where in said, where
        path, line = where.rsplit(":", 1)
        assert text in (root / path).read_text().splitlines()[int(line) - 1], where
    assert CITED["deepspeed/runtime/pipe/engine.py:77"] in notes["zero.stage"]


def test_a_pipeline_plan_with_zero3_says_deepspeed_refuses_it(write, monkeypatch):
    """The review's plan: DeepSpeed's pipeline engine takes ZeRO stages below
    `ZeroStageEnum.gradients` (2) only (pipe/engine.py:76-77), and without a pipeline its config
    takes dp = the world, 8, and fails the batch assertion (config.py:602) with the figures the
    note gives; with the pipeline's data-parallel size, 4, the batch keys are DeepSpeed's."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    config, notes = export_notes(write, PIPELINE_ZERO3)
    assert config["zero_optimization"]["stage"] == 3 >= ZeroStageEnum.gradients
    assert notes["zero.stage"].startswith("DeepSpeed refuses this config: with pp 2 it needs DeepSpeed's pipeline "
                                          "engine, which runs ZeRO stages 0 and 1 only")
    assert notes["zero.stage"].endswith("`shardplan plan --framework deepspeed` searches only the plans DeepSpeed runs")
    pp = notes["parallel.pp"]
    assert "PipelineModule(num_stages=2)" in pp and "the batch keys are written for dp = world 8 / (pp 2) = 4" in pp
    assert "cannot express" not in pp
    assert ("DeepSpeed refuses this config without a PipelineModule: the 2 stages' ranks then join data "
            "parallel, dp = world 8 (deepspeed/runtime/config.py:471), and train_batch_size == "
            "train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp "
            "(deepspeed/runtime/config.py:602) fails: 512 != 1 * 128 * 8. The plan puts") in pp
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda group=None: 8)
    with pytest.raises(AssertionError, match=r"512 != 1 \* 128 \* 8"):
        ds_config.DeepSpeedConfig(json.loads(json.dumps(config)))  # no mpu: dp is the world
    from conftest import DataParallelUnit

    parsed = ds_config.DeepSpeedConfig(json.loads(json.dumps(config)), mpu=DataParallelUnit(4))
    assert parsed.train_batch_size == 512


def test_the_deepspeed_plan_of_the_same_job_is_not_refused(write, ds):
    """`plan --framework deepspeed` picks ZeRO-1 for the pipeline: below ZeroStageEnum.gradients,
    so no refusal; the pipeline note still says the PipelineModule sets the data-parallel size."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    config, notes = export_notes(write, PIPELINE_ZERO3, "--zero", "1")
    assert config["zero_optimization"]["stage"] == 1 < ZeroStageEnum.gradients
    assert "zero.stage" not in notes
    assert notes["parallel.pp"].startswith("deepspeed's config has no pipeline degree")
    assert ds(config, 4).gradient_accumulation_steps == 128


def test_a_model_parallel_pipeline_names_the_rule_without_figures(write):
    """With tp > 1 the data-parallel size DeepSpeed would take without a pipeline depends on the
    script's groups: the note names the rule, not figures it cannot know."""
    from interop_plans import PLANS as plans

    _, notes = export_notes(write, plans["pp4_interleaved"])
    pp = notes["parallel.pp"]
    assert "dp = world 64 / (tp 8 * pp 4) = 2" in pp
    assert ("the 4 stages' ranks then join data parallel, and train_batch_size == "
            "train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp "
            "(deepspeed/runtime/config.py:602) fails. The plan puts") in pp
    assert "zero.stage" not in notes  # ZeRO-0


@pytest.mark.parametrize("plan", sorted(p for p in PLANS if "pp = " not in PLANS[p]))
def test_no_pipeline_no_pipeline_note(write, plan):
    _, notes = export_notes(write, PLANS[plan])
    assert "parallel.pp" not in notes and not any("refuses" in n for n in notes.values())


def test_zero2_in_a_pipeline_is_refused_too(write):
    """ZeroStageEnum.gradients is stage 2 itself: the pipeline engine refuses ZeRO-2 as well."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    config, notes = export_notes(write, PIPELINE_ZERO3, "--zero", "2")
    assert config["zero_optimization"]["stage"] == 2 == ZeroStageEnum.gradients
    assert notes["zero.stage"].startswith("DeepSpeed refuses this config: with pp 2")
    assert "the config writes stage 2;" in notes["zero.stage"]


def test_overlap_comm_in_a_pipeline_is_said_to_be_turned_off(write):
    """DeepSpeed's engine turns overlap_comm off under a PipelineModule at stages 0-2 (the line
    the note cites, read from the installed DeepSpeed): the export writes it as given and says
    so, and the estimate plans the reduction after the backward, as DeepSpeed runs it."""
    from pathlib import Path

    job = PIPELINE_ZERO3.replace("stage = 3", "stage = 1").replace("[zero]\n", "[zero]\noverlap_comm = true\n")
    assert "overlap_comm = true" in job
    config, notes = export_notes(write, job)
    assert config["zero_optimization"]["overlap_comm"] is True
    where, text = OVERLAP_LINE
    assert where in notes["zero.overlap_comm"] and text in notes["zero.overlap_comm"]
    path, line = where.rsplit(":", 1)
    assert text in (Path(deepspeed.__file__).parent.parent / path).read_text().splitlines()[int(line) - 1]


class _Engine:
    """What DeepSpeedEngine._do_optimizer_sanity_check reads of its engine, stood in for."""

    global_rank = 0

    def __init__(self, ds_config, stage: int, offload: bool, pipeline: bool):
        self._config, self.stage, self.offload, self.pipeline_parallelism = ds_config, stage, offload, pipeline

    def get_data_types(self):
        from deepspeed.runtime.engine import DeepSpeedEngine

        return DeepSpeedEngine.get_data_types(self)

    def fp16_enabled(self):
        return self._config.float16_config.enabled

    def bfloat16_enabled(self):
        return self._config.bfloat16_config.enabled

    def zero_optimization(self):
        return self.stage > 0

    def zero_optimization_stage(self):
        return self.stage

    def zero_cpu_offload(self):
        return self.offload

    def zero_compute_grad_norm(self):
        return True

    def zero_allow_untested_optimizer(self):
        return True


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "fp32"])
@pytest.mark.parametrize("grad_accum", [None, "fp32", "bf16", "fp16"])
def test_the_optimizer_deepspeed_picks_is_the_one_planned(ds, precision, grad_accum):
    """DeepSpeed's own choice (`DeepSpeedEngine._do_optimizer_sanity_check` on the config the
    export writes, run on a stand-in engine) against core/deepspeed.py: BF16_Optimizer exactly
    where `uses_bf16_optimizer` says, and NotImplementedError exactly where
    `grad_accum_refused` says, over every stage, offload and pipeline."""
    import torch
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.engine import DeepSpeedEngine

    from shardplan.core.deepspeed import grad_accum_refused, uses_bf16_optimizer

    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1}
    config.update({"bf16-mixed": {"bf16": {"enabled": True}}, "fp16-mixed": {"fp16": {"enabled": True}}}.get(precision, {}))
    if grad_accum:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    parsed = ds(config, 2)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    for stage in range(4):
        for offload in (False, True):
            for pipeline in (False, True):
                engine = _Engine(parsed, stage, offload and stage > 0, pipeline)
                case = (stage, offload, pipeline)
                if grad_accum_refused(stage, precision, grad_accum):
                    with pytest.raises(NotImplementedError, match="unsupported mix"):
                        DeepSpeedEngine._do_optimizer_sanity_check(engine, optimizer)
                    continue
                chosen = DeepSpeedEngine._do_optimizer_sanity_check(engine, optimizer)
                planned = uses_bf16_optimizer(stage, precision, pipeline, grad_accum, offload and stage > 0)
                assert (chosen == BFLOAT16) == planned, case


def test_a_pipeline_export_says_how_to_cut_the_stages(write):
    """PipelineModule's default partition_method, 'parameters' (pipe/module.py:133, balanced by
    parameter counts at lines 409-411), is not the plan's split of blocks: the note gives the
    split and the partition method that keeps an even one, and says an uneven one is cut in code."""
    _, notes = export_notes(write, PIPELINE_ZERO3.replace("stage = 3", "stage = 1"))
    assert ("The plan puts 16 blocks on each of its 2 stages: partition_method='type:<the block class>'"
            in notes["parallel.pp"])
    _, notes = export_notes(write, PIPELINE_ZERO3.replace("stage = 3", "stage = 1").replace(
        "pp = 2\n", "pp = 2\nfirst_stage_layers = 15\n"))
    assert "The plan puts blocks 15/17 on its 2 stages" in notes["parallel.pp"]
    assert "build the stages' layer lists in code" in notes["parallel.pp"]
