"""Fault injection for recovery drills: rehearse a crash or a hang before a long job does it.

`SHARDPLAN_INJECT_FAULT="<what>:<where>=<step>[:rank=<r>]"`, e.g.

    kill:step=5:rank=1          rank 1 dies (SIGKILL) at the start of step 5
    kill:checkpoint=4           rank 0 dies while writing the checkpoint of step 4, after its
                                shards are written and before the checkpoint is committed
    hang:step=3:rank=1          rank 1 stops answering at step 3 (the others time out)

A drill fires in the first attempt only: workers that torchrun restarts
(TORCHELASTIC_RESTART_COUNT > 0) do not meet it again. Documented in docs/recovery.md.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..spec.errors import InputError, Problem

ENV = "SHARDPLAN_INJECT_FAULT"
KINDS = ("kill", "hang")
PLACES = ("step", "checkpoint")


@dataclass(frozen=True)
class Fault:
    kind: str
    place: str
    step: int
    rank: int = 0


def parse(text: str) -> Fault:
    parts = text.strip().split(":")
    try:
        kind, place_step, *rest = parts
        place, step = place_step.split("=")
        rank = 0
        for item in rest:
            key, value = item.split("=")
            if key != "rank":
                raise ValueError(key)
            rank = int(value)
        fault = Fault(kind, place, int(step), rank)
    except ValueError:
        fault = None
    if fault is None or fault.kind not in KINDS or fault.place not in PLACES or fault.step < 1 or fault.rank < 0:
        raise InputError(Problem(ENV, f"{text!r} is not of the form kill|hang:step|checkpoint=N[:rank=R]"))
    return fault


def configured() -> Fault | None:
    text = os.environ.get(ENV, "")
    return parse(text) if text else None


def maybe(place: str, step: int, rank: int) -> None:
    """Fire the configured fault if this is its place, step and rank (at most once)."""
    fault = configured()
    if fault is None or fault.place != place or fault.step != step or fault.rank != rank:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: never return; the others' collectives time out
        time.sleep(3600)
