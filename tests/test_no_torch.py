"""Planning never imports torch: every planning command runs with torch made unimportable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Every planning command, as a user would type it (extended as commands land).
PLANNING_COMMANDS = [
    ["validate", "llama-3-8b-h100"],
    ["presets"],
    ["presets", "mixtral-8x7b"],
    ["schema"],
    ["layout", "--dp", "2", "--tp", "4", "--pp", "2"],
    ["layout", "llama-2-70b-3d", "--rank", "9"],
    ["shards", "--numel", "1000", "--world", "3"],
    ["shards", "llama-3-8b-h100"],
    ["shards", "tiny-gpt2-cpu", "--assign", "round-robin"],
    ["shards", "--blocks", "10", "--assign", "contiguous", "--world", "4"],
    ["estimate", "llama-3-8b-h100"],
    ["estimate", "llama-2-70b-3d", "--explain"],
    ["estimate", "--set", "model.preset=llama-3-8b", "--dp", "64", "--zero", "3", "--framework", "deepspeed"],
    ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zero-bubble"],
    ["schedule", "llama-2-70b-3d", "--schedule", "interleaved-1f1b", "--virtual", "2"],
    *(["export", "llama-2-70b-3d", "--to", target] for target in ("deepspeed", "torchtitan", "accelerate", "megatron")),
    ["import", "tests/data/interop/ds_zero_infinity.json", "--dp", "8", "--set", "model.preset=gpt2-xl"],
    ["import", "tests/data/interop/torchtitan_llama3_8b.toml"],
    ["import", "tests/data/interop/accelerate_fsdp2.yaml", "--set", "model.preset=llama-3-8b"],
]


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory):
    blocker = tmp_path_factory.mktemp("blocked") / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), str(ROOT)])
    env.pop("WORLD_SIZE", None)
    return env


@pytest.mark.parametrize("args", PLANNING_COMMANDS, ids=lambda a: " ".join(a))
def test_runs_without_torch(args, blocked_env):
    proc = subprocess.run(
        [sys.executable, "-m", "shardplan", *args, "--json"],
        capture_output=True, text=True, env=blocked_env, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "blocked" not in proc.stderr


def test_importing_the_cli_does_not_import_torch(blocked_env):
    # Every command registered (as `--help` and shell completion build them), run's included.
    code = ("import sys; from shardplan.cli.app import COMMANDS; from shardplan.cli.root import build_app; "
            "build_app(list(COMMANDS.values())); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=blocked_env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_starting_the_cli_does_not_import_yaml(blocked_env):
    """PyYAML is read only by `export --to accelerate` and `import`."""
    code = ("import sys; from shardplan.cli.app import COMMANDS; from shardplan.cli.root import build_app; "
            "build_app(list(COMMANDS.values())); assert 'yaml' not in sys.modules, 'yaml imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=blocked_env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("missing", ["torch", "numpy"])
def test_run_without_its_extra_says_what_to_install(missing, monkeypatch):
    # torch.distributed's object collectives call Tensor.numpy(); without numpy a run would
    # fail at its first checkpoint, so the parent refuses before starting any worker.
    import importlib.util

    from conftest import run_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    result = run_cli("run", "tiny-gpt2-cpu")
    assert result.code == 2, result.err
    assert f"`shardplan run` needs {missing}" in result.err
    assert "pip install" in result.err and "Traceback" not in result.err


def test_the_install_hint_fits_the_installation(monkeypatch, tmp_path):
    # From a clone (this checkout: an editable install) pip needs the folder; from a wheel,
    # the extra's name. Both name PyTorch's CPU-only index for machines without a GPU.
    from shardplan.cli import run_cmd

    hint = run_cmd.install_hint()
    assert hint.startswith(f"pip install -e '{ROOT}[run]'"), hint
    assert "--index-url https://download.pytorch.org/whl/cpu" in hint
    monkeypatch.setattr(run_cmd, "source_checkout", lambda: None)
    assert run_cmd.install_hint().startswith("pip install 'shardplan[run]'")
