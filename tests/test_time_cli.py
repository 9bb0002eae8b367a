"""`shardplan estimate` with known hardware: the `time` JSON object (CONTRACT), the time lines
under the memory summary, `--explain`, and bad hardware input."""

from __future__ import annotations

import pytest

from conftest import run_cli

TIME_KEYS = {"step_seconds", "tokens_per_second", "tokens_per_second_per_gpu", "mfu", "hfu", "bottleneck", "breakdown"}
LLAMA = ["--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "3"]


def test_time_in_json_when_the_gpu_is_known():
    doc = run_cli("estimate", *LLAMA, "--set", "cluster.gpu=h100-sxm", "--json").json
    time = doc["time"]
    assert TIME_KEYS <= set(time)
    assert time["step_seconds"] == pytest.approx(sum(time["breakdown"].values()))
    assert time["tokens_per_second"] == pytest.approx(time["tokens_per_second_per_gpu"] * 8)
    assert 0 < time["mfu"] <= time["hfu"] < 1
    assert time["hardware"]["name"] == "h100-sxm"
    assert time["hardware"]["peak_tflops"] == 989.4  # presets/gpus/h100-sxm.toml (H100 datasheet)
    # The GPU preset also states the GPU's memory, so the fit is checked: what CUDA gives a
    # process on an H100 SXM 80GB, measured (presets/gpus/h100-sxm.toml; docs/validation.md).
    assert doc["fits"] is True and doc["gpu_memory"] == 85_017_493_504


def test_no_time_without_hardware():
    result = run_cli("estimate", *LLAMA, "--json")
    assert result.code == 0 and "time" not in result.json
    assert "time" not in result.err  # nothing said about it
    assert "time per step" not in run_cli("estimate", *LLAMA).out


def test_peak_alone_is_enough():
    doc = run_cli("estimate", *LLAMA, "--set", "cluster.peak_tflops=500", "--json").json
    assert doc["time"]["hardware"]["peak_tflops"] == 500
    assert "as h100-sxm" in doc["time"]["hardware"]["name"]  # the figures it assumed say so


def test_overrides_beat_the_preset():
    slow = run_cli("estimate", *LLAMA, "--set", "cluster.gpu=h100-sxm", "--set", "cluster.peak_tflops=100", "--json")
    fast = run_cli("estimate", *LLAMA, "--set", "cluster.gpu=h100-sxm", "--json")
    assert slow.json["time"]["step_seconds"] > 3 * fast.json["time"]["step_seconds"]
    tuned = run_cli("estimate", *LLAMA, "--set", "cluster.gpu=h100-sxm", "--set", "cluster.matmul_efficiency=0.5", "--json")
    assert tuned.json["time"]["hardware"]["efficiencies"]["matmul"] == 0.5
    assert tuned.json["time"]["step_seconds"] > fast.json["time"]["step_seconds"]


def test_cluster_presets_name_their_gpu():
    doc = run_cli("estimate", "llama-3-8b-h100", "--json").json
    assert doc["time"]["hardware"]["name"] == "h100-sxm"  # presets/clusters/h100-80gb.toml


def test_table_shows_the_time_lines():
    out = run_cli("estimate", "llama-3-8b-h100").out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("time per step"))
    assert "tokens/s" in lines[head] and "MFU" in lines[head] and "HFU" in lines[head]
    assert lines[head + 1].strip().startswith("bottleneck")
    assert lines.index("fits") < head  # under the memory summary


def test_explain_lists_every_term():
    result = run_cli("estimate", "llama-2-70b-3d", "--explain", "--json")
    terms = result.json["time"]["terms"]
    labels = [t["label"] for t in terms]
    for expected in ("layer: forward matmuls", "layer: tensor parallel, forward", "pipeline phase (simulated)",
                     "optimizer step (GPU)", "step", "MFU", "HFU"):
        assert expected in labels
    assert all(t["formula"] for t in terms)
    step = next(t for t in terms if t["label"] == "step")
    assert step["value"] == result.json["time"]["step_seconds"]
    text = run_cli("estimate", "llama-2-70b-3d", "--explain").out
    assert "time (one step):" in text and "pipeline bubble of rank" in text


@pytest.mark.parametrize("flags,message", [
    (["--set", "cluster.gpu=h100"], "cluster.gpu: no gpu preset named 'h100' (did you mean"),
    (["--set", "cluster.inter_node_bandwidth=-5"], "cluster.inter_node_bandwidth: a bandwidth must be positive"),
    (["--set", "cluster.peak_tflops=0"], "cluster.peak_tflops"),
    (["--set", "cluster.matmul_efficiency=1.5"], "cluster.matmul_efficiency"),
    (["--set", 'cluster.memory_bandwidth="fast"'], "cluster.memory_bandwidth: not a bandwidth"),
])
def test_bad_hardware_is_one_line_and_exit_2(flags, message):
    result = run_cli("estimate", *LLAMA, *flags)
    assert result.code == 2
    assert len(result.err_lines) == 1 and message in result.err_lines[0], result.err


def test_unknown_gpu_in_a_file_names_the_line(write):
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n\n[cluster]\ngpu = "a100-80gb"\n')
    result = run_cli("estimate", job)
    assert result.code == 2
    assert result.err_lines == [f"{job}:5: cluster.gpu: no gpu preset named 'a100-80gb' (did you mean 'a100-sxm-80gb'?)"]


@pytest.mark.parametrize("seconds, text", [
    (53.98, "54.0 s"), (3.8, "3.80 s"), (1.424, "1.42 s"), (1234.5, "1234 s"), (9.996, "10.0 s"),
    (0.0123, "12.3 ms"), (4.5e-5, "45.0 us"),
])
def test_seconds_keep_three_digits_without_an_exponent(seconds, text):
    # Three significant digits as the breakdown's other figures: "54 s" beside "43.6 s" read
    # as rounder than it is, and a step past 1000 s printed as "1.23e+03 s".
    from shardplan.core.time_explain import seconds_text

    assert seconds_text(seconds) == text
