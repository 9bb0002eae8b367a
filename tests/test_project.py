"""Project hygiene: CI runs the README's test command."""

from __future__ import annotations

import re

from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^python3 -m venv .*pytest.*$", readme, flags=re.M)
    assert len(commands) == 1, "README must show exactly one test command"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[0] in ci.splitlines()


def test_readme_says_where_the_cpu_wheel_comes_from():
    # `pip install torch==2.13.0` gets the CPU build only where pip's indexes offer one; on
    # PyPI's Linux wheels it is the CUDA build. The README and `run`'s hint name PyTorch's
    # CPU-only index (one constant) and make no promise about the plain command.
    from shardplan.cli.run_cmd import CPU_WHEELS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"pip install torch==2.13.0 --index-url {CPU_WHEELS}" in readme
    assert "keeps pip on the CPU wheel" not in readme
    assert f"--index-url {CPU_WHEELS}" in (ROOT / "docs" / "run.md").read_text(encoding="utf-8")
