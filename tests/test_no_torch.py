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
    code = "import sys, shardplan.cli.app; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=blocked_env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
