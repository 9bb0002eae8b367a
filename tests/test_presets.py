"""Shipped presets: each loads, validates, and survives a round trip through tomli-w."""

from __future__ import annotations

import sys

import pytest
import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import run_cli
from test_params import TRANSFORMERS_COUNTS
from shardplan.core.params import count_params
from shardplan.io.job import load_job
from shardplan.io.presets import list_presets
from shardplan.spec.job import JobSpec

PRESETS = list_presets()
# Model presets and the reference configuration each one reproduces.
PRESET_REFERENCE = {
    "gpt2": "gpt2", "gpt2-medium": "gpt2-medium", "gpt2-large": "gpt2-large", "gpt2-xl": "gpt2-xl",
    "llama-2-7b": "llama-2-7b", "llama-2-13b": "llama-2-13b", "llama-2-70b": "llama-2-70b",
    "llama-3-8b": "llama-3-8b", "llama-3-70b": "llama-3-70b", "llama-3.1-405b": "llama-3.1-405b",
    "llama-3.1-8b": "llama-3.1-8b", "llama-3.1-70b": "llama-3.1-70b",
    "mistral-7b": "mistral-7b-v0.1", "mixtral-8x7b": "mixtral-8x7b", "qwen2.5-7b": "qwen2.5-7b",
}


def test_the_promised_presets_ship():
    names = {(p.kind, p.name) for p in PRESETS}
    for model in PRESET_REFERENCE:
        assert ("models", model) in names
    for cluster in ("h100-80gb", "a100-80gb", "a100-40gb"):
        assert ("clusters", cluster) in names
    for gpu in ("h100-sxm", "h100-pcie", "h200", "b200", "a100-sxm-80gb", "a100-sxm-40gb", "v100-sxm2-32gb",
                "l40s", "mi300x", "rtx-4090", "rtx-3090", "rtx-a6000", "rtx-6000-ada", "a10g", "l4"):
        assert ("gpus", gpu) in names
    assert sum(1 for p in PRESETS if p.kind == "jobs") >= 3


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.kind}/{p.name}")
def test_preset_validates(preset):
    result = run_cli("validate", str(preset.path))
    assert result.code == 0, result.err
    assert preset.description


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.kind}/{p.name}")
def test_round_trip(preset, tmp_path):
    first = load_job(str(preset.path), env={})
    dumped = first.job.model_dump(mode="json", exclude_none=True)
    path = tmp_path / "again.toml"
    path.write_text(tomli_w.dumps(dumped), encoding="utf-8")
    second = load_job(str(path), env={})
    assert second.job == first.job
    assert second.shape == first.shape
    # The resolved shape written inline loads to the same shape, too.
    if first.shape is not None:
        inline = tmp_path / "inline.toml"
        inline.write_text(tomli_w.dumps({"model": first.shape.to_table()}), encoding="utf-8")
        assert load_job(str(inline), env={}).shape == first.shape
    assert JobSpec.model_validate(tomllib.loads(path.read_text())) == first.job


@pytest.mark.parametrize("name", sorted(PRESET_REFERENCE))
def test_model_presets_match_transformers(name):
    shape = load_job(None, [("model.preset", name)], env={}).shape
    total, embedding, active = TRANSFORMERS_COUNTS[PRESET_REFERENCE[name]]
    counts = count_params(shape)
    assert (counts.total, counts.embedding, counts.active) == (total, embedding, active or total)


def test_presets_command_lists_and_shows():
    listing = run_cli("presets", "--json")
    assert listing.code == 0
    rows = {row["name"]: row for row in listing.json["presets"]}
    llama, mixtral = TRANSFORMERS_COUNTS["llama-3-8b"], TRANSFORMERS_COUNTS["mixtral-8x7b"]  # test_params.py's sources
    assert rows["llama-3-8b"]["params"]["total"] == llama[0]
    assert rows["h100-80gb"]["kind"] == "cluster"
    shown = run_cli("presets", "mixtral-8x7b", "--json").json
    assert shown["params"] == dict(zip(("total", "embedding", "active"), mixtral))
    assert shown["table"]["model"]["num_experts"] == 8
    text = run_cli("presets", "llama-3-8b")
    assert f"{llama[0]:,}" in text.out and "num_kv_heads = 8" in text.out


def test_preset_table_has_validated_values():
    # Sizes are integers in bytes (CONTRACT units), not the file's strings like "4GiB".
    shown = run_cli("presets", "tiny-gpt2-cpu", "--json").json
    assert shown["table"]["cluster"]["gpu_memory"] == 4 * 2**30
    assert isinstance(shown["table"]["offload"]["cpu_memory_budget"], int)


def test_bare_command_prints_help_once():
    result = run_cli()
    assert result.code == 2
    assert (result.out + result.err).count("Usage") == 1


GPU_PRESETS = [p for p in PRESETS if p.kind == "gpus"]
# Datasheet figures (presets/gpus/*.toml name the sheet of each): dense 16-bit TFLOP/s and HBM.
DATASHEET = {"h100-sxm": (989.4, 3.35e12), "a100-sxm-80gb": (312.0, 2.039e12), "a100-sxm-40gb": (312.0, 1.555e12),
             "h200": (989.4, 4.8e12), "v100-sxm2-32gb": (125.0, 0.9e12), "mi300x": (1307.4, 5.3e12),
             # The cards fine-tuners use. Dense bf16 with fp32 accumulation, never the sparsity figure:
             # RTX 4090 165.2 (NVIDIA Ada whitepaper, Appendix A; 330.3 is fp16-accumulate), 1008 GB/s;
             # RTX 3090 71 (GA102 whitepaper, Appendix A; 142 is fp16-accumulate), 936 GB/s;
             # RTX A6000 154.8 (datasheet: 309.7 with sparsity), 768 GB/s; RTX 6000 Ada 364.2 (Ada
             # whitepaper, Appendix A), 960 GB/s (datasheet); L4 121 (datasheet: 242 with sparsity),
             # 300 GB/s; A10G 70.0 (no NVIDIA datasheet: presets/gpus/a10g.toml derives it), 600 GB/s.
             "rtx-4090": (165.2, 1.008e12), "rtx-3090": (71.0, 0.936e12), "rtx-a6000": (154.8, 0.768e12),
             "rtx-6000-ada": (364.2, 0.96e12), "l4": (121.0, 0.3e12), "a10g": (70.0, 0.6e12)}


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=lambda p: p.name)
def test_gpu_presets_give_every_figure_with_its_source(preset):
    from shardplan.io.hardware import hardware_of

    cluster = load_job(None, [("cluster.gpu", preset.name)], env={}).job.cluster
    hardware = hardware_of(cluster)
    assert hardware is not None and hardware.name == preset.name  # no figure assumed
    for line in preset.path.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.startswith("#"):
            assert "#" in line, f"{preset.name}: {line!r} has no source"
    if preset.name in DATASHEET:
        tflops, hbm = DATASHEET[preset.name]
        assert (hardware.peak_flops, hardware.memory_bandwidth) == (tflops * 1e12, hbm)


def test_cluster_presets_name_their_gpu():
    for preset in (p for p in PRESETS if p.kind == "clusters"):
        cluster = load_job(None, [("cluster.preset", preset.name)], env={}).job.cluster
        assert cluster.gpu in {p.name for p in GPU_PRESETS}
        assert cluster.peak_tflops is not None


def test_presets_command_lists_gpus():
    rows = {row["name"]: row for row in run_cli("presets", "--json").json["presets"]}
    assert rows["h100-sxm"]["kind"] == "gpu" and rows["h100-sxm"]["params"] is None
    shown = run_cli("presets", "h100-sxm", "--json").json
    assert shown["table"]["cluster"]["peak_tflops"] == DATASHEET["h100-sxm"][0]


def test_a_gpu_named_over_a_cluster_preset_brings_its_own_memory(write):
    """The cluster preset gives the node (GPUs per node, RAM); a GPU named beside it replaces
    the preset GPU's figures: the L40S gives a process 45,589 MiB (presets/gpus/l40s.toml), not
    the H100's 80 GB."""
    l40s = 45589 * 2**20
    job = write("job.toml", '[model]\npreset = "tiny-gpt2"\n[cluster]\npreset = "h100-80gb"\ngpu = "l40s"\n')
    doc = run_cli("estimate", job, "--json").json
    assert doc["gpu_memory"] == l40s
    flagged = run_cli("estimate", "llama-3-8b-h100", "--set", "cluster.gpu=l40s", "--json").json
    assert flagged["gpu_memory"] == l40s
    same = run_cli("estimate", "llama-3-8b-h100", "--set", "cluster.gpu=h100-sxm", "--json").json
    assert same["gpu_memory"] == 85017493504  # presets/clusters/h100-80gb.toml keeps its own
    written = write("w.toml", '[model]\npreset = "tiny-gpt2"\n[cluster]\npreset = "h100-80gb"\ngpu = "l40s"\n'
                              'gpu_memory = "40GB"\n')
    assert run_cli("estimate", written, "--json").json["gpu_memory"] == 40 * 10**9


# torch.cuda.get_device_properties().total_memory as published from runs of each card, in the
# whole MiB torch prints (its repr: total_memory=24563MB for an RTX 4090); the L4's was not
# found, so its datasheet's 24 GB (10^9 bytes) stands.
@pytest.mark.parametrize("name,memory_bytes", [("rtx-4090", 24563 * 2**20), ("rtx-3090", 24259 * 2**20),
                                               ("rtx-a6000", 48676 * 2**20), ("rtx-6000-ada", 48622 * 2**20),
                                               ("a10g", 22587 * 2**20), ("l4", 24 * 10**9)])
def test_fine_tuning_cards_are_listed_and_set_their_memory(name, memory_bytes):
    """`shardplan presets` lists the 24 / 48 GB cards, and naming one sets the GPU memory CUDA
    gives a process on it and a PCIe Gen4 x16 host link (32 GB/s each way: every one of these
    cards is PCIe 4.0 x16 by its datasheet / whitepaper)."""
    from shardplan.io.hardware import hardware_of

    rows = {row["name"]: row for row in run_cli("presets", "--json").json["presets"]}
    assert rows[name]["kind"] == "gpu"
    cluster = load_job(None, [("cluster.gpu", name)], env={}).job.cluster
    assert cluster.gpu_memory == memory_bytes
    assert hardware_of(cluster).host_bandwidth == 32e9
