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
