"""A term of a memory estimate: bytes, what they are, and the formula with its numbers.

Formulas are built only when shown (`--explain`): a term may carry a callable instead of a
string, so the planner's inner loop does not format numbers nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

Formula = Union[str, Callable[[], str]]


@dataclass(frozen=True)
class Term:
    """One line of `--explain`: `label = formula = bytes`."""

    label: str
    bytes: int
    source: Formula = ""

    @property
    def formula(self) -> str:
        return self.source() if callable(self.source) else self.source

    def scaled(self, factor: int, why: str) -> Term:
        inner = self
        return Term(self.label, self.bytes * factor,
                    lambda: f"{why} * ({inner.formula})" if inner.formula else why)

