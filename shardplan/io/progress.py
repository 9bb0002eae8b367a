"""Training progress from rank 0 to the process that started torchrun, through a file.

torchrun sends each worker's stderr to a log file, so rank 0 cannot draw on the user's
terminal. It appends one JSON object per line to the file that `SHARDPLAN_PROGRESS` names
(first `{"total", "completed"}`, then `{"step", "loss", "tokens_per_second"}` per step), and
the launcher, which owns the terminal, reads the new lines and draws the bar.
"""

from __future__ import annotations

import json
from pathlib import Path

PROGRESS_ENV = "SHARDPLAN_PROGRESS"


class ProgressFile:
    """Rank 0's end: a line per record, flushed at once so the launcher sees each step."""

    def __init__(self, path: str | Path, total: int, completed: int = 0):
        self.path = Path(path)
        self.file = None
        self.header = {"total": total, "completed": completed}

    def __enter__(self) -> ProgressFile:
        self.file = self.path.open("a", encoding="utf-8")
        self._write(self.header)  # a restarted worker starts a new header: the reader resets
        return self

    def __exit__(self, *exc) -> bool:
        if self.file is not None:
            self.file.close()
        return False

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def advance(self, step: int, loss: float, tokens_per_second: float) -> None:
        self._write({"step": step, "loss": loss, "tokens_per_second": tokens_per_second})


class ProgressReader:
    """The launcher's end: the records appended since the last call (a line still being
    written waits for the next call)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def poll(self) -> list[dict]:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:  # not ours: ignored rather than stopping the run
                continue
        return records
