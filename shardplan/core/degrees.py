"""Parallel degrees, validated in the constructor, with errors that do the arithmetic.

Modelled on torchtitan's `ParallelDims`: "dp(2) * tp(4) * pp(2) = 16 != world size 12".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.common import MAX_WORLD_SIZE
from ..spec.errors import PlanError
from ..spec.model import cached_hash
from ..spec.names import AXES, parse_order


@dataclass(frozen=True)
class Degrees:
    """Data, tensor, pipeline and context parallel degrees; their product is the world."""

    __hash__ = cached_hash  # planner caches key on this frozen value

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{axis} must be a positive integer (got {value!r})")
        if self.world > MAX_WORLD_SIZE:
            raise PlanError(f"{self.arithmetic()} exceeds the largest supported world ({MAX_WORLD_SIZE})")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def of(self, axis: str) -> int:
        return getattr(self, axis)

    def arithmetic(self) -> str:
        """`dp(2) * tp(4) * pp(2) * cp(1) = 16`."""
        factors = " * ".join(f"{axis}({self.of(axis)})" for axis in ("dp", "tp", "pp", "cp"))
        return f"{factors} = {self.world}"

    def fitting_dp(self, world: int) -> int | None:
        """The data-parallel degree with which the other degrees fill `world`, or None."""
        rest = self.tp * self.pp * self.cp
        return world // rest if world % rest == 0 else None

    def world_mismatch(self, world: int, source: str) -> str | None:
        """The message for a world size the degrees do not multiply to, or None."""
        if world == self.world:
            return None
        dp = self.fitting_dp(world)
        hint = f"; dp = {dp} would fit" if dp is not None else ""
        return f"{self.arithmetic()} != world size {world} ({source}){hint}"


def full_order(order: str) -> tuple[str, ...]:
    """All four axes, fastest first: the order's axes, then the unnamed ones (degree 1)."""
    named = parse_order(order)
    return named + tuple(axis for axis in AXES if axis not in named)


def missing_axes(order: str, degrees: Degrees) -> list[str]:
    """Axes with degree > 1 that the order string leaves out."""
    named = parse_order(order)
    return [axis for axis in AXES if degrees.of(axis) > 1 and axis not in named]
