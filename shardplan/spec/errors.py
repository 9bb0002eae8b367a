"""Domain errors and the problem record every layer reports in.

A `Problem` is one line a user reads: where (file, line, dotted path) and what.
Exceptions carry the exit code the CLI maps them to (see CONTRACT: exit codes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

Severity = Literal["error", "warning", "note"]  # a note says how the input was read

EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 3


@dataclass(frozen=True)
class Problem:
    """One problem found in the user's input, at a dotted path such as `parallel.tp`."""

    path: str
    message: str
    severity: Severity = "error"
    file: str | None = None
    line: int | None = None
    # A rule across keys (dp * tp * pp * cp against the world): the dotted keys whose values it
    # checks, the first to change first. The loader places the problem at the flag that gave
    # one of them, if any did, else at `path` in the file (io/job.py `_locate`).
    keys: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def at(self, file: str | None, line: int | None = None) -> Problem:
        return replace(self, file=file, line=line)

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        kind = f"{self.severity}: " if self.severity != "error" else ""
        path = f"{self.path}: " if self.path else ""
        return f"{where}{kind}{path}{self.message}"

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "path": self.path,
            "severity": self.severity,
            "message": self.message,
        }


class ShardplanError(Exception):
    """Base of every error the CLI turns into a message and an exit code."""

    exit_code = EXIT_BAD_INPUT

    def lines(self) -> list[str]:
        return [str(self)]


class PlanError(ShardplanError, ValueError):
    """A user's plan is invalid (bad degrees, impossible combination): exit 2."""


class InputError(ShardplanError, ValueError):
    """Bad input, possibly several problems at once: exit 2."""

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class InfeasibleError(ShardplanError):
    """The input is valid but the plan cannot work (does not fit): exit 1."""

    exit_code = EXIT_INFEASIBLE


class RunFailure(ShardplanError):
    """A failure while executing a plan (`shardplan run`): exit 3."""

    exit_code = EXIT_RUNTIME
