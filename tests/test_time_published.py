"""The time model against published iteration times (tests/time_references.py names every
source): every row within 15%, the mean absolute error under 8%, and every comparison the
papers make between two plans on the same GPUs ordered the same way."""

from __future__ import annotations

import pytest
from time_references import (A100_80GB, BLOOM_SECONDS, JEAN_ZAY_A100, TORCHTITAN_FSDP_TOKENS_PER_GPU,
                             TORCHTITAN_H100, bloom_176b, korthikanti_table_5, narayanan_table_1,
                             narayanan_table_2, torchtitan_fsdp)

from shardplan.core.hardware import TimeConstants
from shardplan.core.step_time import step_time

ROW_TOLERANCE = 0.15  # every row
MEAN_TOLERANCE = 0.08  # mean absolute error over a table


def predicted(run) -> float:
    return step_time(run.inputs, A100_80GB, run.constants).step_seconds


def relative_errors(runs) -> dict[str, float]:
    return {run.name: predicted(run) / run.measured_seconds - 1 for run in runs}


@pytest.fixture(scope="module")
def table_1():
    return relative_errors(narayanan_table_1())


@pytest.fixture(scope="module")
def table_5():
    return relative_errors(korthikanti_table_5())


@pytest.mark.parametrize("name", [row[0] for row in __import__("time_references").NARAYANAN_TABLE_1])
def test_narayanan_table_1_row(table_1, name):
    # Narayanan et al. 2021, Table 1, row `name` (iteration seconds from its teraFLOP/s).
    assert abs(table_1[name]) <= ROW_TOLERANCE, f"{name}: {table_1[name]:+.1%}"


def test_narayanan_table_1_mean(table_1):
    assert len(table_1) == 10
    assert sum(map(abs, table_1.values())) / len(table_1) < MEAN_TOLERANCE


def test_korthikanti_table_5_rows(table_5):
    # Korthikanti et al. 2022, Table 5: all eight iteration times.
    assert len(table_5) == 8
    worst = max(table_5, key=lambda name: abs(table_5[name]))
    assert abs(table_5[worst]) <= ROW_TOLERANCE, f"{worst}: {table_5[worst]:+.1%}"
    assert sum(map(abs, table_5.values())) / len(table_5) < MEAN_TOLERANCE


def test_bloom_176b_iteration():
    # BLOOM-176B on Jean Zay (tests/time_references.py): 105 s per iteration at global batch
    # 2,048, held out of the fit (its constants come from the Selene tables above). DeepSpeed's
    # pipeline engine reduces the gradients after the last microbatch: no overlap.
    seconds = step_time(bloom_176b(), JEAN_ZAY_A100, TimeConstants(overlap_grad_reduce=False)).step_seconds
    assert abs(seconds / BLOOM_SECONDS - 1) <= ROW_TOLERANCE, f"{seconds / BLOOM_SECONDS - 1:+.1%}"


def test_selective_recomputation_with_sequence_parallel_is_faster():
    # Korthikanti et al. 2022, Table 5: sequence parallel + selective beats full recomputation
    # for every model (29-32% more throughput).
    runs = korthikanti_table_5()
    for full, selective in zip(runs[0::2], runs[1::2]):
        assert selective.measured_seconds < full.measured_seconds  # the paper's ordering
        assert predicted(selective) < predicted(full), full.name


def test_ptd_beats_zero3_on_the_same_gpus():
    # Narayanan et al. 2021, Table 2: on 384, 768 and 1,536 GPUs (175B) and 1,120 and 2,240
    # GPUs (530B), PTD-P runs more teraFLOP/s per GPU than ZeRO-3 (6% more at 384, 70% at
    # the doubled counts).
    runs = {run.name: run for run in narayanan_table_2()}
    pairs = [(f"{model} PTD-P {gpus} GPUs", f"{model} ZeRO-3 {gpus} GPUs")
             for model, gpus in (("175B", 384), ("175B", 768), ("175B", 1536), ("530B", 1120), ("530B", 2240))]
    for ptd, zero3 in pairs:
        # Same GPUs and the same global batch: the shorter iteration is the faster plan.
        assert runs[ptd].measured_seconds < runs[zero3].measured_seconds
        assert predicted(runs[ptd]) < predicted(runs[zero3]), ptd


def test_zero3_scaling_loss_is_predicted():
    # Narayanan et al. 2021, Table 2: ZeRO-3's teraFLOP/s per GPU fall as GPUs grow at a fixed
    # batch (175B: 144, 88, 44), because its parameter traffic does not shrink per GPU.
    runs = {run.name: run for run in narayanan_table_2()}
    seconds = [predicted(runs[f"175B ZeRO-3 {gpus} GPUs"]) * gpus for gpus in (384, 768, 1536)]
    assert seconds[0] < seconds[1] < seconds[2]  # GPU-seconds per iteration grow


def test_torchtitan_fsdp_scaling_from_one_node_to_sixteen():
    # torchtitan's Llama 3.1 8B benchmark, Tables 1 and 3 (tests/time_references.py): FSDP2 on
    # 128 GPUs keeps 97.3% of the tokens/s per GPU of 8 GPUs in one node. The GPU's peak is
    # unknown, so the ratio is the reference. Predicted: 0.827 (-15%; docs/time.md: FSDP2's
    # prefetching hides more of the inter-node traffic than the overlap fitted on DeepSpeed's
    # ZeRO-3 runs of 2021 says).
    tokens = {gpus: 2 * 8192 / step_time(torchtitan_fsdp(gpus), TORCHTITAN_H100).step_seconds
              for gpus in TORCHTITAN_FSDP_TOKENS_PER_GPU}
    measured = TORCHTITAN_FSDP_TOKENS_PER_GPU[128] / TORCHTITAN_FSDP_TOKENS_PER_GPU[8]
    assert tokens[128] < tokens[8]  # the published order: more GPUs, fewer tokens/s per GPU
    assert abs(tokens[128] / tokens[8] / measured - 1) <= ROW_TOLERANCE


# Narayanan et al. 2021, section 5.4 (Figures 13-15) on 64 A100s (8 DGX nodes), microbatch 1,
# Megatron-LM's "local" DDP, full recomputation, with the plans of NVIDIA/Megatron-LM
# examples/sc21/run_figure_13.sh, run_figure_14.sh and run_figure_15.sh. The figures' values
# are not given as numbers; the text states the orderings checked here.
def _section_5_4(shape, batch: int, tp: int, pp: int) -> float:
    """Predicted achieved teraFLOP/s per GPU (the paper's FLOPs count, section 5.1) of one
    plan of the 64 GPUs."""
    from time_references import _megatron, narayanan_flops

    dp = 64 // (tp * pp)
    inputs = _megatron(shape, dp, tp, pp, 1, batch // dp, 1).with_(gpus_per_node=8)
    seconds = step_time(inputs, A100_80GB, TimeConstants(overlap_grad_reduce=False)).step_seconds
    return narayanan_flops(batch, shape.num_layers, shape.hidden_size) / seconds / 64 / 1e12


@pytest.mark.parametrize("batch", [32, 128])
def test_tensor_parallel_across_the_node_then_pipeline(batch):
    """Figure 13, the 161B GPT (32 layers, hidden 20,480, 128 heads) at (t, p) = (2, 32) ...
    (32, 2): "we see peak performance when the tensor-parallel size is equal to the number of
    GPUs in a single node (8 with DGX A100 nodes)". The comparison the two misses of Table 1
    rest on (tests/test_plan.py): tensor parallel 8 against a deeper pipeline."""
    from time_references import gpt

    shape = gpt(20480, 128, 32)
    rated = {(t, 64 // t): _section_5_4(shape, batch, t, 64 // t) for t in (2, 4, 8, 16, 32)}
    assert max(rated, key=rated.get) == (8, 8), rated


def test_pipeline_and_tensor_parallel_cost_throughput_at_large_batches():
    """Figures 14 and 15, the 5.9B GPT (32 layers, hidden 3,840, 32 heads) at batch 512:
    throughput decreases as the pipeline-parallel size grows against data parallel (a larger
    bubble), and as the tensor-parallel size grows (collectives per microbatch, across nodes
    beyond 8, and smaller matrix multiplications)."""
    from time_references import gpt

    shape = gpt(3840, 32, 32)
    pipeline = [_section_5_4(shape, 512, 1, p) for p in (2, 4, 8, 16, 32)]
    tensor = [_section_5_4(shape, 512, t, 1) for t in (2, 4, 8, 16, 32)]
    assert pipeline == sorted(pipeline, reverse=True), pipeline
    assert tensor == sorted(tensor, reverse=True), tensor
