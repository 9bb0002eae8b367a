"""Shared test helpers: run the CLI in-process and capture its streams."""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardplan.cli.app import main

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def json(self) -> dict:
        return json.loads(self.out)

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def run_cli(*args: str, env: dict | None = None) -> Result:
    """Run `shardplan ARGS` in this process; WORLD_SIZE is cleared unless `env` sets it."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", *(env or {}))}
    os.environ.pop("WORLD_SIZE", None)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def write(tmp_path):
    """write("job.toml", text) -> path of a file in a fresh temporary folder."""

    def _write(name: str, text: str | bytes) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return str(path)

    return _write


class DataParallelUnit:
    """The part of Megatron's mpu DeepSpeedConfig reads: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def deepspeed_parse(monkeypatch):
    """DeepSpeed's own reading of a config: DeepSpeedConfig(config, dp) without a process group
    (rank 0 stood in for), on a copy of the config (it fills in what it reads)."""
    ds_config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is in the `interop` extra")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda group=None: 0)
    return lambda config, dp: ds_config.DeepSpeedConfig(json.loads(json.dumps(config)), mpu=DataParallelUnit(dp))


class OsWith:
    """The os module with some functions replaced, for io/writing.py alone."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)
