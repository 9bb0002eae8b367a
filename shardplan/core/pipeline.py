"""How transformer layers are cut into pipeline stages (the one rule estimate and run share).

By default the layers are split as evenly as possible. Under 1F1B the first stage holds the
most microbatches and the last one the head and loss, so production runs give them fewer
layers: Megatron-LM's `--decoder-first-pipeline-num-layers` and
`--decoder-last-pipeline-num-layers` (megatron/core/transformer/transformer_block.py,
`get_num_layers_to_build`), Llama 3 405B one layer fewer on the first and the last of 16
stages (Dubey et al. 2024, section 3.3.2). `first` / `last` (0: not fixed) give those stages'
layers; the middle stages split the rest evenly.
"""

from __future__ import annotations


def split_layers(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Layers per stage. With `first`/`last` (0: not fixed) those stages get exactly that many
    and the others share the rest; the shared layers are split as evenly as possible, the
    earlier stages holding one layer more (the same convention as `shards --style even`)."""
    problem = split_problem(num_layers, num_stages, first, last)
    if problem:
        raise ValueError(problem)
    if num_stages == 1:
        return [num_layers]
    fixed = [first or None] + [None] * (num_stages - 2) + [last or None]
    free = [i for i, count in enumerate(fixed) if count is None]
    rest = num_layers - sum(count for count in fixed if count)
    base, extra = divmod(rest, len(free)) if free else (0, 0)
    counts = [count or 0 for count in fixed]
    for position, stage in enumerate(free):
        counts[stage] = base + 1 if position < extra else base
    return counts


def split_problem(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> str | None:
    """Why `num_layers` cannot be cut into `num_stages` stages with these fixed ends, or None."""
    if num_stages < 1 or num_layers < num_stages:
        return f"cannot split {num_layers} layers into {num_stages} stages"
    if (first or last) and num_stages == 1:
        return "first_stage_layers / last_stage_layers need more than one pipeline stage"
    fixed = (first > 0) + (last > 0)
    free = num_stages - fixed
    rest = num_layers - first - last
    if rest < free or (free == 0 and rest != 0):
        given = " + ".join(f"{name} {value}" for name, value in (("first", first), ("last", last)) if value)
        if free == 0:
            return f"{given} = {first + last} layers on the {num_stages} stages, but the model has {num_layers}"
        if rest < 0:
            return f"{given}: more layers than the model's {num_layers}"
        return (f"{given} leave {rest} of {num_layers} layers for the other {free} stages, "
                f"which need at least one each")
    return None


def stage_layers(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> list[range]:
    """The layer indices of each stage, in order."""
    ranges, start = [], 0
    for count in split_layers(num_layers, num_stages, first, last):
        ranges.append(range(start, start + count))
        start += count
    return ranges


SPLIT_SHOWN = 8  # stages whose layer counts `split_label` lists one by one


def split_label(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> str:
    """`layers 19/21/21/19` (or `layers 3/5-6/3` past SPLIT_SHOWN stages) for an uneven split;
    "" for the even one."""
    if not first and not last:
        return ""
    counts = split_layers(num_layers, num_stages, first, last)
    if len(counts) <= SPLIT_SHOWN:
        return "layers " + "/".join(map(str, counts))
    low, high = min(counts[1:-1]), max(counts[1:-1])
    return f"layers {counts[0]}/{low if low == high else f'{low}-{high}'}/{counts[-1]}"


def describe_split(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> str:
    """`stage 0: layers 0-10 (11), stage 1: ...` for messages."""
    parts = []
    for stage, layers in enumerate(stage_layers(num_layers, num_stages, first, last)):
        parts.append(f"stage {stage}: layers {layers.start}-{layers.stop - 1} ({len(layers)})")
    return ", ".join(parts)
