"""`shardplan plan` as a user runs it: the CONTRACT's JSON, a written job that every other
command takes unchanged and whose estimate is the plan's to the byte and the microsecond, keys
the job fixes, exit 1 with the closest misses, and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import ROOT, OsWith, run_cli

JOB = """
[model]
preset = "llama-3-8b"
[train]
seq_len = 8192
[cluster]
preset = "h100-80gb"
"""
ARGS = ("--gpus", "8", "--global-batch", "64")
PLAN_KEYS = {"job", "peak_gpu_bytes", "cpu_bytes_per_node", "time"}


@pytest.fixture
def job(write):
    return write("job.toml", JOB)


def test_json_document(job):
    result = run_cli("plan", job, *ARGS, "--top", "4", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert {"plans", "evaluated", "rejected", "seconds"} <= set(doc)
    assert len(doc["plans"]) == 4
    for plan in doc["plans"]:
        assert PLAN_KEYS <= set(plan)
        assert {"parallel", "zero", "train"} <= set(plan["job"])
        p = plan["job"]["parallel"]
        assert p["dp"] * p["tp"] * p["pp"] * p["cp"] == 8
        assert p["dp"] * p["micro_batch_size"] * p["num_microbatches"] == 64
        assert plan["peak_gpu_bytes"] <= 80 * 2**30
    seconds = [plan["time"]["step_seconds"] for plan in doc["plans"]]
    assert seconds == sorted(seconds)
    # Every plan counted once: rejected for one reason, or fitting (and timed).
    assert doc["evaluated"] == sum(doc["rejected"].values()) + doc["fitting"]
    assert doc["fitting"] >= 4


def test_written_job_is_the_plan(job, tmp_path):
    """`--write` saves the best plan; `estimate` on it gives the plan's figures exactly, and
    `validate` and `export` take it as it is."""
    out = tmp_path / "best.toml"
    result = run_cli("plan", job, *ARGS, "--json", "--write", str(out))
    assert result.code == 0, result.err
    best = result.json["plans"][0]
    estimate = run_cli("estimate", str(out), "--json")
    assert estimate.code == 0, estimate.err
    doc = estimate.json
    assert doc["peak_gpu_bytes"] == best["peak_gpu_bytes"]
    assert doc["cpu_bytes_per_node"] == best["cpu_bytes_per_node"]
    assert doc["time"]["step_seconds"] == best["time"]["step_seconds"]
    assert doc["time"]["mfu"] == best["time"]["mfu"]
    assert doc["fits"] is True
    assert run_cli("validate", str(out)).code == 0
    for target in ("deepspeed", "torchtitan", "accelerate", "megatron"):
        exported = run_cli("export", str(out), "--to", target, "-o", str(tmp_path / f"cfg.{target}"))
        assert exported.code == 0, (target, exported.err)
    # What the job said is still there; the searched keys are the plan's.
    text = out.read_text()
    assert 'preset = "llama-3-8b"' in text and "seq_len = 8192" in text
    assert f"dp = {best['job']['parallel']['dp']}" in text


@pytest.mark.parametrize("extra", [
    "",
    '[lora]\nrank = 8\n',  # `run`: LoRA under FSDP2, no sequence parallel, no stage 1
    # Tied embeddings (Llama 3.2 1B, Gemma): `run` executes them without tensor parallel.
    '[model]\nfamily = "llama"\nnum_layers = 4\nhidden_size = 256\nnum_heads = 4\nnum_kv_heads = 4\n'
    'ffn_hidden_size = 512\nvocab_size = 1024\nmax_seq_len = 128\ntie_embeddings = true\n',
    # QLoRA: no tensor parallel, NF4 in torchao's whole blocks (a model whose linears have them)
    '[lora]\nrank = 8\nbase_dtype = "nf4"\n[model]\nfamily = "llama"\nnum_layers = 4\nhidden_size = 256\n'
    'num_heads = 4\nnum_kv_heads = 4\nffn_hidden_size = 512\nvocab_size = 1024\nmax_seq_len = 128\n',
])
def test_written_job_runs(write, tmp_path, extra):
    """Every plan for the framework `run` executes passes run's own capability check (full
    training, LoRA and QLoRA, whose runtime takes fewer plans)."""
    from shardplan.io.job import load_job
    from shardplan.runtime.capabilities import unsupported

    model = "" if "[model]" in extra else '[model]\npreset = "tiny-llama"\n'
    text = model + '[train]\nseq_len = 128\n[cluster]\ngpu = "h100-sxm"\ngpus_per_node = 4\n' + extra
    job = write("tiny.toml", text)
    out = tmp_path / "best.toml"
    result = run_cli("plan", job, "--gpus", "4", "--global-batch", "16", "--top", "100", "--json", "--write", str(out))
    assert result.code == 0, result.err
    assert unsupported(load_job(str(out))) == []
    plans = result.json["plans"]
    assert len(plans) > 5
    for number, plan in enumerate(plans):
        written = tmp_path / f"plan{number}.toml"
        document = tomllib.loads(text)
        for table, keys in plan["job"].items():
            document.setdefault(table, {}).update(keys)
        written.write_text(tomli_w.dumps(document), encoding="utf-8")
        assert unsupported(load_job(str(written))) == [], plan["job"]


def test_fixed_keys_stay(write):
    job = write("job.toml", JOB + "[parallel]\ntp = 2\n[zero]\nstage = 3\n")
    doc = run_cli("plan", job, *ARGS, "--json").json
    assert doc["plans"]
    for plan in doc["plans"]:
        assert plan["job"]["parallel"]["tp"] == 2 and plan["job"]["zero"]["stage"] == 3


def test_one_rank_shard_groups_list_a_plan_once(write):
    """With dp = cp = 1 the ZeRO stages shard nothing: a plan that several stages time alike
    is listed once, at its least peak (at dp 1, QLoRA of a 70B model: stages 0 and 3 give the
    same peak and step, stage 1 the same step at a higher peak)."""
    job = write("job.toml", JOB.replace("llama-3-8b", "llama-3-70b").replace("seq_len = 8192", "seq_len = 2048")
                + '[lora]\nrank = 16\nbase_dtype = "nf4"\n')
    doc = run_cli("plan", job, "--gpus", "1", "--global-batch", "16", "--top", "20", "--json").json
    seen = {}
    for plan in doc["plans"]:
        stage = plan["job"]["zero"]["stage"]
        rest = json.dumps({**plan["job"], "zero": {**plan["job"]["zero"], "stage": None}}, sort_keys=True)
        key = (rest, plan["time"]["step_seconds"])
        assert key not in seen, (stage, seen.get(key))
        seen[key] = stage
    assert seen and 3 not in seen.values()
    assert "the same plan and step at another ZeRO stage" in json.dumps(doc["rejected"])


def test_a_layer_split_that_changes_no_figure_is_listed_once(write):
    """Llama-3.1 405B (126 layers) QLoRA on 8 GPUs: at pp 8 the even split is 16 x 6 + 15 x 2,
    and a last stage of 14 (16 x 7 + 14) leaves the first stage's memory and the slowest
    stage's time as they were: the same peak and step, listed once, as the even split, which
    writes no key (core/search.py, split_twin_key)."""
    text = (JOB.replace("llama-3-8b", "llama-3.1-405b").replace("seq_len = 8192", "seq_len = 2048")
            + '[lora]\nrank = 16\nbase_dtype = "nf4"\n')
    job = write("job.toml", text)
    doc = run_cli("plan", job, "--gpus", "8", "--global-batch", "8", "--pp", "8", "--top", "20", "--json",
                  "--set", "parallel.pipeline_schedule=1f1b").json  # interleaving (uneven chunks) rates faster
    seen = {}
    for plan in doc["plans"]:
        parallel = plan["job"]["parallel"]
        split = (parallel.get("first_stage_layers", 0), parallel.get("last_stage_layers", 0))
        rest = {k: v for k, v in parallel.items() if k not in ("first_stage_layers", "last_stage_layers")}
        key = (json.dumps({**plan["job"], "parallel": rest}, sort_keys=True), plan["time"]["step_seconds"],
               plan["peak_gpu_bytes"], plan["cpu_bytes_per_node"])
        assert key not in seen, (split, seen.get(key))
        seen[key] = split
    assert (0, 0) in seen.values()
    assert doc["rejected"]["the same peak and step at another layer split (the one with fewer keys kept)"] >= 1
    # The twin left out is the plan with the last stage of 14, which `estimate` rates the same.
    even = next(p for p in doc["plans"] if "last_stage_layers" not in p["job"]["parallel"]
                and "first_stage_layers" not in p["job"]["parallel"])
    sections = {**tomllib.loads(text), **even["job"]}
    sections["parallel"] = {**sections["parallel"], "last_stage_layers": 14}
    sections["cluster"] = {**sections["cluster"], "nodes": 1}
    estimated = run_cli("estimate", write("twin.toml", tomli_w.dumps(sections)), "--json").json
    assert estimated["peak_gpu_bytes"] == even["peak_gpu_bytes"]
    assert estimated["time"]["step_seconds"] == pytest.approx(even["time"]["step_seconds"], rel=1e-12)


def test_global_batch_from_the_job(write):
    job = write("job.toml", JOB.replace("seq_len = 8192", "seq_len = 8192\nglobal_batch_size = 32"))
    doc = run_cli("plan", job, "--nodes", "1", "--json").json
    for plan in doc["plans"]:
        p = plan["job"]["parallel"]
        assert p["dp"] * p["micro_batch_size"] * p["num_microbatches"] == 32


def test_table(job):
    result = run_cli("plan", job, *ARGS, "--top", "3")
    assert result.code == 0
    lines = result.out.splitlines()
    assert lines[0].startswith("llama-3-8b: plans for 8 GPUs")
    assert lines[1].split()[:5] == ["#", "dp", "tp", "pp", "cp"]
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "3"]
    assert "evaluated" in lines[5]


def test_table_styled_on_a_terminal_and_plain_without_rich(job, monkeypatch):
    """The table's lines (render/output.py `Line`) print as plain text without a terminal,
    never loading rich's text module (a tenth of the command), and in rich's styles on one."""
    code = ("import sys, io, contextlib\nfrom shardplan.cli.app import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['plan', {str(job)!r}, '--gpus', '8', '--global-batch', '64'])\n"
            "print([m for m in ('rich.text', 'rich.console') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    plain = run_cli("plan", job, *ARGS, "--top", "2")
    monkeypatch.setenv("FORCE_COLOR", "1")
    styled = run_cli("plan", job, *ARGS, "--top", "2")
    assert styled.code == plain.code == 0
    assert styled.out.startswith("\x1b[1m" + plain.out.splitlines()[0])  # the title in bold
    assert "\x1b[2mevaluated " in styled.out  # the search's line dim


def test_nothing_fits(write):
    job = write("job.toml", JOB.replace("llama-3-8b", "llama-3-70b") + "[offload]\nstrategy = \"conservative\"\n")
    result = run_cli("plan", job, "--gpus", "1", "--global-batch", "8")
    assert result.code == 1
    assert "no plan of 1 GPU fits" in result.err
    assert "closest:" in result.err
    assert "--gpus" in result.err  # what it would take
    doc = run_cli("plan", job, "--gpus", "1", "--global-batch", "8", "--json")
    assert doc.code == 1 and doc.json["plans"] == [] and doc.json["misses"]


def test_a_batch_no_plan_splits_names_one_that_does(job, write):
    """Llama-3 8B has 8 key/value heads, so on 64 GPUs with tp <= 8 every plan pipelines at
    least 8 stages over one data-parallel rank, or splits the batch over more than one: 7
    sequences split into no plan (1F1B needs at least pp microbatches). More GPUs would not
    help; the note names the nearest global batch that splits and fits, and that batch does,
    and, for a batch set for convergence, the most GPUs fewer than 64 on which 7 sequences
    split and fit (56: dp 7 x tp 8), and those do."""
    result = run_cli("plan", job, "--gpus", "64", "--global-batch", "7")
    assert result.code == 1, result.err
    assert "no plan of 64 GPUs splits a global batch of 7" in result.err
    assert "with a global batch of 8 (--global-batch 8) a plan fits" in result.err
    assert "with 56 GPUs (--gpus 56) a plan fits this global batch of 7" in result.err
    assert [int(n) for n in re.findall(r"--gpus (\d+)", result.err)] == [56]  # no more GPUs
    assert run_cli("plan", job, "--gpus", "64", "--global-batch", "8").code == 0
    assert run_cli("plan", job, "--gpus", "56", "--global-batch", "7").code == 0
    # At 4 sequences no count from 56 down to 40 splits them (dp divides 4, and a pipeline
    # needs as many microbatches as stages); 32 does (tp 8 x pp 4).
    four = run_cli("plan", job, "--gpus", "64", "--global-batch", "4")
    assert "with 32 GPUs (--gpus 32) a plan fits this global batch of 4" in four.err, four.err
    # Llama-3.1 405B (8 key/value heads too) without offload: 8 sequences split but do not
    # fit; more GPUs split them no better, and the note says so rather than "not even 4096".
    big = write("big.toml", JOB.replace("llama-3-8b", "llama-3.1-405b") + '[offload]\nstrategy = "conservative"\n')
    result = run_cli("plan", big, "--gpus", "64", "--global-batch", "7")
    assert result.code == 1, result.err
    assert "a global batch of 8 splits, but no plan of it fits" in result.err
    assert "more GPUs do not help: no plan of 128 to 4,096 GPUs splits a global batch of 8" in result.err


def test_more_gpus_names_the_fewest_between_the_doublings(job):
    """Llama-3 8B at seq 8192 on A100 40GB with ZeRO-2 and no offload: nothing fits 4 GPUs,
    8 do, and 6 too (tp 2 x pp 3: the layers and the 8 key/value heads allow it); the note
    names 6, and `plan --gpus 6` finds the plan it promised."""
    keys = ("--set", "cluster.preset=a100-40gb", "--zero", "2", "--set", "offload.strategy=conservative",
            "--global-batch", "64")
    result = run_cli("plan", job, "--gpus", "4", *keys)
    assert result.code == 1, result.err
    assert "with 6 GPUs (--gpus 6) a plan fits at this global batch" in result.err
    assert run_cli("plan", job, "--gpus", "6", *keys).code == 0
    assert run_cli("plan", job, "--gpus", "5", *keys).code == 1  # 5 is tried too: it fits nothing


# Llama-3.1 8B at 131,072 tokens, 8 sequences, on H100 80GB nodes of 8 (fsdp2, no job keys
# fixed): nothing fits 3, 5 or 7 GPUs; 4 and 8 do.
LONG = JOB.replace("llama-3-8b", "llama-3.1-8b").replace("seq_len = 8192", "seq_len = 131072")


@pytest.mark.parametrize("gpus, named", [(3, 4), (5, 8), (7, 8)])
def test_more_gpus_starts_at_a_count_machines_come_in(write, gpus, named):
    """A node with a GPU out (7) or a workstation of 3 or 5 cards: the note names the next
    count machines come in, which the search fits, not a doubling of the odd count (14, 10,
    6: 24, 16 and 8 were named), and the count it names fits."""
    job = write("job.toml", LONG)
    result = run_cli("plan", job, "--gpus", str(gpus), "--global-batch", "8")
    assert result.code == 1, result.err
    assert f"with {named} GPUs (--gpus {named}) a plan fits at this global batch" in result.err
    assert run_cli("plan", job, "--gpus", str(named), "--global-batch", "8", "--top", "1").code == 0


def test_regular_and_fewer_counts():
    """The counts the notes try: from an irregular count, the next whole node (or, within one
    node, power of two); from a regular one, twice it; fewer: the eight whole-node counts below,
    then halving; within one node, every count below."""
    from shardplan.io.plan_search import fewer_worlds, next_regular_world

    assert [next_regular_world(w, 8) for w in (1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 100)] == [
        2, 4, 4, 8, 8, 8, 16, 16, 32, 48, 104]
    assert next_regular_world(3, 4) == 4 and next_regular_world(6, 4) == 8
    assert fewer_worlds(64, 8) == [56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    assert fewer_worlds(24, 8) == [16, 8, 4, 2, 1]
    assert fewer_worlds(12, 8) == [8, 4, 2, 1]
    assert fewer_worlds(7, 8) == [6, 5, 4, 3, 2, 1]
    assert fewer_worlds(1, 8) == []
    assert fewer_worlds(2048, 8)[:9] == [2040, 2032, 2024, 2016, 2008, 2000, 1992, 1984, 992]


def test_between_counts_whole_nodes_past_one_node():
    from shardplan.io.plan_search import between

    assert between(4, 8, 8) == [5, 6, 7]  # within a node: single GPUs
    assert between(16, 32, 8) == [24]  # whole nodes of 8
    assert between(256, 512, 8) == [320, 384, 448]  # at most three
    assert between(8, 16, 8) == [] and between(1, 2, 8) == []


@pytest.mark.parametrize("extra,text,message", [
    (("--gpus", "8", "--nodes", "1", "--global-batch", "8"), JOB, "not both"),
    (("--global-batch", "8"), JOB, "how many GPUs"),
    (("--gpus", "8"), JOB, "how many sequences"),
    (("--gpus", "8", "--global-batch", "8"), '[model]\npreset = "llama-3-8b"\n[cluster]\ngpu_memory = "80GiB"\n',
     "needs the GPU"),
    (("--gpus", "8", "--global-batch", "8"), '[model]\npreset = "llama-3-8b"\n', "GPU memory"),
    (("--gpus", "8", "--global-batch", "8"), '[model]\nparams = 8000000000\n[cluster]\npreset = "h100-80gb"\n',
     "architecture"),
    (("--gpus", "0", "--global-batch", "8"), JOB, "--gpus"),
    (("--gpus", "8", "--global-batch", "8", "--top", "0"), JOB, "--top"),
    # Keys the job fixes that no plan of the GPUs or the batch can keep.
    (("--gpus", "1", "--global-batch", "8"), JOB + "[parallel]\ndp = 8\n", "parallel.dp = 8 (8 GPUs), which 1 GPU cannot"),
    (("--gpus", "8", "--global-batch", "8"), JOB + "[parallel]\ntp = 2\npp = 2\ndp = 1\ncp = 1\n", "which 8 GPUs"),
    (("--gpus", "8", "--global-batch", "12"), JOB + "[parallel]\nmicro_batch_size = 8\n", "does not divide"),
    # QLoRA of a model torchao cannot store as NF4: no plan `run` executes.
    (("--gpus", "4", "--global-batch", "8"), '[model]\npreset = "tiny-llama"\n[cluster]\npreset = "h100-80gb"\n'
     '[lora]\nrank = 8\nbase_dtype = "nf4"\n', "torchao"),
])
def test_bad_input(write, extra, text, message):
    job = write("job.toml", text)
    result = run_cli("plan", job, *extra)
    assert result.code == 2, result.err
    assert message in result.err
    assert "Traceback" not in result.err
    doc = run_cli("plan", job, *extra, "--json")
    assert doc.code == 2 and json.loads(doc.out)["error"]["exit_code"] == 2


MODELS = ["tiny-llama", "gpt2-medium", "llama-3-8b", "mixtral-8x7b", "qwen2.5-7b", "llama-2-13b"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(MODELS), gpus=st.sampled_from([1, 2, 4, 6, 8, 16]), batch=st.sampled_from([8, 12, 32]),
       seq=st.sampled_from([1024, 2048, 4096]), cluster=st.sampled_from(["a100-40gb", "a100-80gb", "h100-80gb"]),
       strategy=st.sampled_from(["balanced", "conservative"]),
       framework=st.sampled_from(["fsdp2", "deepspeed", "zero-paper"]))
def test_every_plan_is_its_written_jobs_estimate(tmp_path_factory, model, gpus, batch, seq, cluster, strategy,
                                                 framework):
    """Every plan the search returns, written as a job file, is estimated by `estimate` to the
    byte (peak GPU, host per node) and to the microsecond (step time), under each accounting."""
    assume(not (model.startswith("gpt2") and seq > 1024))  # learned positions: 1024
    folder = tmp_path_factory.mktemp("plans")
    job = folder / "job.toml"
    job.write_text(f'[model]\npreset = "{model}"\n[train]\nseq_len = {seq}\n[cluster]\npreset = "{cluster}"\n'
                   f'[offload]\nstrategy = "{strategy}"\n[zero]\nframework = "{framework}"\n')
    result = run_cli("plan", str(job), "--gpus", str(gpus), "--global-batch", str(batch), "--top", "3", "--json")
    assert result.code in (0, 1), result.err
    for index, plan in enumerate(result.json["plans"]):
        written = folder / f"plan{index}.toml"
        document = {"model": {"preset": model}, "train": {"seq_len": seq}, "cluster": {"preset": cluster},
                    "offload": {"strategy": strategy}, "zero": {"framework": framework}}
        for table, keys in plan["job"].items():
            document.setdefault(table, {}).update(keys)
        written.write_text(tomli_w.dumps(document))
        estimate = run_cli("estimate", str(written), "--json")
        assert estimate.code == 0, estimate.err
        doc = estimate.json
        assert (doc["peak_gpu_bytes"], doc["cpu_bytes_per_node"]) == (plan["peak_gpu_bytes"], plan["cpu_bytes_per_node"])
        assert doc["time"]["step_seconds"] == plan["time"]["step_seconds"]
        assert doc["fits"] is True


@pytest.mark.parametrize("enabled", [True, False])
def test_the_search_leaves_the_garbage_collector_as_it_found_it(enabled):
    """The search pauses Python's cyclic collector (io/plan_search.py `collector_paused`) and
    gives it back as it was, when the search raises too; what survived moved to the oldest
    generation, so no young collection has it to scan."""
    import gc

    from shardplan.io.plan_search import collector_paused

    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
            kept = [[] for _ in range(1000)]
        assert gc.isenabled() is enabled
        assert gc.get_count()[0] < 1000 and kept
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("the search failed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


FIXED_BATCH = "[parallel]\ndp = 8\nmicro_batch_size = 1\nnum_microbatches = 1\n"


@pytest.mark.parametrize("extra,text,message", [
    # Every factor of the batch fixed, to another product: said at once (it searched 64x
    # the batch's worth of batches before, and never ended on a large one).
    (("--gpus", "8", "--global-batch", "512"), JOB + FIXED_BATCH,
     "parallel.dp = 8 x parallel.micro_batch_size = 1 x parallel.num_microbatches = 1 (8 sequences per step), "
     "which is not the global batch of 512 sequences"),
    (("--gpus", "8", "--global-batch", str(2**31)), JOB + FIXED_BATCH, "(--global-batch 8)"),
    # The micro batch and the microbatches leave 3 data-parallel ranks, which 8 GPUs cannot hold.
    (("--gpus", "8", "--global-batch", "6"), JOB + "[parallel]\nmicro_batch_size = 1\nnum_microbatches = 2\n",
     "leaves 3 data-parallel ranks"),
    # A pipeline of 8 stages and 4 microbatches splits no batch.
    (("--gpus", "8", "--global-batch", "64"), JOB + "[parallel]\npp = 8\nnum_microbatches = 4\n",
     "a pipeline of 8 stages needs at least 8 microbatches"),
])
def test_fixed_keys_no_batch_can_keep(write, extra, text, message):
    test_bad_input(write, extra, text, message)


def test_fixed_keys_of_a_preset_and_another_batch():
    """The job preset fixes dp 8 x micro batch 1 x 1 microbatch: another batch is bad input at once."""
    result = run_cli("plan", "llama-3-8b-h100", "--global-batch", "65536")
    assert result.code == 2, result.err
    assert result.err_lines == [result.err_lines[0]] and "--global-batch 8" in result.err


def test_a_batch_that_splits_is_found_with_bounded_work(write, monkeypatch):
    """An interleaved pipeline of 8 stages fixed at 12 microbatches splits no batch: the note
    says so after arithmetic on each structure, not a search of 64 times the batch's batches."""
    import shardplan.io.plan_search as plan_search

    job = write("job.toml", JOB + '[parallel]\npp = 8\nnum_microbatches = 12\npipeline_schedule = "interleaved-1f1b"\n')
    calls = []
    real = plan_search.candidates
    monkeypatch.setattr(plan_search, "candidates", lambda *a: calls.append(a[1].global_batch) or real(*a))
    result = run_cli("plan", job, "--gpus", "8", "--global-batch", str(12 * 2**20))
    assert result.code == 1, result.err
    assert f"nor one up to {64 * 12 * 2**20}" in result.err
    assert len(calls) <= plan_search.SPLIT_TRIES


def test_what_it_would_take_stays_in_the_supported_world(write, monkeypatch):
    """Nothing fits: the worlds tried for more GPUs stop at the largest supported world
    (it tried 64 times the GPUs, past it, and failed with exit 2)."""
    import shardplan.io.plan_search as plan_search

    monkeypatch.setattr(plan_search, "MAX_WORLD_SIZE", 32, raising=False)
    worlds = []
    real = plan_search.search
    monkeypatch.setattr(plan_search, "search", lambda base, space, *a, **k: worlds.append(space.world) or
                        real(base, space, *a, **k))
    job = write("job.toml", JOB)
    result = run_cli("plan", job, "--gpus", "8", "--global-batch", "8", "--set", "cluster.gpu_memory=2GiB")
    assert result.code == 1, result.err
    assert max(worlds) == 32
    assert "not even 32 GPUs (the most that can be planned: 32 at most)" in result.err


@pytest.mark.parametrize("where", ["missing", "folder", "empty", "read-only"])
def test_write_path_checked_before_the_search(job, tmp_path, monkeypatch, where):
    """`--write` to a path that cannot be written: exit 2 in one line before the search, and
    with --json one document, the error."""
    import shardplan.io.plan_search as plan_search
    import shardplan.io.writing as writing

    target = {"missing": str(tmp_path / "no" / "best.toml"), "folder": str(tmp_path), "empty": "",
              "read-only": str(tmp_path / "best.toml")}[where]
    if where == "read-only":  # root writes anywhere: the check asks os.access
        monkeypatch.setattr(writing, "os", OsWith(access=lambda path, mode: False))
    monkeypatch.setattr(plan_search, "run_plan_search", lambda *a, **k: pytest.fail("searched"))
    result = run_cli("plan", job, *ARGS, "--write", target)
    assert result.code == 2, result.err
    assert len(result.err_lines) == 1 and result.err_lines[0].startswith("--write: ")
    doc = run_cli("plan", job, *ARGS, "--write", target, "--json")
    assert doc.code == 2 and json.loads(doc.out)["error"]["exit_code"] == 2


def test_write_failing_midway_keeps_the_old_file(job, tmp_path, monkeypatch):
    """A full disk during `--write`: exit 2 naming the flag and the file, the old file as it
    was, no temporary file left, and with --json one document."""
    import errno

    import shardplan.io.writing as writing

    out = tmp_path / "best.toml"
    out.write_text("old\n")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writing, "os", OsWith(write=full))
    for extra in ((), ("--json",)):
        result = run_cli("plan", job, *ARGS, "--write", str(out), *extra)
        assert result.code == 2, result.err
        assert result.err_lines == [f"--write: cannot write '{out}': No space left on device"]
        if extra:
            assert json.loads(result.out)["error"]["exit_code"] == 2
        assert out.read_text() == "old\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["best.toml", "job.toml"]


def test_fixed_schedule_keys_stay(write):
    """docs/plan.md: keys the job gives stay fixed. Virtual stages fix an interleaved schedule
    (core/checks.py: chunks per rank need one), a first-stage layer count an uneven split, and
    both keep pp > 1 (Llama-3 8B: 32 layers)."""
    job = write("job.toml", JOB)
    for setting, check in (
        ("parallel.virtual_stages=2", lambda p: p["pipeline_schedule"] == "interleaved-1f1b" and p["virtual_stages"] == 2),
        ("parallel.first_stage_layers=6", lambda p: p["pp"] > 1 and p["first_stage_layers"] == 6),
    ):
        doc = run_cli("plan", job, "--gpus", "16", "--global-batch", "64", "--top", "20", "--set", setting, "--json").json
        assert doc["plans"] and all(check(plan["job"]["parallel"]) for plan in doc["plans"]), setting


def test_a_fixed_zero_bubble_schedule_is_said_and_kept(write, tmp_path):
    """`run` refuses torch's zero-bubble schedule with more than one stage
    (runtime/capabilities.py), so under fsdp2 a job that fixes it gets plans of one stage; the
    note says why and what would plan zero-bubble pipelines (it said nothing), and the written
    job keeps the schedule as the job wrote it (it was dropped), with the plan's figures."""
    job = write("job.toml", JOB + '[parallel]\npipeline_schedule = "zero-bubble"\n')
    out = tmp_path / "best.toml"
    doc = run_cli("plan", job, "--gpus", "8", "--global-batch", "64", "--json", "--write", str(out)).json
    assert doc["plans"] and all(plan["job"]["parallel"]["pp"] == 1 for plan in doc["plans"])
    assert any(note.startswith("parallel.pipeline_schedule: `shardplan run` does not execute zero-bubble")
               for note in doc["notes"])
    written = tomllib.loads(out.read_text())
    assert written["parallel"]["pipeline_schedule"] == "zero-bubble"
    estimated = run_cli("estimate", str(out), "--json").json
    assert estimated["peak_gpu_bytes"] == doc["plans"][0]["peak_gpu_bytes"]
    assert estimated["time"] == doc["plans"][0]["time"]
    zero_paper = run_cli("plan", job, "--gpus", "8", "--global-batch", "64", "--framework", "zero-paper", "--json")
    assert not zero_paper.json["notes"]  # that space plans zero-bubble pipelines: nothing to say
    auto = run_cli("plan", job, "--gpus", "8", "--global-batch", "64", "--set", "parallel.pipeline_schedule=auto",
                   "--json", "--write", str(out)).json
    assert not any("zero-bubble" in note for note in auto["notes"])
    # "auto" is not written back: the key is the plan's, or absent for a plan of one stage.
    assert (tomllib.loads(out.read_text())["parallel"].get("pipeline_schedule")
            == auto["plans"][0]["job"]["parallel"].get("pipeline_schedule"))


def test_a_fixed_key_no_plan_keeps_is_named(write):
    """A fixed key outside the space (32 layers take no 3 virtual stages per rank of any
    pipeline; `run` executes no tensor parallel beyond Llama-3 8B's 8 key/value heads, nor ZeRO-1
    with tp, nor context parallel) is bad input naming it (exit 2), not a plan that does not fit
    (exit 1)."""
    job = write("job.toml", JOB)
    # A degree the search's own rules refuse says which rule (core/search.py `degree_refusal`).
    for flags, named, why in (
            # 17 chunks on each of at least 2 stages are more than Llama-3 8B's 32 layers.
            (("--set", "parallel.virtual_stages=17"), "parallel.virtual_stages = 17", ""),
            (("--tp", "16"), "parallel.tp = 16",
             ": `shardplan run` splits no key/value head over tensor-parallel ranks (16 > model.num_kv_heads, 8)"),
            (("--tp", "8", "--zero", "1"), "parallel.tp = 8, zero.stage = 1", ""),
            (("--cp", "2"), "parallel.cp = 2", ": `shardplan run` executes no context parallelism")):
        result = run_cli("plan", job, "--gpus", "16", "--global-batch", "64", *flags)
        assert result.code == 2 and len(result.err_lines) == 1, (flags, result.err)
        assert f"the job fixes {named}, which no plan of 16 GPUs keeps{why}" in result.err, result.err
        # At the flag that fixed the key when one key is to blame, as every bad input is.
        if "," not in named:
            assert result.err.startswith(f"{flags[0]}") and f": {named.split(' = ')[0]}: the job" in result.err
    deep = run_cli("plan", job, "--gpus", "64", "--global-batch", "64", "--pp", "64")
    assert deep.code == 2 and "which no plan of 64 GPUs keeps: 64 stages are more than the model's 32 layers" in deep.err
    # Written in the file: its file and line.
    written = write("vs.toml", JOB + "[parallel]\nvirtual_stages = 17\n")
    result = run_cli("plan", written, "--gpus", "16", "--global-batch", "64", "--json")
    assert result.code == 2 and result.json["error"]["problems"][0]["file"] == written
    assert result.json["error"]["problems"][0]["line"] == 9 and result.json["error"]["problems"][0]["path"] == \
        "parallel.virtual_stages"
    # Hybrid sharding inside 8-GPU nodes at tp 8 shards nothing: ZeRO-3 hybrid is ZeRO-0's twin, listed once.
    doc = run_cli("plan", job, "--gpus", "16", "--tp", "8", "--pp", "1", "--global-batch", "64", "--top", "20",
                  "--json").json
    assert not any(p["job"]["zero"]["hybrid"] for p in doc["plans"])


def test_global_batch_is_bounded_as_the_job_key_is(job):
    """`--global-batch` takes what `train.global_batch_size` takes (at most 2**31): a larger
    one is a typing mistake, and searching its divisors would take minutes."""
    assert run_cli("plan", job, "--gpus", "8", "--global-batch", str(2**32)).code == 2


def test_each_plan_says_what_it_offloads(write, tmp_path):
    """A plan the strategy offloads (Llama-3 8B full training on 2 GPUs of 40 GB, docs/plan.md)
    says in JSON what the estimate of its written job keeps on the CPU."""
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[train]\nseq_len = 4096\n'
                            '[cluster]\npreset = "a100-40gb"\ngpus_per_node = 2\n')
    out = tmp_path / "best.toml"
    doc = run_cli("plan", job, "--gpus", "2", "--global-batch", "8", "--json", "--write", str(out)).json
    assert doc["offloaded"] and doc["plans"]
    best = doc["plans"][0]["offload"]
    estimate = run_cli("estimate", str(out), "--json").json
    decided = estimate["assumptions"]["offload"]
    assert (best["params"], best["grads"], best["optimizer"]) == (decided["params"], decided["grads"],
                                                                   decided["optimizer"])
    assert best["optimizer"] and all(p["offload"]["params"] or p["offload"]["resident_layers"] is None
                                     for p in doc["plans"])


def test_misses_found_by_their_states_alone_say_at_least(write):
    """docs/plan.md's example: Llama-3 70B full training on 8 A100s without offload; every
    candidate's model states alone exceed the GPU's 79.15 GiB, so each miss is a lower bound
    and says so."""
    job = write("ft.toml", '[model]\npreset = "llama-3-70b"\n[train]\nseq_len = 4096\nglobal_batch_size = 64\n'
                           '[cluster]\npreset = "a100-80gb"\nnodes = 1\n[offload]\nstrategy = "conservative"\n')
    result = run_cli("plan", job, "--gpus", "8", "--json")
    assert result.code == 1
    misses = result.json["misses"]
    assert misses and all(m["at_least"] for m in misses)
    closest = [line for line in result.err_lines if line.startswith("plan: closest:")]
    assert closest and all(line.endswith("(the whole step by more)") for line in closest)
    # Each miss once, told apart by what it shows (two splits of one pipeline are two misses).
    keys = [json.dumps({k: v for k, v in m.items() if k != "short_bytes"}, sort_keys=True) for m in misses]
    assert len(keys) == len(set(keys))
    assert len(closest) == len(set(closest)) == min(3, len(misses))
    assert all(m["first_stage_layers"] is None or f"layers {m['first_stage_layers']}/" in " ".join(closest)
               for m in misses[:3])


def test_a_fixed_key_that_stops_every_plan_is_named_with_what_would_fit(write):
    """Llama 3.1 405B on 2,048 H100s at tp 8 x pp 8 (the Llama 3 paper's layout): with the
    job's selective recomputation nothing fits, with full recomputation a plan does; the notes
    say so, and the hybrid twins of the ZeRO-0 miss (node-local shard groups of one rank) are
    one miss."""
    job = write("p405.toml", '[model]\npreset = "llama-3.1-405b"\n[train]\nseq_len = 8192\nglobal_batch_size = 2048\n'
                             'activation_checkpointing = "selective"\n[cluster]\npreset = "h100-80gb"\n')
    result = run_cli("plan", job, "--nodes", "256", "--tp", "8", "--pp", "8")
    assert result.code == 1
    assert ('plan: with train.activation_checkpointing left to the search instead of "selective" (--set '
            'train.activation_checkpointing=auto) a plan fits 2,048 GPUs: train.activation_checkpointing = "full"'
            ) in result.err_lines
    freed = run_cli("plan", job, "--nodes", "256", "--tp", "8", "--pp", "8", "--set",
                    "train.activation_checkpointing=auto", "--top", "1", "--json")
    assert freed.code == 0 and freed.json["plans"][0]["job"]["train"]["activation_checkpointing"] == "full"
    assert any("with the job's keys as written" in line for line in result.err_lines)
    closest = [line for line in result.err_lines if line.startswith(("plan: closest:", "plan: another miss:"))]
    # One miss by the states alone (ZeRO 0); its hybrid ZeRO 2 and 3 twins were listed too.
    # It follows a miss timed whole, so it is not called the closest.
    alone = [line for line in closest if "alone" in line]
    assert len(alone) == 1 and alone[0].startswith("plan: another miss: dp 32 tp 8 pp 8 cp 1 ("), alone
    assert ", ZeRO 0, " in alone[0], alone


@pytest.mark.parametrize("args, where", [(("--nodes", "200000"), "--nodes"),
                                         (("--set", "cluster.nodes=200000"), "cluster.nodes")])
def test_nodes_past_the_largest_world_name_the_nodes(job, args, where):
    """200,000 nodes of the h100-80gb preset's 8 GPUs is 1.6M GPUs, past the largest world
    (spec/common.py MAX_WORLD_SIZE = 2**20): the message names the nodes given, not degrees."""
    result = run_cli("plan", job, *args, "--json")
    assert result.code == 2
    (problem,) = result.json["error"]["problems"]
    assert problem["path"] == where and "1,600,000 GPUs" in problem["message"]


def test_the_offload_column_counts_the_layers_of_the_parameters(write):
    """LoRA of Llama-3 70B (bf16 base) on one H100 fits only with offload: the column names
    the offloaded kinds and puts the count of layers where it belongs, on the parameters
    (the layers whose parameters live on the host; JSON `resident_layers` holds the rest)."""
    lora = write("lora.toml", JOB.replace("llama-3-8b", "llama-3-70b").replace(
        "seq_len = 8192", "seq_len = 2048\nglobal_batch_size = 16\nprecision = \"bf16-mixed\"")
        + '[lora]\nrank = 16\ntargets = ["q_proj", "k_proj", "v_proj", "o_proj"]\n')
    result = run_cli("plan", lora, "--gpus", "1", "--top", "1", "--json")
    assert result.code == 0, result.err
    offload = result.json["plans"][0]["offload"]
    assert offload["params"] and offload["resident_layers"]
    offloaded = 80 - max(offload["resident_layers"])
    table = run_cli("plan", lora, "--gpus", "1", "--top", "1")
    assert f"params ({offloaded} of 80 layers)" in table.out


FT_70B = JOB.replace("llama-3-8b", "llama-3-70b").replace("seq_len = 8192", "seq_len = 4096\nglobal_batch_size = 64").replace(
    'preset = "h100-80gb"', 'preset = "a100-80gb"\nnodes = 2')
# Llama-3 8B full training on one node of two RTX 4090s (24 GB): only offload fits, and the
# balanced strategy's first step (the optimizer states alone) pins more host memory than the
# plan it ends with (optimizer, gradients and most layers' parameters) holds.
ON_4090S = """
[model]
preset = "llama-3-8b"
[train]
seq_len = 4096
global_batch_size = 16
[cluster]
gpu = "rtx-4090"
gpus_per_node = 2
nodes = 1
"""


@pytest.mark.parametrize("text, ram, may_use", [(FT_70B, 512, "460.80 GiB"), (ON_4090S, 64, "56.00 GiB")])
def test_host_memory_that_stops_the_offload_is_named(write, text, ram, may_use):
    """Nothing fits because the host stops the offload: Llama-3 70B fine-tuning on 2 nodes of
    8 A100s with 512 GiB of RAM per node (docs/plan.md), whose offload may use 460.80 GiB; and
    Llama-3 8B on two RTX 4090s with 64 GiB. The note names the host memory per node the
    offload needs on its way to a plan and the `--set` that gives it; with that set `plan`
    finds one, and with a node 1 GiB smaller only a slower plan (the strategy offloads more
    layers to hold less on the host) or none."""
    job = write("ft.toml", text)
    result = run_cli("plan", job, "--set", f"cluster.cpu_memory_per_node={ram}GiB", "--json")
    assert result.code == 1
    notes = [n for n in result.json["notes"] if "of host memory per node for the offload" in n]
    assert len(notes) == 1 and f"(it may use {may_use} now)" in notes[0], result.json["notes"]
    keys = notes[0].split("--set ")[1:]
    assert [key.split("=")[0] for key in keys] == ["cluster.cpu_memory_per_node"], notes[0]
    node = int(keys[0].split("=")[1].removesuffix("GiB").strip())
    fits = run_cli("plan", job, "--set", f"cluster.cpu_memory_per_node={node}GiB", "--top", "1", "--json")
    assert fits.code == 0, fits.err
    short = run_cli("plan", job, "--set", f"cluster.cpu_memory_per_node={node - 1}GiB", "--top", "1", "--json")
    assert short.code == 1 or (short.json["plans"][0]["time"]["step_seconds"]
                               > fits.json["plans"][0]["time"]["step_seconds"]), short.json["plans"][0]


def test_deepspeed_plans_are_what_deepspeed_runs(job):
    """Under the `deepspeed` accounting the search keeps to what DeepSpeed's engine runs: no
    context parallel (its Ulysses sequence parallel is another algorithm), no Megatron-style
    sequence parallel, pipelines as its PipelineEngine runs them (TrainSchedule, a 1F1B;
    evenly split layers; ZeRO 0 or 1: deepspeed/runtime/pipe/engine.py refuses ZeRO-2/3).
    A key the job sets stays as set."""
    args = ("--framework", "deepspeed", "--gpus", "8", "--global-batch", "64", "--top", "20", "--json")
    plans = run_cli("plan", job, *args).json["plans"]
    assert len(plans) == 20
    for plan in plans:
        par, zero = plan["job"]["parallel"], plan["job"]["zero"]
        assert par["cp"] == 1 and par["sequence_parallel"] is False, par
        if par["pp"] > 1:
            assert par.get("pipeline_schedule", "1f1b") == "1f1b" and zero["stage"] <= 1, plan["job"]
            assert "first_stage_layers" not in par and "last_stage_layers" not in par, par
    fixed = run_cli("plan", job, *args[:-3], "--top", "3", "--set", "parallel.cp=2", "--json").json["plans"]
    assert fixed and all(plan["job"]["parallel"]["cp"] == 2 for plan in fixed)
    assert any(plan["job"]["parallel"]["pp"] > 1 for plan in plans)
    # the fsdp2 space of the same job has sequence-parallel plans among its fastest
    fsdp2 = run_cli("plan", job, "--gpus", "8", "--global-batch", "64", "--top", "20", "--json").json["plans"]
    assert any(plan["job"]["parallel"]["sequence_parallel"] for plan in fsdp2)


FULL_8BIT = """
[model]
preset = "llama-3-8b"
[train]
seq_len = 2048
precision = "bf16"
optimizer = "adamw8bit"
[cluster]
gpu = "h100-sxm"
gpus_per_node = 1
gpu_memory = "48GB"
"""


def test_no_plan_offloads_what_run_does_not_step(write):
    """A full fine-tune of Llama-3 8B with 8-bit AdamW on one 48 GB GPU fits only with offload,
    and the offload engine of `run` steps AdamW and SGD only (runtime/offload.py MOMENT_NAMES):
    the search rejects those plans by name instead of returning one that `run` then failed on,
    and the plan at 2 GPUs it names instead is one `run` takes."""
    job = write("full8bit.toml", FULL_8BIT)
    result = run_cli("plan", job, "--gpus", "1", "--global-batch", "16", "--json")
    assert result.code == 1
    assert "it would offload adamw8bit states, which the offload engine does not step" in result.err
    from shardplan.io.job import load_job
    from shardplan.runtime.capabilities import unsupported

    # `estimate` of such a plan fits, with the offload named as one `run` refuses; without the
    # strategy's offload it does not fit, and nothing is refused.
    plan = ("estimate", job, "--zero", "3", "--set", "parallel.num_microbatches=16")
    estimate = run_cli(*plan)
    assert estimate.code == 0 and ("warning: offload.strategy: `shardplan run` would refuse this offload: the "
                                   "balanced offload strategy offloads the parameters to fit") in estimate.err
    estimate = run_cli(*plan, "--set", "offload.strategy=conservative")
    assert estimate.code == 1 and "would refuse" not in estimate.err
    out = write("best.toml", "")
    found = run_cli("plan", job, "--gpus", "2", "--global-batch", "16", "--write", out)
    assert found.code == 0, found.err
    assert unsupported(load_job(out)) == []


@pytest.mark.parametrize("keys, refused", [
    (("--set", "train.precision=fp16-mixed"), "train.precision: `shardplan run` would refuse these plans: fp16-mixed"),
    (("--set", "lora.base_dtype=nf4", "--zero", "3", "--set", "offload.params=true"),
     "offload.params: `shardplan run` would refuse these plans: `run` does not offload NF4 weights to the CPU"),
])
def test_fixed_keys_run_refuses_are_named(job, keys, refused):
    """The space under fsdp2 is what `run` executes, except keys the job fixes: the plans are
    found and estimated all the same, and a line on stderr (and `notes` in --json) says that
    `run` would refuse them and why (runtime/capabilities.py)."""
    result = run_cli("plan", job, *ARGS, "--top", "1", *keys)
    assert result.code == 0, result.err
    assert f"plan: {refused}" in result.err
    document = run_cli("plan", job, *ARGS, "--top", "1", "--json", *keys).json
    assert any(note.startswith(refused) for note in document["notes"])
    assert "would refuse" not in run_cli("plan", job, *ARGS, "--top", "1").err


def test_a_miss_by_its_states_alone_is_not_called_closer(write):
    """Answer.AI's FSDP + QLoRA setting (Llama-2 70B, rank 64 on every linear, 2 GPUs of 24 GB;
    answer.ai "You can now train a 70b language model at home", 2024) at 512 tokens: the miss
    timed whole comes first as the closest, and a miss measured by its model states alone,
    whose whole step is over by more than its figure, follows as another miss, not as a
    second "closest" with a smaller number."""
    job = write("aai.toml", '[model]\npreset = "llama-2-70b"\n[train]\nseq_len = 512\nglobal_batch_size = 8\n'
                            '[lora]\nrank = 64\nalpha = 16\ntargets = ["q_proj", "k_proj", "v_proj", "o_proj", '
                            '"gate_proj", "up_proj", "down_proj"]\nbase_dtype = "nf4"\n[cluster]\ngpus_per_node = 2\n'
                            'gpu_memory = "24GB"\npeak_tflops = 142\nmemory_bandwidth = "936GB/s"\n'
                            'intra_node_bandwidth = "16GB/s"\nhost_bandwidth = "16GB/s"\ncpu_memory_per_node = "128GB"\n')
    result = run_cli("plan", job, "--gpus", "2")
    assert result.code == 1
    misses = [line for line in result.err_lines if line.startswith(("plan: closest:", "plan: another miss:"))]
    assert misses[0].startswith("plan: closest:") and "over the GPU memory" in misses[0], misses
    alone = [line for line in misses if "alone exceed" in line]
    assert alone and all(line.startswith("plan: another miss:") for line in alone), misses


def test_auto_leaves_a_preset_key_to_the_search():
    """A job preset's keys are fixed (llama-2-70b-3d writes zero.stage = 1, which no plan `run`
    executes keeps): the refusal names `--set zero.stage=auto`, which takes the key out of the
    job so the search chooses it, while the preset's other keys stay as written."""
    refused = run_cli("plan", "llama-2-70b-3d", "--top", "1")
    assert refused.code == 2 and "(--set zero.stage=auto)" in refused.err
    freed = run_cli("plan", "llama-2-70b-3d", "--set", "zero.stage=auto", "--top", "3", "--json")
    assert freed.code == 0, freed.err
    for plan in freed.json["plans"]:
        parallel = plan["job"]["parallel"]
        assert (parallel["dp"], parallel["tp"], parallel["pp"], parallel["micro_batch_size"]) == (2, 8, 4, 1)
        assert plan["job"]["zero"]["stage"] != 1


def test_tensor_parallel_across_nodes_is_said(write):
    """Llama-3 70B on 8 nodes of 2 A100s with tp 4 fixed: every plan's tensor-parallel groups
    span two nodes (ranks 0-3 on nodes 0 and 1, as `layout` warns), which the table says under
    the plans and the JSON as each plan's `warnings`; plans with tp 2 say nothing."""
    job = write("tpx.toml", '[model]\npreset = "llama-3-70b"\n[train]\nseq_len = 4096\nglobal_batch_size = 64\n'
                            '[cluster]\ngpu = "a100-sxm-80gb"\ngpus_per_node = 2\nnodes = 8\n')
    table = run_cli("plan", job, "--tp", "4", "--top", "2")
    assert table.code == 0, table.err
    assert "plans 1, 2: tensor-parallel groups span nodes (tp 4 on nodes of 2 GPUs)" in table.out
    assert "spans nodes 0 and 1" in run_cli("layout", job, "--tp", "4", "--dp", "4").err
    doc = run_cli("plan", job, "--tp", "4", "--top", "2", "--json").json
    assert all(plan["warnings"] and "tp 4 on nodes of 2 GPUs" in plan["warnings"][0] for plan in doc["plans"])
    within = run_cli("plan", job, "--tp", "2", "--top", "2", "--json").json
    assert within["plans"] and all(plan["warnings"] == [] for plan in within["plans"])


def test_nothing_fits_with_offload_written_and_no_strategy(write):
    """A conservative job that writes its own offload (the optimizer on the host) on one H100
    with 64 GiB of RAM: the host is what stops it, so the note names the host memory the
    written offload needs, and with it a plan fits."""
    job = write("cons.toml", '[model]\npreset = "llama-3-8b"\n[train]\nseq_len = 4096\nglobal_batch_size = 8\n'
                             '[cluster]\ngpu = "h100-sxm"\ngpus_per_node = 1\nnodes = 1\ncpu_memory_per_node = "64GiB"\n'
                             '[offload]\nstrategy = "conservative"\noptimizer = true\n')
    result = run_cli("plan", job, "--top", "1", "--json")
    assert result.code == 1, result.err
    notes = [n for n in result.json["notes"] if "of host memory per node for the offload" in n]
    assert len(notes) == 1, result.json["notes"]
    node = notes[0].split("--set cluster.cpu_memory_per_node=")[1].split()[0]
    assert run_cli("plan", job, "--set", f"cluster.cpu_memory_per_node={node}", "--top", "1").code == 0


def test_a_fixed_degree_the_model_refuses_is_named_before_the_world(write):
    """tp 3 on 8 GPUs: 3 divides no count of Llama-3 8B's 32 heads, so no number of GPUs plans
    it; the message names the head rule (core/search.py `model_refusal`), not "plan for a
    multiple of 3 GPUs", which `--gpus 24` would then refuse for the heads."""
    job = write("job.toml", JOB)
    for gpus in ("8", "24"):
        result = run_cli("plan", job, "--gpus", gpus, "--global-batch", "64", "--tp", "3")
        assert result.code == 2 and len(result.err_lines) == 1, result.err
        assert result.err.startswith("--tp 3: parallel.tp: the job fixes parallel.tp = 3, which no plan of "
                                     f"{gpus} GPUs keeps: 3 does not divide model.num_heads (32)"), result.err
        assert "multiple of" not in result.err


# Llama-2 70B QLoRA on two 24 GB GPUs as AnswerDotAI/fsdp_qlora's README runs it ("Finetune
# Llama-2 70B on Dual 24GB GPUs": --batch_size 2 --context_length 2048 --precision bf16
# --train_type qlora --use_gradient_checkpointing true --use_cpu_offload true), with train.py's
# defaults (commit 05ed9f2: lora_rank 64, lora_alpha 16, lora_target_modules "all" = k, q, v,
# up, down and gate projections, gradient_accumulation_steps 1, sharding_strategy full_shard,
# CPUOffload(offload_params=True)): global batch 2 x 2 GPUs = 4.
FSDP_QLORA_70B = """\
[model]
preset = "llama-2-70b"
[train]
seq_len = 2048
precision = "bf16"
activation_checkpointing = "full"
[lora]
rank = 64
alpha = 16
targets = ["k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"]
base_dtype = "nf4"
[cluster]
gpu = "rtx-4090"
gpus_per_node = 2
"""


def test_qlora_that_fits_only_with_nf4_weights_offloaded_is_named(write):
    """`run` does not offload NF4 weights, so its space holds no plan of the published run;
    nothing fits, and the search names the plan that fits with them offloaded, as the
    published run holds them: FSDP (ZeRO 3) over both GPUs, micro batch 2, no accumulation.
    The flags it gives make `estimate` show that plan, at the same step time, fitting, its
    parameters offloaded, with `run`'s refusal as a warning."""
    job = write("qlora70b.toml", FSDP_QLORA_70B)
    result = run_cli("plan", job, "--gpus", "2", "--global-batch", "4", "--json")
    assert result.code == 1, result.err
    (note,) = [n for n in result.json["notes"] if n.startswith("outside the plans `run` executes")]
    assert "a plan fits 2 GPUs: dp 2 tp 1 pp 1, ZeRO 3" in note, note
    flags = note.split("shows it with: ", 1)[1].split()
    assert flags == ["--set", "parallel.dp=2", "--set", "parallel.micro_batch_size=2", "--set", "zero.stage=3",
                     "--set", "train.activation_checkpointing=full", "--set", "train.global_batch_size=4"], flags
    seconds = float(note.split("ZeRO 3, ", 1)[1].split(" s per step")[0])
    estimate = run_cli("estimate", job, *flags, "--json")
    assert estimate.code == 0 and estimate.json["fits"], estimate.err
    assert round(estimate.json["time"]["step_seconds"], 1) == pytest.approx(seconds, rel=0.01)
    assert any(d.startswith("offload the parameters of ") for d in estimate.json["decisions"]), estimate.json
    assert "`run` does not offload NF4 weights" in estimate.err
    # A bf16 base, whose weights `run` offloads, fits in its space with them offloaded.
    bf16 = run_cli("plan", job, "--gpus", "2", "--global-batch", "4", "--set", "lora.base_dtype=bf16", "--json")
    assert bf16.code == 0 and bf16.json["offloaded"] and not bf16.json["notes"], bf16.out
