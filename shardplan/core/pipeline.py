"""How transformer layers are cut into pipeline stages (the one rule estimate and run share)."""

from __future__ import annotations


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible: the first `num_layers % num_stages` stages hold
    one layer more (the same convention as `shards --style even`)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if stage < extra else base for stage in range(num_stages)]


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The layer indices of each stage, in order."""
    ranges, start = [], 0
    for count in split_layers(num_layers, num_stages):
        ranges.append(range(start, start + count))
        start += count
    return ranges


def describe_split(num_layers: int, num_stages: int) -> str:
    """`stage 0: layers 0-10 (11), stage 1: ...` for messages."""
    parts = []
    for stage, layers in enumerate(stage_layers(num_layers, num_stages)):
        parts.append(f"stage {stage}: layers {layers.start}-{layers.stop - 1} ({len(layers)})")
    return ", ".join(parts)
