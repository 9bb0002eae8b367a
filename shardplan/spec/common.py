"""Shared pydantic pieces of the job file: strict tables, sizes, counts, bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from .units import MAX_BYTES, MAX_COUNT, parse_bandwidth, parse_count, parse_size

# The largest world any command accepts: 2^20 ranks is ~50x the largest training cluster
# announced to date; larger values are typing mistakes, not plans.
MAX_WORLD_SIZE = 2**20
# Bounds for shape values (layers, hidden size, vocabulary, sequence length): far above any
# published model, small enough that products of them stay meaningful.
MAX_DIM = 2**24


class Table(BaseModel):
    """A TOML table of the job file: unknown keys are errors, types are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False)


_SIZE_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "integer", "minimum": 0},
            {"type": "string", "pattern": r"^\s*[0-9.eE+-]+\s*([KkMmGgTtPp][Ii]?)?[Bb]?\s*$"},
        ],
        "description": "bytes: an integer, or a string such as '80GiB', '80GB', '512MiB'",
    }
)

Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0, le=MAX_BYTES), _SIZE_SCHEMA]

# A memory capacity (a GPU's, a node's) given as a bare number below this is a unit left out
# (`gpu_memory = 24` for 24 GiB): no GPU or host has less than a mebibyte.
_LEAST_CAPACITY = 2**20


def parse_capacity(value: object) -> int:
    """`parse_size`, refusing a bare number of bytes too small to be any device's memory."""
    size = parse_size(value)
    bare = isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())
    if bare and 0 < size < _LEAST_CAPACITY:
        raise ValueError(f"{size} is read as {size} bytes (a bare number is bytes), less than any device has: "
                         f"write '{size}GiB' if gibibytes were meant")
    return size


Capacity = Annotated[int, BeforeValidator(parse_capacity), Field(ge=0, le=MAX_BYTES), _SIZE_SCHEMA]

Count = Annotated[
    int,
    BeforeValidator(parse_count),
    Field(ge=0, le=MAX_COUNT),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": r"^\s*[0-9.eE+-]+\s*[KkMmBbTt]?\s*$"},
            ],
            "description": "a count: an integer, or a string such as '7.5B', '124M', '1T', '7.5e9'",
        }
    ),
]

Degree = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]

Bandwidth = Annotated[
    float,
    BeforeValidator(parse_bandwidth),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0},
                {"type": "string", "pattern": r"^\s*[0-9.eE+-]+\s*([KkMmGgTtPp][Ii]?)?([Bb]|bit)?\s*/\s*s\s*$"},
            ],
            "description": "bytes per second: a number, or a string such as '450GB/s' (10^9 bytes), '25GiB/s', or '400Gb/s' (bits)",
        }
    ),
]
