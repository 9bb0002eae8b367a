"""shardplan's `deepspeed` accounting against what real DeepSpeed allocates.

One torchrun launch (2 CPU ranks, gloo, DeepSpeed's CPU accelerator) runs
tests/dist/deepspeed_zero.py on eight small jobs: it builds each job's model as `shardplan run`
does, initialises DeepSpeed with the config `shardplan export --to deepspeed` writes, trains,
and reports per rank what DeepSpeed holds. Every expected number below is that report's, or
the cited line of DeepSpeed 0.19.8 (deepspeed/runtime/zero/...); shardplan's side is `shards
--json`, `estimate --json --explain` and, for terms of a moment other than the peak,
core/deepspeed.py `deepspeed_memory`.

The jobs:
- LLAMA: tiny-llama, ZeRO-3, stage3_param_persistence_threshold 8192, exactly the size of the
  k/v projections (DeepSpeed persists `ds_numel <= threshold`, partition_parameters.py 1292,
  parameter_offload.py 326);
- ODD: a GPT-2-style model with odd sizes (h 99, 3 heads, vocab 101, 33 positions, tied
  head), so most ZeRO-3 partitions are padded (ceil(numel/dp), partition_parameters.py
  1690-1696) and, at ZeRO-1/2, both optimizer groups (matrices 483,714 and vectors 5,346
  elements, each 2 mod 4) are padded to 2*dp (stage_1_and_2.py 441-446); ZeRO-3, 2 and 1;
- ODDOFF: ODD at ZeRO-2 and 1 with offload_optimizer (ZeRO-Offload) to the CPU;
- LLAMAOFF: LLAMA with offload_optimizer and offload_param to the CPU (ZeRO-Infinity);
- ODDACC and ODDOFFACC: ODD and ODDOFF at ZeRO-2 and 1 accumulating two microbatches,
  ODDACCOV: ODDACC at ZeRO-1 with overlap_comm, and ODDBF16: ODDACC at ZeRO-1 accumulating in
  fp32 (data_types.grad_accum_dtype), which DeepSpeed steps with BF16_Optimizer;
- LIVE: LLAMA with stage3_prefetch_bucket_size 10,000 and stage3_max_live_parameters 100,000,
  run with stage3_max_reuse_distance 0 (a key shardplan has no setting for), so the coordinator
  releases what it can: what stays gathered is then bounded by the prefetch, not by reuse;
- SUB: LLAMA with sub_group_size 100,000, which cuts its matrices (434,176 elements a rank)
  into four sub-groups; SUBOFF: LLAMAOFF with sub_group_size 0, one sub-group per tensor
  (both values through the config `export` writes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the `interop` extra)")

pytestmark = [pytest.mark.slow, pytest.mark.interop]

NPROC = 2
HELPER = ROOT / "tests" / "dist" / "deepspeed_zero.py"
BF16 = 2

LLAMA = """
[model]
preset = "tiny-llama"
[parallel]
dp = 2
[zero]
stage = 3
framework = "deepspeed"
param_persistence_threshold = 8192
reduce_bucket_size = 65536
[train]
seq_len = 16
precision = "bf16-mixed"
"""

ODD = """
[model]
name = "odd-gpt2"
family = "gpt2"
num_layers = 4
hidden_size = 99
num_heads = 3
vocab_size = 101
max_seq_len = 33
[parallel]
dp = 2
[zero]
stage = 3
framework = "deepspeed"
param_persistence_threshold = 9801
reduce_bucket_size = 65536
[train]
seq_len = 16
precision = "bf16-mixed"
"""

# ODD's parameters in the two weight-decay groups DeepSpeed flattens (transformers' GPT-2: c_attn
# h x 3h, attention c_proj h x h, c_fc h x 4h, mlp c_proj 4h x h; tied wte 101 x h, wpe 33 x h):
# the matrices, and the vectors (two LayerNorms' weight and bias, the four linears' biases, ln_f).
ODD_MATRICES = 4 * (99 * 297 + 99 * 99 + 2 * 99 * 396) + 101 * 99 + 33 * 99  # 483,714
ODD_VECTORS = 4 * (4 * 99 + 297 + 99 + 396 + 99) + 2 * 99  # 5,346

# ODD and ODDOFF at ZeRO-2 (and 1) accumulating two microbatches.
ODDACC = ODD.replace("stage = 3", "stage = 2").replace("dp = 2\n", "dp = 2\nnum_microbatches = 2\n")
ODDOFFACC = ODDACC + "[offload]\noptimizer = true\n"
ODDACCOV = ODDACC.replace('framework = "deepspeed"\n', 'framework = "deepspeed"\noverlap_comm = true\n')
# ODDACC at ZeRO-1 accumulating in fp32 (data_types.grad_accum_dtype): BF16_Optimizer.
ODDBF16 = ODDACC.replace("stage = 2", "stage = 1").replace('framework = "deepspeed"\n',
                                                             'framework = "deepspeed"\ngrad_accum_dtype = "fp32"\n')
# LLAMA with ZeRO-Infinity's CPU offload of the optimizer and the parameters.
LLAMAOFF = LLAMA + "[offload]\noptimizer = true\nparams = true\n"
# ODD at ZeRO-2 with ZeRO-Offload (offload_optimizer to the CPU; also run at ZeRO-1).
ODDOFF = ODD.replace("stage = 3", "stage = 2") + "[offload]\noptimizer = true\n"

# LLAMA cut into sub-groups of about 100,000 elements; LLAMAOFF with every tensor its own (0).
SUB = LLAMA.replace('framework = "deepspeed"\n', 'framework = "deepspeed"\nsub_group_size = 100000\n')
SUBOFF = LLAMAOFF.replace('framework = "deepspeed"\n', 'framework = "deepspeed"\nsub_group_size = 0\n')

LIVE = LLAMA.replace("reduce_bucket_size = 65536", "reduce_bucket_size = 65536\nprefetch_bucket_size = 10000\n"
                     "max_live_parameters = 100000")

RUNS = [
    {"tag": "llama", "stages": [3]},
    {"tag": "odd", "stages": [3, 2, 1, 0]},
    {"tag": "live", "stages": [3], "zero_optimization": {"stage3_max_reuse_distance": 0}},
    {"tag": "oddoff", "stages": [2, 1]},
    {"tag": "llamaoff", "stages": [3]},
    {"tag": "oddacc", "stages": [2, 1]},
    {"tag": "oddoffacc", "stages": [2, 1]},
    {"tag": "oddaccov", "stages": [1]},
    {"tag": "oddbf16", "stages": [1]},
    {"tag": "sub", "stages": [3]},
    {"tag": "suboff", "stages": [3]},
]
JOBS = {"llama": LLAMA, "odd": ODD, "live": LIVE, "oddoff": ODDOFF, "llamaoff": LLAMAOFF, "oddacc": ODDACC,
        "oddoffacc": ODDOFFACC, "oddaccov": ODDACCOV, "oddbf16": ODDBF16, "sub": SUB, "suboff": SUBOFF}


def _platform_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"DeepSpeed's CPU accelerator is run on Linux only here, not {sys.platform}"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    return None


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("jobs")
    paths = {}
    for tag, text in JOBS.items():
        path = folder / f"{tag}.toml"
        path.write_text(text, encoding="utf-8")
        paths[tag] = str(path)
    return paths


@pytest.fixture(scope="module")
def measured(jobs, tmp_path_factory) -> dict:
    """{(tag, stage, rank): report} from one torchrun launch."""
    problem = _platform_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("deepspeed")
    runs = [dict(run, job=jobs[run["tag"]]) for run in RUNS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
           str(HELPER), str(out), json.dumps(runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    reports = {}
    for run in RUNS:
        for stage in run["stages"]:
            for rank in range(NPROC):
                path = out / f"{run['tag']}_stage{stage}_rank{rank}.json"
                reports[run["tag"], stage, rank] = json.loads(path.read_text(encoding="utf-8"))
    return reports


def _cli_json(*args: str) -> dict:
    result = run_cli(*args)
    assert result.code == 0, result.err
    return result.json


@pytest.fixture(scope="module")
def planned(jobs) -> dict:
    """shardplan's side: `shards --json` and `estimate --json --explain` per job and stage."""
    plans = {}
    for run in RUNS:
        job = jobs[run["tag"]]
        for stage in run["stages"]:
            estimate = _cli_json("estimate", job, "--zero", str(stage), "--json", "--explain")
            plans[run["tag"], stage] = {
                "shards": _cli_json("shards", job, "--zero", str(stage), "--json"),
                "device": estimate["devices"][0],
            }
    return plans


def _term(device: dict, kind: str, label: str) -> int:
    """Bytes of the one term of `kind` whose label starts with `label`."""
    found = [t["bytes"] for t in device["terms"][kind] if t["label"].startswith(label)]
    assert len(found) == 1, (kind, label, [t["label"] for t in device["terms"][kind]])
    return found[0]


def _persistent(report: dict) -> set[str]:
    return {name for name, p in report["params"].items() if p["persist_after_initialize"]}


# -- ZeRO-3 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["llama", "odd"])
def test_zero3_partitions_and_persistent_parameters_per_rank(measured, planned, tag):
    """Each parameter's partition (`ds_tensor`, ceil(numel/dp) elements), which parameters
    persist (`ds_persist`) and the whole copy they keep, against `shards --json`: per parameter
    and per rank."""
    shards = planned[tag, 3]["shards"]
    assert shards["style"] == "zero3"
    for rank in range(NPROC):
        report = measured[tag, 3, rank]
        params = report["params"]
        assert {p["name"] for p in shards["params"]} == set(params)
        for p in shards["params"]:
            theirs = params[p["name"]]
            assert theirs["element_size"] == shards["element_bytes"], p["name"]
            shard = next(s for s in p["shards"] if s["rank"] == rank)
            assert shard["end"] - shard["start"] + shard["padding"] == theirs["partition_numel"], p["name"]
            assert theirs["partition_numel"] == -(-theirs["ds_numel"] // NPROC), p["name"]
            whole = theirs["ds_numel"] * theirs["element_size"] if theirs["persist_after_initialize"] else 0
            assert p["persistent_bytes"] == whole, p["name"]
            assert shard["bytes"] == theirs["partition_numel"] * theirs["element_size"] + whole, p["name"]
        held = sum(p["partition_numel"] * p["element_size"] for p in params.values())
        held += sum(params[name]["ds_numel"] * params[name]["element_size"] for name in _persistent(report))
        assert shards["ranks"][rank]["bytes"] == held
    # The boundary: tensors of exactly the threshold persist (`<=`), the next size up does not.
    threshold = {"llama": 8192, "odd": 9801}[tag]
    sizes = {p["ds_numel"]: p["persist_after_initialize"] for p in measured[tag, 3, 0]["params"].values()}
    assert sizes[threshold] is True
    assert all(persist == (numel <= threshold) for numel, persist in sizes.items())
    if tag == "odd":  # rank 1's partition of every odd-sized tensor ends in one padding element
        odd = sum(p["ds_numel"] % 2 for p in measured[tag, 3, 0]["params"].values())
        assert shards["ranks"][1]["padding"] == odd > 0


@pytest.mark.parametrize("tag", ["llama", "odd"])
def test_zero3_estimate_terms(measured, planned, tag):
    """`estimate --explain` terms of one rank against DeepSpeed's allocations: the partitions
    and persistent copies (gpu.params), the gradient partitions' flat buffer (stage3.py 791),
    the fp32 master partitions (one per sub-group and parameter group, stage3.py 1110-1176),
    AdamW's two moments, and the IPG bucket (reduce_bucket_size elements, stage3.py 780-784)."""
    device = planned[tag, 3]["device"]
    report = measured[tag, 3, 0]
    params, buffers, moments = report["params"], report["buffers"], report["moments"]
    partitions = sum(p["partition_numel"] * p["element_size"] for p in params.values())
    persistent = sum(params[name]["ds_numel"] * params[name]["element_size"] for name in _persistent(report))
    assert _term(device, "gpu.params", "16-bit parameter partitions") == partitions
    assert _term(device, "gpu.params", "persistent parameters") == persistent
    assert sum(buffers["fp16_partitioned_groups_flat"]) * BF16 == partitions
    assert _term(device, "gpu.grads", "gradient partitions") == (
        buffers["grad_partitions_flat_buffer"] * buffers["grad_element_size"])
    assert _term(device, "gpu.optimizer", "fp32 master partition") == (
        sum(buffers["fp32_partitioned_groups_flat"]) * buffers["fp32_element_size"])
    assert set(moments["numel"]) == {"exp_avg", "exp_avg_sq"}
    assert _term(device, "gpu.optimizer", "Adam moments") == (
        sum(sum(v) for v in moments["numel"].values()) * moments["element_size"])
    assert _term(device, "gpu.buffers", "IPG bucket") == sum(buffers["ipg_buckets"].values()) * BF16


def test_zero3_persistent_parameters_stay_whole_from_the_second_step(measured, planned):
    """DeepSpeed keeps the persistent parameters whole, but only once its module trace is
    complete: the first forward records the trace and releases every parameter it gathered
    (partitioned_param_coordinator.py 498-499, no `ds_persist` test before the trace is
    complete); the step gathers the persistent ones (stage3.py `_post_step`, 2840-2841) and
    from then on the coordinator skips them (line 640). shardplan counts them held throughout,
    which is the steady state (and the first step holds less, never more)."""
    for tag in ("llama", "odd"):
        persistent = {p["name"] for p in planned[tag, 3]["shards"]["params"] if p["persistent_bytes"]}
        for rank in range(NPROC):
            report = measured[tag, 3, rank]
            whole = {moment: set(names) for moment, names in report["whole"].items()}
            assert _persistent(report) == persistent
            # zero.Init marks nothing persistent: `Init.apply_param_persistence` is False
            # (partition_parameters.py 957) unless `_update_persist_config` (line 1195) runs,
            # which nothing in 0.19.8 calls; deepspeed.initialize marks them
            # (parameter_offload.py 189, 317-329).
            assert not any(p["persist"] for p in report["params"].values())
            assert sum(p["data_numel"] for p in report["params"].values()) == 0  # zero.Init keeps nothing whole
            assert whole["forward1"] == set()
            assert whole["step1"] == whole["step2"] == persistent
            assert persistent <= whole["forward2"]


def test_zero3_default_reuse_distance_keeps_the_whole_model_gathered(measured):
    """Measured behaviour: with DeepSpeed's default stage3_max_reuse_distance (1e9 elements,
    zero/config.py 251), a parameter used again within that many elements of the trace is not
    released (partitioned_param_coordinator.py 654-662). Backward reuses every parameter, so
    a model under about 1e9 elements stays gathered from its forward into backward: after the
    second forward every non-persistent parameter of LLAMA and ODD is held whole."""
    for tag in ("llama", "odd"):
        for rank in range(NPROC):
            report = measured[tag, 3, rank]
            non_persistent = sum(p["ds_numel"] for name, p in report["params"].items()
                                 if name not in _persistent(report))
            assert report["gathered"]["after_forward2"] == non_persistent
            assert report["gathered"]["peak2"] == non_persistent
            # The first step records the trace: no prefetch, every module released after use.
            assert report["gathered"]["peak1"] < non_persistent


def _stage3_memory(job: str, stage: int = 3):
    """core/deepspeed.py `deepspeed_memory` of rank 0 at `stage`: its terms at every moment
    (`estimate --json` lists those of the peak moment only)."""
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    resolved = load_job(job)
    zero = resolved.job.zero
    plan = DeepSpeedPlan(stage=stage, degree=NPROC, index=0, precision=resolved.job.train.precision,
                         optimizer=resolved.job.train.optimizer, reduce_bucket_size=zero.reduce_bucket_size,
                         prefetch_bucket_size=zero.prefetch_bucket_size, max_live_parameters=zero.max_live_parameters,
                         persistence_threshold=zero.param_persistence_threshold, overlap_comm=zero.overlap_comm,
                         grad_accum_dtype=zero.grad_accum_dtype,
                         sub_group_size=zero.sub_group_size, offload_optimizer=resolved.job.offload.optimizer, offload_params=resolved.job.offload.params,
                         accumulating=resolved.job.parallel.num_microbatches > 1,
                         pin=False)  # pinned rounding is CUDA's
    return deepspeed_memory(rank_params(resolved.shape, 1, 1, 0, 1, 0), plan)


def _gather_terms(job: str) -> int:
    """shardplan's largest gathered-parameter term over the moments of the step, in elements:
    the module gathered whole plus the prefetched parameters (core/deepspeed.py `_stage3`)."""
    per_moment = [sum(t.bytes for t in terms if t.label.startswith(("gathered module", "prefetched parameters")))
                  for terms in _stage3_memory(job).buffers_at.values()]
    return max(per_moment) // BF16


@pytest.mark.parametrize("tag", ["llama", "odd"])
def test_zero3_step_casts_one_sub_group(measured, jobs, tag):
    """The step flattens one sub-group's 16-bit gradients and casts them to fp32 at a time
    (stage3.py `_prepare_fp32_grad_for_sub_group`); DeepSpeed's sub-groups are its partitioned
    parameter groups (both far under sub_group_size), the matrices the larger. shardplan's
    step-time term is the largest sub-group at 2 + 4 bytes an element."""
    from shardplan.core.timeline import STEP

    buffers = measured[tag, 3, 0]["buffers"]
    assert len(buffers["fp16_partitioned_groups_flat"]) == 2  # matrices, vectors
    assert buffers["fp16_partitioned_groups_flat"] == buffers["fp32_partitioned_groups_flat"]
    (term,) = [t for t in _stage3_memory(jobs[tag]).buffers_at[STEP] if t.label.startswith("fp32 gradients of one")]
    assert term.bytes == max(buffers["fp32_partitioned_groups_flat"]) * (BF16 + buffers["fp32_element_size"])


def _step_cast(job: str) -> int:
    """Bytes of shardplan's step-time term: one sub-group's gradients, flattened and cast."""
    from shardplan.core.timeline import STEP

    (term,) = [t for t in _stage3_memory(job).buffers_at[STEP] if t.label.startswith("fp32 gradients of one")]
    return term.bytes


def test_zero3_sub_group_size_cuts_the_step(measured, jobs):
    """SUB: sub_group_size 100,000, carried by the config `export` writes, cuts each parameter
    group after the tensor that brings a sub-group to 100,000 elements or past
    (`_create_fp16_sub_groups`, stage3.py 1210-1233). DeepSpeed's fp32 partitions, one per
    sub-group (lines 1110-1176), are the sub-groups core/deepspeed.py `stage3_sub_groups`
    computes, and the step casts one at a time (`_prepare_fp32_grad_for_sub_group` asserts the
    cast is the partition's size, lines 2686-2691): shardplan's step term falls from LLAMA's
    whole matrices group at the default 1e9 to the largest of SUB's."""
    from shardplan.core.deepspeed import stage3_sub_groups
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    # tiny-llama's matrices over 2 ranks (ceil(numel / 2)): embedding and head 512 x 128 / 2 =
    # 32,768; per layer q 8,192, k 4,096, v 4,096, o 8,192, gate, up, down 22,528 each. Cut after
    # layer 0's up (32,768 + 69,632), layer 1's down, layer 3's q, and the rest with the head;
    # the 9 norm weights (64 each) are the vectors' group.
    expected = [102_400, 114_688, 100_352, 116_736, 576]
    rp = rank_params(load_job(jobs["sub"]).shape, 1, 1, 0, 1, 0)
    assert stage3_sub_groups(rp, NPROC, 100_000) == expected
    for rank in range(NPROC):
        report = measured["sub", 3, rank]
        assert report["config"]["zero_optimization"]["sub_group_size"] == 100_000
        assert report["buffers"]["fp16_partitioned_groups_flat"] == expected
        assert report["buffers"]["fp32_partitioned_groups_flat"] == expected
    fp32 = measured["sub", 3, 0]["buffers"]["fp32_element_size"]
    assert _step_cast(jobs["sub"]) == 116_736 * (BF16 + fp32)
    # LLAMA at the default: its matrices group whole (434,176 <= 1e9, stage3.py 1215).
    assert measured["llama", 3, 0]["buffers"]["fp32_partitioned_groups_flat"] == [sum(expected[:4]), 576]
    assert _step_cast(jobs["llama"]) == sum(expected[:4]) * (BF16 + fp32)


def test_zero3_offload_sub_group_size_0_gives_every_tensor_a_buffer(measured, jobs):
    """SUBOFF: DeepSpeed accepts sub_group_size 0 (zero/config.py line 182, `ge=0`), and then
    every tensor closes a sub-group of its own (`local_sub_group_size >= sub_group_size`,
    stage3.py line 1226); with offload_optimizer each sub-group has its own fp32 gradient
    buffer on the host (lines 1337-1343): one per tensor of tiny-llama (4 layers of 7 matrices
    and 2 norms, the embedding, the head and the final norm: 39), as core/deepspeed.py's host
    terms list them (unpinned, as on test_zero3_offload_host_buffers_measured)."""
    host = [t.bytes for t in _stage3_memory(jobs["suboff"]).host if t.label == "fp32 gradient sub-group"]
    for rank in range(NPROC):
        report = measured["suboff", 3, rank]
        assert report["config"]["zero_optimization"]["sub_group_size"] == 0
        offload = report["buffers"]["offload"]
        assert len(offload["fp32_grad_sub_groups"]) == len(report["params"]) == 4 * 9 + 3
        assert host == [n * offload["fp32_grad_element_size"] for n in offload["fp32_grad_sub_groups"]]


def test_zero3_gathered_parameters_measured(measured, jobs):
    """LIVE (reuse distance 0): the most non-persistent parameter elements DeepSpeed holds whole
    at once (gathered or in flight) in a steady-state step stay within DeepSpeed's own bound:
    what the prefetcher may hold (stage3_max_live_parameters, counted with in-flight
    parameters, partitioned_param_coordinator.py 453 and 593) plus the module being fetched,
    whose own fetch is never capped (line 381, before the prefetch budget). shardplan's term
    is the largest module (the head, 65,536) plus what may be in flight, max_live = 100,000
    (the rank's non-persistent parameters are more)."""
    assert _gather_terms(jobs["live"]) == 65_536 + 100_000
    for rank in range(NPROC):
        gathered = measured["live", 3, rank]["gathered"]
        assert 10_000 + 65_536 < gathered["peak2"] <= 100_000 + 65_536


def test_zero3_gathered_parameters_within_shardplan_terms(measured, jobs):
    """DeepSpeed's prefetch budget, min(max_live - available, prefetch_bucket_size), is per
    fetch_sub_module call (partitioned_param_coordinator.py 452-467) and every module makes
    one: in-flight parameters pile up to stage3_max_live_parameters (LIVE: 155,648 elements
    held at the peak), within shardplan's gathered module plus prefetch terms."""
    planned = _gather_terms(jobs["live"])
    assert max(measured["live", 3, rank]["gathered"]["peak2"] for rank in range(NPROC)) <= planned


# -- ZeRO-1 and ZeRO-2 ------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_flat_buffers_master_and_moments(measured, planned, stage):
    """ODD at ZeRO-1/2: the two flat 16-bit groups, each padded to a multiple of 2*dp
    (stage_1_and_2.py 441-446), this rank's fp32 master partition of each (line 577), AdamW's
    moments, the fullest rank's `grads_in_partition` (full numel of the parameters overlapping
    its partition, line 2192: rank 1 here, which the estimate shows) and one IPG bucket of reduce_bucket_size (overlap_comm off below
    stage 3, zero/config.py 384-386; lines 3266-3269) against `estimate --explain`."""
    device = planned["odd", stage]["device"]
    for rank in range(NPROC):
        report = measured["odd", stage, rank]
        assert report["group_numel"] == [ODD_MATRICES, ODD_VECTORS]  # 2 mod 4 each
        assert report["bit16_groups_flat"] == [-(-n // (2 * NPROC)) * 2 * NPROC for n in report["group_numel"]]
        assert _term(device, "gpu.params", "flat 16-bit parameters") == (
            sum(report["bit16_groups_flat"]) * report["bit16_element_size"])
        master = sum(report["single_partition_of_fp32_groups"])
        assert master * NPROC == sum(report["bit16_groups_flat"])
        assert _term(device, "gpu.optimizer", "fp32 master partition") == master * report["fp32_element_size"]
        moments = report["moments"]
        assert _term(device, "gpu.optimizer", "Adam moments") == (
            sum(sum(v) for v in moments["numel"].values()) * moments["element_size"])
        assert report["backward_end"]["ipg_buffers"] == [65536]
    fullest = measured["odd", stage, 1]["backward_end"]
    assert _term(device, "gpu.grads", "gradients overlapping the partition") == (
        fullest["grads_in_partition"] * fullest["grads_element_size"])


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gradient_partitions_differ_between_ranks(measured, jobs, stage):
    """`grads_in_partition` holds the full numel of every parameter overlapping the rank's
    partition (stage_1_and_2.py 2184-2194); on ODD rank 1's is the larger, as core/deepspeed.py
    `flat_groups` computes for each shard index."""
    from shardplan.core.deepspeed import flat_groups
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    held = [measured["odd", stage, rank]["backward_end"]["grads_in_partition"] for rank in range(NPROC)]
    assert held[1] > held[0]
    rp = rank_params(load_job(jobs["odd"]).shape, 1, 1, 0, 1, 0)
    assert [sum(g.in_partition for g in flat_groups(rp, NPROC, index)) for index in range(NPROC)] == held


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_estimate_covers_the_fullest_rank(measured, planned, stage):
    """grads_in_partition is larger on rank 1 of ODD (277,101 elements against rank 0's
    251,262): the estimate's device is that rank (core/deepspeed.py `fullest_flat_index`)."""
    device = planned["odd", stage]["device"]
    held = [measured["odd", stage, rank]["backward_end"]["grads_in_partition"] for rank in range(NPROC)]
    assert device["ranks"] == [0, 1]  # one device stands for both ranks
    assert _term(device, "gpu.grads", "gradients overlapping the partition") >= max(held) * BF16


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_shards_match_deepspeed_partitions(measured, planned, stage):
    shards = planned["odd", stage]["shards"]
    assert shards["style"] == "zero12"
    padded = [b["padded_numel"] for b in shards["flat_buffers"]]
    report = measured["odd", stage, 0]
    assert padded == report["bit16_groups_flat"]
    for rank in range(NPROC):
        total = shards["ranks"][rank]
        assert total["numel"] + total["padding"] == sum(measured["odd", stage, rank]["single_partition_of_fp32_groups"])


# -- the copies a reduction makes -------------------------------------------------------------


def _copy_term(job: str, stage: int, moment: str) -> int:
    """Elements of shardplan's reduction-copy term at `moment` (0 if it has none)."""
    found = [t.bytes for t in _stage3_memory(job, stage).buffers_at[moment]
             if t.label.startswith(("flattened bucket", "padded bucket", "flattened gradients"))]
    assert len(found) <= 1, found
    return found[0] // BF16 if found else 0


@pytest.mark.parametrize("tag, stage", [("llama", 3), ("odd", 3), ("odd", 2), ("odd", 1), ("odd", 0),
                                        ("oddoff", 2), ("oddoff", 1)])
def test_reduction_copies_measured(measured, jobs, tag, stage):
    """The transient copy reducing a bucket of gradients makes, recorded in backward on every
    rank: `flatten` in `allreduce_bucket` (stage_1_and_2.py 2367, engine.py 3796; a list of one
    tensor is viewed, not copied) and the `torch.cat` of `reduce_scatter_coalesced`
    (comm/coalesced_collectives.py 122). Measured (elements copied, elements given), in call
    order; shardplan's term is core/deepspeed.py `reduction_copy`.

    - ZeRO-3: every bucket of two or more gradients is concatenated, each padded to dp: the
      largest copy equals the term (LLAMA 61,568; ODD 59,604), in backward.
    - ZeRO-2: only a bucket crossing a partition boundary is copied (ODD: one, 59,301); which
      one depends on the order autograd ends a layer's gradients, so the term is the largest
      bucket (59,598), which DeepSpeed did form.
    - ZeRO-1 without overlap_comm: the buckets are filled after backward in group order, which
      shardplan follows exactly: the one copy, 58,806, at `backward end`.
    - No ZeRO: the engine flattens every gradient in one list under 5e8 elements (489,060).
    - With ZeRO-Offload (ODDOFF) the reductions are the same."""
    from shardplan.core.timeline import BACKWARD, BACKWARD_END

    after = stage in (0, 1)  # ODD(OFF) leaves overlap_comm at DeepSpeed's default: off below stage 3
    term = _copy_term(jobs[tag], stage, BACKWARD_END if after else BACKWARD)
    assert _copy_term(jobs[tag], stage, BACKWARD if after else BACKWARD_END) == 0
    for rank in range(NPROC):
        report = measured[tag, stage, rank]
        calls = report["copies"]["backward2"] if stage == 3 else report["copies"]
        copied = max(copy for copy, _ in calls)
        if stage == 2:
            assert 0 < copied <= term == max(given for _, given in calls)
            assert sum(1 for copy, _ in calls if copy) == 1
        else:
            assert copied == term > 0
    if stage == 0:
        assert term == measured[tag, 0, 0]["numel"]


@pytest.mark.parametrize("stage", [2, 1])
def test_zero_offload_host_buffers_measured(measured, jobs, stage):
    """ZeRO-Offload (ODDOFF) against what DeepSpeed allocated, per optimizer group: the fp32
    master partition on the CPU (stage_1_and_2.py line 560), its 16-bit staging copy (lines
    566-575), the fp32 gradient partition (`initialize_optimizer_states`, lines 934-942), the
    moments (torch's AdamW here, DeepSpeedCPUAdam's two fp32 moments in shardplan), and one
    buffer of the largest parameter's gradient on each side (lines 653-661), against
    core/deepspeed.py's host and GPU terms (unpinned: the power-of-two rounding is CUDA's
    caching host allocator, which a CPU run does not use)."""
    from shardplan.core.timeline import BACKWARD

    memory = _stage3_memory(jobs["oddoff"], stage)
    host: dict[str, list[int]] = {}
    for term in memory.host:
        host.setdefault(term.label, []).append(term.bytes)
    for rank in range(NPROC):
        report = measured["oddoff", stage, rank]
        offload = report["offload"]
        assert offload["devices"] == ["cpu"]
        master = report["single_partition_of_fp32_groups"]
        assert host["fp32 master partition"] == [n * report["fp32_element_size"] for n in master]
        assert host["16-bit staging copy of the partition"] == [
            n * offload["bit16_staging_element_size"] for n in offload["bit16_staging"]]
        assert host["fp32 gradient partition"] == [n * offload["fp32_grad_element_size"] for n in offload["fp32_grad"]]
        moments = report["moments"]
        assert host["Adam moments (DeepSpeedCPUAdam)"] == [
            sum(sum(v) for v in moments["numel"].values()) * moments["element_size"]]
        largest = offload["temp_grad_buffer_for_cpu_offload"] * offload["temp_element_size"]
        assert host["gradient staging buffer (largest parameter)"] == [largest]
        (gpu_staging,) = [t.bytes for t in memory.buffers_at[BACKWARD] if t.label.startswith("gradient staging")]
        assert gpu_staging == offload["temp_grad_buffer_for_gpu_offload"] * offload["temp_element_size"] == largest


def test_zero3_offload_host_buffers_measured(measured, jobs):
    """LLAMAOFF (ZeRO-3, optimizer and parameters offloaded to the CPU) against DeepSpeed: the
    gradient partitions' flat buffer on the host (stage3.py 786-801), the fp32 master
    partitions there (a plain clone, 1157-1160), one fp32 gradient buffer per sub-group
    (1337-1343), the 16-bit partitions in one host buffer per parameter group
    (`_create_param_groups_fp16_flat_cpu_memory`, 888-911) and the moments, against
    core/deepspeed.py's host terms (unpinned, as on test_zero_offload_host_buffers_measured)."""
    from shardplan.core.deepspeed import pinned_bytes

    memory = _stage3_memory(jobs["llamaoff"], 3)
    host: dict[str, list[int]] = {}
    for term in memory.host:
        host.setdefault(term.label, []).append(term.bytes)
    for rank in range(NPROC):
        report = measured["llamaoff", 3, rank]
        buffers, offload = report["buffers"], report["buffers"]["offload"]
        assert offload["fp32_device"] == ["cpu"] == offload["fp16_partitions_device"]
        assert offload["grad_partitions_device"] == "cpu"
        assert host["gradient partitions"] == [buffers["grad_partitions_flat_buffer"] * buffers["grad_element_size"]]
        assert host["fp32 master partition"] == [sum(buffers["fp32_partitioned_groups_flat"]) * buffers["fp32_element_size"]]
        assert host["fp32 gradient sub-group"] == [n * offload["fp32_grad_element_size"]
                                                   for n in offload["fp32_grad_sub_groups"]]
        # Pinned whatever pin_memory says (line 906): rounded up to a power of two by CUDA's
        # pinned allocator (core/deepspeed.py `pinned_bytes`); DeepSpeed's CPU accelerator pins nothing.
        assert host["16-bit parameter partitions (pinned)"] == [pinned_bytes(n * BF16) for n in offload["fp16_cpu_groups"]]
        moments = report["moments"]
        assert host["Adam moments (DeepSpeedCPUAdam)"] == [
            sum(sum(v) for v in moments["numel"].values()) * moments["element_size"]]


def test_zero2_accumulation_holds_two_gradient_buffers(measured, jobs):
    """ODDACC at ZeRO-2, two microbatches: when the second one's backward ends (its epilogue
    starts), DeepSpeed holds its own grads_in_partition and the first one's, which
    `all_grad_tensors` still views (stage_1_and_2.py lines 1036-1045); the first microbatch
    holds one. shardplan's `backward` moment has the two terms (core/deepspeed.py)."""
    from shardplan.core.timeline import BACKWARD

    terms = {t.label: t.bytes for t in _stage3_memory(jobs["oddacc"], 2).grads_at[BACKWARD]}
    in_partition = terms["gradients overlapping the partition (grads_in_partition)"]
    assert terms["this microbatch's grads_in_partition (accumulating)"] == in_partition
    first, second = measured["oddacc", 2, 0]["backward_ends"]
    assert first["gradient_storages"] == [in_partition]
    assert second["gradient_storages"] == [in_partition, in_partition]


@pytest.mark.parametrize("stage", [2, 1])
def test_zero_offload_accumulation_buffers(measured, jobs, stage):
    """ODDOFFACC: ZeRO-Offload accumulating at stage 2 keeps one 16-bit host buffer per
    parameter overlapping the partition (`accumulated_grads_in_cpu`, lines 1846-1853), each the
    parameter's full numel: 36 on rank 0 (251,262 elements). At stage 1 it keeps none, since
    stage 1 reduces only at the boundary (line 2166). shardplan's host term, unpinned."""
    held = sum(t.bytes for t in _stage3_memory(jobs["oddoffacc"], stage).host if t.label.startswith("accumulated"))
    measured_numel = measured["oddoffacc", stage, 0]["backward_ends"][-1]["accumulated_grads_in_cpu"]
    assert held == sum(measured_numel) * BF16
    assert (len(measured_numel) > 0) is (stage == 2)


@pytest.mark.parametrize("tag, stage", [("oddacc", 1), ("oddaccov", 1), ("oddoffacc", 1), ("oddacc", 2),
                                        ("oddoffacc", 2)])
def test_stage_1_holds_every_gradient_until_the_boundary(measured, jobs, tag, stage):
    """After the first of two microbatches, ZeRO-1 leaves every parameter's full 16-bit
    gradient in `.grad` (489,060 elements, 978,120 B): it reduces only at the accumulation
    boundary (`reduce_ready_partitions_and_remove_grads`, stage_1_and_2.py line 2294), with
    overlap_comm or ZeRO-Offload too. ZeRO-2 reduces them as they come and leaves none.
    shardplan's term for the `forward` moment of an accumulating step."""
    from shardplan.core.timeline import FORWARD

    held = sum(t.bytes for t in _stage3_memory(jobs[tag], stage).grads_at[FORWARD]
               if t.label.startswith("gradients of every parameter"))
    for rank in range(NPROC):
        first = measured[tag, stage, rank]["backward_ends"][0]
        assert first["param_grad_bytes"] == held == (2 * (ODD_MATRICES + ODD_VECTORS) if stage == 1 else 0)


# -- Stage 1 with bf16 and fp32 gradient accumulation: BF16_Optimizer -------------------------

def test_bf16_optimizer_at_stage_1_measured(measured, planned, jobs):
    """ODDBF16 (ZeRO-1, bf16, data_types.grad_accum_dtype fp32, two microbatches) steps with
    BF16_Optimizer (engine.py lines 2305-2310), measured on both ranks against the estimate's
    terms: the flat bf16 copy padded to 2*dp (bf16_optimizer.py lines 165-171), the fp32
    partition of 1/dp (lines 181-183) and AdamW's moments of that size, the accumulation buffer
    of the whole flat size in fp32 (line 191), every parameter's bf16 gradient alive as the
    optimizer steps; the master's gradient is a view of the fp32 buffer, not a cast (lines
    414-418), so the step adds no buffer; the engine's all-reduce flattens the two groups' fp32
    buffers into one copy after backward (engine.py lines 3828-3838)."""
    from shardplan.core.timeline import BACKWARD_END, STEP

    device = planned["oddbf16", 1]["device"]
    memory = _stage3_memory(jobs["oddbf16"], 1)
    copy = [t.bytes for t in memory.buffers_at[BACKWARD_END] if t.label.startswith("flattened gradient buffers")]
    assert memory.buffers_at[STEP] == [] and len(copy) == 1
    for rank in range(NPROC):
        report = measured["oddbf16", 1, rank]
        assert report["optimizer"] == "BF16_Optimizer"
        assert report["bf16_groups_flat"][0] == BF16
        assert sum(report["bf16_groups_flat"][1]) * BF16 == _term(device, "gpu.params", "flat bf16 parameters")
        assert report["fp32_groups_flat_partition"][0] == 4
        assert sum(report["fp32_groups_flat_partition"][1]) * 4 == _term(device, "gpu.optimizer", "fp32 master partition")
        assert report["adam_moments_bytes"] == _term(device, "gpu.optimizer", "Adam moments")
        assert report["fp32_groups_gradients_flat"][0] == 4
        assert sum(report["fp32_groups_gradients_flat"][1]) * 4 == _term(
            device, "gpu.grads", "gradient accumulation buffer (fp32_groups_gradients_flat, fp32)")
        assert report["lp_grads_at_step_bytes"] == _term(device, "gpu.grads", "bf16 gradients of the parameters")
        assert report["master_grads_at_step"] == [4, sum(report["fp32_groups_flat_partition"][1])]
        assert report["master_grads_are_buffer_views"]
        assert max(copied for copied, _ in report["copies"]) * 4 == copy[0]


# -- Stage 0 with bf16 under a PipelineModule: BF16_Optimizer ----------------------------------
#
# A second launch, 4 CPU ranks (pp 2 x dp 2), runs this module as a script (`_bf16_pipeline_worker`
# below): a PipelineModule whose two stages hold exactly the tensors shardplan gives ODD's pipeline
# ranks at pp 2 (core/deepspeed.py `ordered_params`; each stage is one module holding them, their
# gradients all ones), trained by DeepSpeed's pipeline engine with bf16 at ZeRO 0, two
# microbatches, torch's AdamW over the weight-decay groups. Only the tensors' shapes and order
# decide what BF16_Optimizer allocates (bf16_optimizer.py `_setup_for_real_optimizer`).

PIPE_NPROC = 4  # pp 2 x dp 2


def _odd_pipeline_ranks() -> list:
    import tomllib

    from shardplan.core.stages import rank_params
    from shardplan.spec.model import resolve_shape

    model = tomllib.loads(ODD)["model"]
    shape, problems = resolve_shape({k: v for k, v in model.items() if k != "name"})
    assert not problems, problems
    return [rank_params(shape, 2, 1, pp_rank, 1, 0) for pp_rank in range(2)]


@pytest.fixture(scope="module")
def bf16_pipeline(tmp_path_factory) -> dict:
    """{(pp_rank, dp_rank): report} from one torchrun launch of `_bf16_pipeline_worker`."""
    problem = _platform_problem()
    if problem:
        pytest.skip(problem)
    from shardplan.core.deepspeed import decays, ordered_params

    stages = [[[list(p.shape), decays(p)] for p in ordered_params(rp)] for rp in _odd_pipeline_ranks()]
    out = tmp_path_factory.mktemp("bf16_pipeline")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PIPE_NPROC),
           __file__, str(out), json.dumps(stages)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    reports = {}
    for rank in range(PIPE_NPROC):
        report = json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
        reports[report["stage"], report["dp_rank"]] = report
    return reports


def _bf16_memory(rp, dp_rank: int):
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory

    plan = DeepSpeedPlan(stage=0, degree=2, index=dp_rank, precision="bf16-mixed", optimizer="adamw",
                         accumulating=True, pipeline=True)
    return deepspeed_memory(rp, plan)


def _bytes_of(terms, label: str) -> int:
    found = [t.bytes for t in terms if t.label.startswith(label)]
    assert len(found) == 1, (label, [t.label for t in terms])
    return found[0]


def test_bf16_optimizer_buffers_measured(bf16_pipeline):
    """Each pipeline rank's BF16_Optimizer, measured, against core/deepspeed.py's terms: the flat
    bf16 copy padded to 2*dp (bf16_optimizer.py lines 165-171), the fp32 partition of 1/dp of it
    (lines 181-183) and AdamW's two moments of that size, the accumulation buffer of the whole
    flat size in bf16 (line 191), and at the step every parameter's bf16 gradient still alive
    beside the fp32 cast of this rank's part of the buffer (lines 414-418)."""
    ranks = _odd_pipeline_ranks()
    for (stage, dp_rank), report in sorted(bf16_pipeline.items()):
        assert report["optimizer"] == "BF16_Optimizer"
        memory = _bf16_memory(ranks[stage], dp_rank)
        params, grads, optimizer = memory.gpu["params"], memory.gpu["grads"], memory.gpu["optimizer"]
        assert report["bf16_groups_flat"] == [BF16, _bytes_of(params, "flat bf16 parameters") // BF16]
        assert report["fp32_groups_flat_partition"] == [4, _bytes_of(optimizer, "fp32 master partition") // 4]
        assert report["adam_moments_bytes"] == _bytes_of(optimizer, "Adam moments")
        assert report["fp32_groups_gradients_flat"] == [BF16, _bytes_of(grads, "gradient accumulation buffer") // BF16]
        assert report["lp_grads_at_step_bytes"] == _bytes_of(grads, "bf16 gradients of the parameters")
        assert report["master_grads_at_step"] == [4, _bytes_of(memory.buffers_at["step"], "fp32 gradient partition") // 4]


def test_bf16_optimizer_frees_the_gradients_at_the_step(bf16_pipeline):
    """After the step the parameters' bf16 gradients and the fp32 casts are gone (`zero_grad`,
    lines 625-627; lines 424-426), so a step's first forward holds neither, while the
    accumulation buffer stays (only zeroed, lines 605-610): the estimate's forward holds the
    buffer always and the bf16 gradients only when microbatches accumulate (a later forward
    follows a backward)."""
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory

    ranks = _odd_pipeline_ranks()
    for (stage, dp_rank), report in bf16_pipeline.items():
        assert report["lp_grads_after_step_bytes"] == 0
        assert report["master_grads_after_step"] == 0
        assert report["fp32_groups_gradients_flat"][1] > 0
        one = deepspeed_memory(ranks[stage], DeepSpeedPlan(stage=0, degree=2, index=dp_rank, precision="bf16-mixed",
                                                           optimizer="adamw", pipeline=True))
        assert [t.label for t in one.grads_at["forward"]] == [
            "gradient accumulation buffer (fp32_groups_gradients_flat, bf16)"]


def _bf16_pipeline_worker(out_dir: str, stages_json: str) -> None:
    """One rank of the bf16 pipeline run (see `bf16_pipeline`): writes OUT_DIR/rank<R>.json."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    stages = json.loads(stages_json)

    class Holder(torch.nn.Module):
        """One pipeline stage: holds the stage's tensors in order; every gradient is ones."""

        def __init__(self, shapes):
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape)) for shape, _ in shapes)

        def forward(self, x):
            return x + sum(p.sum() for p in self.weights)

    deepspeed.init_distributed(dist_backend="gloo")
    module = PipelineModule([LayerSpec(Holder, shapes) for shapes in stages], num_stages=len(stages),
                            partition_method="uniform", loss_fn=lambda out, label: (out.float() - label).pow(2).mean())
    stage = module.stage_id
    flags = [matrix for _, matrix in stages[stage]]
    params = list(module.parameters())
    groups = [{"params": [p for p, m in zip(params, flags) if m], "weight_decay": 0.1},
              {"params": [p for p, m in zip(params, flags) if not m], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                                                   config=config)
    seen = {}
    real_step = optimizer.optimizer.step

    def step(*args, **kwargs):
        masters = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
        seen["master_grads_at_step"] = [masters[0].grad.element_size(), sum(p.grad.numel() for p in masters)]
        seen["lp_grads_at_step_bytes"] = sum(p.grad.numel() * p.grad.element_size()
                                             for p in params if p.grad is not None)
        return real_step(*args, **kwargs)

    optimizer.optimizer.step = step
    data = iter([(torch.ones(1, 4, dtype=torch.bfloat16), torch.zeros(1, 4))] * 2)
    engine.train_batch(data_iter=data)
    state = optimizer.optimizer.state
    report = dict(
        stage=stage, dp_rank=dist.get_rank(group=engine.mpu.get_data_parallel_group()),
        optimizer=type(optimizer).__name__,
        bf16_groups_flat=[2, sum(t.numel() for t in optimizer.bf16_groups_flat)],
        fp32_groups_flat_partition=[optimizer.fp32_groups_flat_partition[0].element_size(),
                                    sum(t.numel() for t in optimizer.fp32_groups_flat_partition)],
        adam_moments_bytes=sum(v.numel() * v.element_size() for s in state.values() for k, v in s.items()
                               if k in ("exp_avg", "exp_avg_sq")),
        fp32_groups_gradients_flat=[optimizer.fp32_groups_gradients_flat[0].element_size(),
                                    sum(t.numel() for t in optimizer.fp32_groups_gradients_flat)],
        lp_grads_after_step_bytes=sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        master_grads_after_step=sum(p.grad.numel() for p in optimizer.fp32_groups_flat_partition if p.grad is not None),
        **seen,
    )
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    _bf16_pipeline_worker(sys.argv[1], sys.argv[2])
