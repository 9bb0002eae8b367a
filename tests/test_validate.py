"""`shardplan validate`: the cross-field rules users hit, each reported with its arithmetic."""

from __future__ import annotations

import json

from conftest import run_cli

LLAMA3 = '[model]\npreset = "llama-3-8b"\n'


def errors(result):
    return [line for line in result.err_lines if ": warning: " not in line]


def warnings(result):
    return [line for line in result.err_lines if ": warning: " in line]


def test_valid_job_summary(write):
    path = write("job.toml", LLAMA3 + "[parallel]\ndp = 2\ntp = 4\npp = 2\nnum_microbatches = 4\n")
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert "valid: llama-3-8b (8.03B params); world 16 = dp 2 x tp 4 x pp 2 x cp 1 on 2 nodes of 8 GPUs" in result.out


def test_lora_summary_names_the_adapters_beside_the_base():
    """The summary's params are the base model's (transformers' count of Llama-3 70B,
    70,553,706,496: tests/test_params.py); a LoRA job adds its adapters, whose sum is
    estimate's parameters (70,760,800,256 for the shipped QLoRA preset, rank 16 on every layer
    linear, r x (in + out) each: 80 layers x 16 x (q 8192+8192, k 8192+1024, v 8192+1024,
    o 8192+8192, gate, up and down 3 x (8192+28672)) = 207,093,760, peft's count for those
    targets)."""
    result = run_cli("validate", "llama-3-70b-qlora")
    assert result.out.startswith("llama-3-70b-qlora: valid: llama-3-70b (70.6B params + 207.1M LoRA); ")
    summary = json.loads(run_cli("validate", "llama-3-70b-qlora", "--json").out)["files"][0]
    assert (summary["params"], summary["lora_params"]) == (70_553_706_496, 207_093_760)
    assert summary["params"] + summary["lora_params"] == 70_760_800_256  # `estimate`'s parameters


def test_a_rank_above_a_targets_smaller_side_warns(write):
    """A rank r adapter of a d_in x d_out weight holds r(d_in + d_out) parameters and its update
    B @ A has rank at most min(d_in, d_out) (Hu et al. 2021, LoRA, section 4.1): above that it is
    a larger full-rank update, most likely a typo. Llama-3 8B's k_proj and v_proj are 4096 x 1024
    (config.json num_key_value_heads 8 x head_dim 128): rank 2,000 is over them, 1,000 is not."""
    path = write("job.toml", LLAMA3 + '[lora]\nrank = 2000\ntargets = "all-linear"\n')
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert result.err_lines == [
        f"{path}:4: warning: lora.rank: 2,000 exceeds min(in, out) of k_proj (1,024), v_proj (1,024): such an adapter "
        "expresses no more than a full-rank update and holds more parameters than the weight it adapts (a typo?)"]
    assert run_cli("validate", path, "--set", "lora.rank=1000").err == ""


def test_every_problem_at_once_with_lines(write):
    text = LLAMA3 + (
        "[parallel]\n"          # line 3
        "dp = 2\n"
        "tp = 3\n"              # line 5
        "pp = 40\n"             # line 6
        "num_microbatches = 2\n"  # line 7
        "[offload]\n"           # line 8
        "params = true\n"       # line 9
    )
    path = write("job.toml", text)
    result = run_cli("validate", path, "--world", "16")
    assert result.code == 2
    lines = errors(result)
    expected = [
        f"{path}:3: parallel: dp(2) * tp(3) * pp(40) * cp(1) = 240 != world size 16 (from --world)",
        f"{path}:5: parallel.tp: 3 does not divide model.num_heads (32)",
        f"{path}:7: parallel.num_microbatches: 1f1b needs at least pp (40) microbatches to fill the pipeline (got 2)",
        f"{path}:6: parallel.pp: pp (40) exceeds model.num_layers (32): a stage needs a layer",
        f"{path}:9: offload.params: offloading parameters requires zero.stage = 3 (got 0)",
    ]
    for line in expected:
        assert line in lines, result.err


def test_world_arithmetic_hint(write):
    result = run_cli("validate", write("job.toml", "[parallel]\ntp = 4\n"), "--world", "16")
    assert "dp(1) * tp(4) * pp(1) * cp(1) = 4 != world size 16 (from --world); dp = 4 would fit" in result.err


QUESTION = '[model]\npreset = "llama-3-70b"\n[train]\nseq_len = 4096\nglobal_batch_size = 64\n[cluster]\npreset = "a100-80gb"\nnodes = 2\n'


def test_the_two_hints_of_a_question_file_agree(write):
    """A job that gives the model, the cluster and the global batch but no degrees: the world's
    hint (dp = 16) and the batch's (num_microbatches) are computed together, so following both
    gives a valid job; the world's also points to `plan`. With degrees written it does not."""
    job = write("question.toml", QUESTION)
    result = run_cli("validate", job)
    assert result.code == 2
    assert "dp = 16 would fit; or `shardplan plan` chooses the degrees" in result.err
    assert "num_microbatches = 4 would make it with dp = 16" in result.err
    assert run_cli("validate", job, "--dp", "16", "--set", "parallel.num_microbatches=4").code == 0
    given = run_cli("validate", job, "--dp", "8")
    assert "dp = 16 would fit" in given.err and "shardplan plan" not in given.err
    assert "num_microbatches = 4 would make it with dp = 16" in given.err


def test_world_from_cluster_and_env(write):
    path = write("job.toml", "[parallel]\ndp = 8\n[cluster]\nnodes = 2\ngpus_per_node = 8\n")
    result = run_cli("validate", path)
    assert "!= world size 16 (from cluster: 2 nodes * 8 GPUs)" in result.err
    result = run_cli("validate", write("j2.toml", "[parallel]\ndp = 8\n"), env={"WORLD_SIZE": "4"})
    assert "!= world size 4 (from WORLD_SIZE)" in result.err
    assert run_cli("validate", write("j3.toml", "[parallel]\ndp = 4\n"), env={"WORLD_SIZE": "4"}).code == 0


def test_world_past_the_largest_is_refused_where_given(write):
    """A world beyond spec/common.py MAX_WORLD_SIZE (2**20) is refused at the key that gave it,
    and no `dp = N would fit` hint offers a world no plan can have."""
    path = write("job.toml", "[parallel]\ndp = 8\n[cluster]\nnodes = 200000\ngpus_per_node = 8\n")
    result = run_cli("validate", path)
    assert result.code == 2
    assert (f"{path}:4: cluster.nodes: world size 1,600,000 (from cluster: 200,000 nodes * 8 GPUs) exceeds the "
            "largest supported world (1,048,576)") in errors(result)
    assert "would fit" not in result.err
    result = run_cli("validate", write("j2.toml", "[parallel]\ndp = 8\n"), env={"WORLD_SIZE": str(2**21)})
    assert result.code == 2 and "parallel: world size 2,097,152 (from WORLD_SIZE) exceeds" in result.err


def test_cluster_without_nodes_follows_the_degrees(write):
    path = write("job.toml", '[parallel]\ndp = 16\n[cluster]\npreset = "h100-80gb"\n')
    result = run_cli("validate", path, "--json")
    assert result.code == 0, result.err
    assert result.json["files"][0]["nodes"] == 2


def test_kv_heads(write):
    # Llama-3 8B: 32 query heads, 8 KV heads.
    ok = run_cli("validate", write("a.toml", LLAMA3), "--tp", "16", "--set", "parallel.sequence_parallel=false")
    assert ok.code == 0
    assert any("16 exceeds model.num_kv_heads (8): each key/value head must be replicated on 2 tp ranks" in w
               for w in warnings(ok))
    bad = run_cli("validate", write("b.toml", '[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 96\n'
                                    'num_heads = 12\nnum_kv_heads = 4\nffn_hidden_size = 64\nvocab_size = 10\n'), "--tp", "6")
    assert "--tp 6: parallel.tp: 6 exceeds model.num_kv_heads (4) and is not a multiple of it" in bad.err
    bad = run_cli("validate", write("c.toml", LLAMA3), "--tp", "32")
    assert "parallel.tp: 32 exceeds model.num_kv_heads (8)" in bad.err and bad.code == 0


def test_uneven_pipeline_split_is_shown(write):
    result = run_cli("validate", write("job.toml", LLAMA3 + "[parallel]\npp = 3\nnum_microbatches = 3\n"))
    assert result.code == 0
    assert ("32 layers split unevenly over 3 stages: stage 0: layers 0-10 (11), "
            "stage 1: layers 11-21 (11), stage 2: layers 22-31 (10)") in result.err


def test_interleaved_rules(write):
    base = LLAMA3 + '[parallel]\npp = 4\npipeline_schedule = "interleaved-1f1b"\n'
    result = run_cli("validate", write("a.toml", base + "virtual_stages = 3\nnum_microbatches = 9\n"))
    assert "interleaved-1f1b needs microbatches divisible by pp (4) or by its max(1, m // pp) = 2 rounds (got 9)" in result.err
    assert "needs model.num_layers (32) divisible by pp * virtual_stages (4 * 3 = 12)" in result.err
    ok = run_cli("validate", write("b.toml", base + "virtual_stages = 2\nnum_microbatches = 8\n"))
    assert ok.code == 0, ok.err
    # torch 2.13's ScheduleInterleaved1F1B also runs counts pp does not divide, in
    # max(1, m // pp) rounds that divide them: 6 (one round of 6), 3 (one round, fewer than pp), 10 (2 of 5).
    for m in (3, 6, 10):
        ok = run_cli("validate", write(f"m{m}.toml", base + f"virtual_stages = 2\nnum_microbatches = {m}\n"))
        assert ok.code == 0 and "error" not in ok.err, (m, ok.err)
    result = run_cli("validate", write("c.toml", LLAMA3 + "[parallel]\npp = 2\nvirtual_stages = 2\nnum_microbatches = 4\n"))
    assert "2 chunks per rank need pipeline_schedule interleaved-1f1b or round-robin (got 1f1b)" in result.err


def test_sequence_and_context_parallel(write):
    text = LLAMA3 + "[parallel]\ntp = 8\ncp = 3\nsequence_parallel = true\n[train]\nseq_len = 4000\n"
    result = run_cli("validate", write("a.toml", text))
    assert "train.seq_len: 4000 is not divisible by 2 * cp (6)" in result.err
    assert "seq_len / cp (1333) is not divisible by tp (8)" in result.err


def test_budgets_against_the_cluster(write):
    text = '[offload]\ngpu_param_budget = "90GiB"\ncpu_memory_budget = "2TiB"\n[cluster]\npreset = "a100-40gb"\n'
    result = run_cli("validate", write("a.toml", text))
    # The preset's GPU: 42,298,834,944 B, what CUDA gives a process on an A100 SXM 40GB
    # (deviceQuery, presets/gpus/a100-sxm-40gb.toml); its node: 1 TiB (DGX A100 320GB datasheet).
    assert f"offload.gpu_param_budget: 90.00 GiB exceeds cluster.gpu_memory ({42_298_834_944 / 2**30:.2f} GiB)" in result.err
    assert "offload.cpu_memory_budget: 2.00 TiB exceeds cluster.cpu_memory_per_node (1.00 TiB)" in result.err


def test_learned_positions_limit(write):
    result = run_cli("validate", write("a.toml", '[model]\npreset = "gpt2"\n[train]\nseq_len = 2048\n'))
    assert "train.seq_len: 2048 exceeds the model's 1024 learned positions" in result.err
    # An unwritten seq_len follows the model instead of failing.
    assert run_cli("validate", write("b.toml", '[model]\npreset = "gpt2"\n')).code == 0


def test_fsdp_names_and_framework_rules(write):
    ok = run_cli("validate", write("a.toml", '[parallel]\ndp = 16\n[zero]\nstage = "hybrid_shard"\n'), "--json")
    assert ok.code == 0
    bad = run_cli("validate", write("b.toml", LLAMA3 + '[parallel]\npp = 2\nnum_microbatches = 2\n'), "--zero", "3",
                  "--framework", "deepspeed")
    assert "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only" in bad.err
    bad = run_cli("validate", write("c.toml", '[zero]\nstage = 1\nhybrid = true\n'))
    assert "zero.hybrid: hybrid sharding needs zero.stage 2 or 3 (got 1)" in bad.err


def test_flags_override_the_file(write):
    path = write("job.toml", LLAMA3 + "[parallel]\ndp = 2\n")
    result = run_cli("validate", path, "--dp", "4", "--tp", "2", "--json")
    summary = result.json["files"][0]
    assert summary["degrees"] == {"dp": 4, "tp": 2, "pp": 1, "cp": 1}
    # --params replaces the file's model
    result = run_cli("validate", path, "--params", "7.5B", "--json")
    assert result.json["files"][0]["params"] == 7_500_000_000


def test_problems_of_set_values_name_the_flag(write):
    """A problem inside a value --set gave (an item of its list), or in a table --set created,
    is the flag's, not the file's; a list's type and length are said in words."""
    path = write("job.toml", LLAMA3 + '[lora]\nrank = 8\ntargets = ["q_proj"]\n')
    cases = [
        ("paralel.dp=2", "--set: paralel: unknown table (did you mean 'parallel'?)"),
        ('lora.targets=["q_proj", "bogus"]', "--set: lora.targets.1: must be one of 'q_proj', 'k_proj', 'v_proj', "
                                             "'o_proj', 'gate_proj', 'up_proj', 'down_proj' or 'all-linear' (got 'bogus')"),
        ("lora.targets=5", "--set: lora.targets: expected a list, got an integer 5"),
        ("lora.targets=[]", "--set: lora.targets: must hold at least 1 item (got [])"),
    ]
    for expression, message in cases:
        result = run_cli("validate", path, "--set", expression)
        assert result.code == 2 and errors(result) == [message], (expression, result.err)
    # A table the file writes (here as JSON, on one line) keeps its problems when --set
    # changes another key of it.
    doc = write("job.json", json.dumps({"model": {"preset": "llama-3-8b"}, "parallel": {"dp": 2},
                                        "cluster": {"preset": "h100-80gb", "nodes": 1}}))
    result = run_cli("validate", doc, "--set", "parallel.micro_batch_size=2")
    assert errors(result)[0].startswith(f"{doc}:1: parallel: dp(2) * tp(1) * pp(1) * cp(1) = 2 != world size 8")
    # The same item written in the file is the file's, at its line.
    bad = write("bad.toml", LLAMA3 + '[lora]\nrank = 8\ntargets = ["q_proj", "bogus"]\n')
    assert errors(run_cli("validate", bad))[0].startswith(f"{bad}:5: lora.targets.1: must be one of")


def test_many_unknown_keys_are_counted_after_the_first_twenty(write):
    """Each of the first 20 unknown keys is named with its hint; the rest are counted per
    table (a file of 30,000 took 5.6 s to hint one by one, and printed 30,000 lines)."""
    text = LLAMA3 + "[parallel]\n" + "".join(f"k{i} = 1\n" for i in range(30))
    path = write("job.toml", text)
    problems = run_cli("validate", path, "--json").json["files"][0]["problems"]
    assert len(problems) == 21
    assert problems[0]["path"] == "parallel.k0" and problems[0]["message"].startswith("unknown key (known: dp,")
    assert problems[-1] == {"file": path, "line": 3, "path": "parallel", "severity": "error",
                            "message": "and 10 more unknown keys"}
    top = write("top.toml", "".join(f"x{i} = 1\n" for i in range(21)) + LLAMA3)
    result = run_cli("validate", top)
    assert result.code == 2 and result.err_lines[-1] == f"{top}: and 1 more unknown key at the top level"


def test_json_document(write):
    good = write("good.toml", LLAMA3)
    bad = write("bad.toml", "[parallel]\ntp = 0\n")
    result = run_cli("validate", good, bad, "--json")
    assert result.code == 2
    doc = result.json
    assert doc["schema_version"] == 1 and doc["valid"] is False
    assert [f["valid"] for f in doc["files"]] == [True, False]
    problem = doc["files"][1]["problems"][0]
    assert problem == {"file": bad, "line": 2, "path": "parallel.tp", "severity": "error",
                       "message": "must be >= 1 (got 0)"}
    assert result.err_lines == [f"{bad}:2: parallel.tp: must be >= 1 (got 0)"]


def test_hf_config_relative_to_job_file(write, tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100, "_name_or_path": "toy"}
    write("models/config.json", json.dumps(config))
    path = write("jobs/job.toml", '[model]\nhf_config = "../models/config.json"\n')
    result = run_cli("validate", path, "--json")
    assert result.code == 0, result.err
    assert result.json["files"][0]["model"] == "toy"


def test_job_presets_by_name():
    result = run_cli("validate", "llama-3-8b-h100")
    assert result.code == 0 and "valid: llama-3-8b" in result.out


def test_degrees_that_miss_the_clusters_world_say_nothing_of_its_nodes(write):
    """A 2-node job left at dp 1 (docs/plan.md's finetune-70b.toml before `plan`) is told the
    world it misses, not that node 0 uses 1 of its 8 GPUs: those degrees place no rank."""
    path = write("job.toml", '[model]\npreset = "llama-3-70b"\n[cluster]\npreset = "a100-80gb"\nnodes = 2\n')
    result = run_cli("validate", path)
    assert result.code == 2 and "!= world size 16 (from cluster: 2 nodes * 8 GPUs)" in result.err
    assert "does not fill whole nodes" not in result.err


def test_sharding_over_context_parallel_ranks_is_not_called_empty(write):
    """FSDP shards over dp x cp (torchtitan's dp_shard_cp mesh; accelerate's
    examples/torch_native_parallelism/configs/cp.yaml runs cp 8 at dp_shard 1): stage 3 at dp 1
    and cp 8 shards over 8 ranks, so no "shards nothing" warning; at dp = cp = 1 it is given."""
    job = '[model]\npreset = "llama-3-8b"\n[train]\nseq_len = 8192\n[zero]\nstage = 3\n'
    result = run_cli("validate", write("cp.toml", job + "[parallel]\ncp = 8\n"))
    assert result.code == 0 and "shards nothing" not in result.err, result.err
    result = run_cli("validate", write("one.toml", job))
    assert "stage 3 with dp = 1 shards nothing" in result.err


def test_stage_3_at_dp_1_says_what_it_is_for(write):
    """`plan` writes stage 3 at dp 1 when its offload strategy keeps parameters on the CPU,
    which needs stage 3 (core/checks.py `sharding_problems`): the warning says so, and not
    under the conservative strategy, which offloads nothing itself."""
    job = '[model]\npreset = "llama-3-8b"\n[zero]\nstage = 3\n'
    result = run_cli("validate", write("one.toml", job))
    assert result.code == 0
    assert ("stage 3 with dp = 1 shards nothing; it lets the balanced offload strategy keep parameters on the "
            "CPU, which needs stage 3") in result.err
    result = run_cli("validate", write("cons.toml", job + '[offload]\nstrategy = "conservative"\n'))
    assert result.err_lines[-1].endswith("stage 3 with dp = 1 shards nothing"), result.err
