"""Size strings (`80GiB`, `80GB`, `512MiB`) and parameter counts (`7.5B`, `124M`).

CONTRACT, "Units and conventions": sizes accept binary (2^10 steps) and decimal (10^3
steps) units or a plain integer of bytes; counts accept `K/M/B/T` suffixes (10^3..10^12),
scientific notation or integers. Both parse to exact integers (Decimal, never float).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, Overflow

# Larger than any memory or model that exists by orders of magnitude; a bound keeps absurd
# input (1e400, 10**30) from reaching arithmetic that would loop or print nonsense.
MAX_BYTES = 2**70
MAX_COUNT = 10**16

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}

_NUMBER = r"(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[A-Za-z]*)\s*$")
_COUNT_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[A-Za-z]?)\s*$")


# Values quoted in messages are cut to this many characters: a message stays one line.
MAX_QUOTED = 60


def cut(text: str) -> str:
    """`text` cut at MAX_QUOTED characters, the cut marked with `...`."""
    return text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED - 3] + "..."


def quoted(value: object) -> str:
    """`value` as a message quotes it: its repr, cut at MAX_QUOTED characters; an integer too
    long for Python to print (`sys.set_int_max_str_digits`) by its size."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"  # log10(2)
    return cut(text)


def _to_int(number: str, scale: int, what: str, text: str, limit: int) -> int:
    try:
        value = Decimal(number) * scale
    except InvalidOperation:  # pragma: no cover - the regex admits only numbers
        raise ValueError(f"not a {what}: {quoted(text)}") from None
    except Overflow:  # an exponent past what Decimal computes with (`1e999999999999`)
        value = Decimal("Infinity")
    if not value.is_finite() or value > limit:
        raise ValueError(f"{what} {quoted(text)} is absurdly large (limit {limit:.3g})")
    if value != value.to_integral_value():
        unit = "bytes" if what == "size" else "elements"
        exact = f"{value.normalize():f}"
        exact = f" ({exact})" if len(exact) <= MAX_QUOTED else ""
        raise ValueError(f"{what} {quoted(text)} is not a whole number of {unit}{exact}")
    return int(value)


def parse_size(value: object) -> int:
    """Bytes from `80GiB`, `80GB` (10^9), `512MiB`, `1.5TiB` or an integer of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '80GiB' or an integer of bytes, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative (got {quoted(value)})")
        if value > MAX_BYTES:
            raise ValueError(f"{quoted(value)} is absurdly large for a size (limit {MAX_BYTES:.3g})")
        return value
    if isinstance(value, float):
        raise ValueError(f"write sizes as an integer of bytes or with a unit ('80GiB'), got {quoted(value)}")
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '80GiB', got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if not match:
        if value.strip().startswith("-"):
            raise ValueError(f"a size cannot be negative (got {quoted(value)})")
        raise ValueError(f"not a size: {quoted(value)} (write e.g. '80GiB', '80GB', '512MiB' or bytes)")
    unit = match["unit"].lower()
    if unit not in _SIZE_UNITS:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ValueError(f"unknown size unit {quoted(match['unit'])} in {quoted(value)} (known: {known})")
    return _to_int(match["num"], _SIZE_UNITS[unit], "size", value, MAX_BYTES)


def parse_count(value: object) -> int:
    """A count from `7.5B`, `124M`, `1T`, `7.5e9` or an integer."""
    if isinstance(value, bool):
        raise ValueError("expected a count such as '7.5B' or an integer, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a count cannot be negative (got {quoted(value)})")
        if value > MAX_COUNT:
            raise ValueError(f"{quoted(value)} is absurdly large for a count (limit {MAX_COUNT:.3g})")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"not a count: {quoted(value)}")
        value = repr(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a count such as '7.5B', got {type(value).__name__}")
    match = _COUNT_RE.match(value)
    if not match:
        if value.strip().startswith("-"):
            raise ValueError(f"a count cannot be negative (got {quoted(value)})")
        raise ValueError(f"not a count: {quoted(value)} (write e.g. '7.5B', '124M', '1T' or '7.5e9')")
    unit = match["unit"].lower()
    if unit not in _COUNT_SUFFIXES:
        raise ValueError(f"unknown suffix {quoted(match['unit'])} in {quoted(value)} (known: K, M, B, T)")
    return _to_int(match["num"], _COUNT_SUFFIXES[unit], "count", value, MAX_COUNT)


_BANDWIDTH_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[A-Za-z]*)\s*/\s*s\s*$")
# Network links are quoted in bits (400 Gb/s NDR InfiniBand moves 50 GB/s): a lowercase `b`
# after a prefix, or `bit`, means bits.
_BIT_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# Far above any link that exists (NVLink 5 moves 900 GB/s per direction per GPU).
MAX_BANDWIDTH = 10**15


def parse_bandwidth(value: object) -> float:
    """Bytes per second from `450GB/s` (10^9), `25GiB/s` (2^30), `1.6TB/s`, or a plain number
    of bytes per second (CONTRACT: "Bandwidths accept GB/s and GiB/s")."""
    if isinstance(value, bool):
        raise ValueError("expected a bandwidth such as '450GB/s', got a boolean")
    if isinstance(value, int) and value > MAX_BANDWIDTH:  # before float(), which overflows
        raise ValueError(f"{quoted(value)} is absurdly large for a bandwidth (limit {MAX_BANDWIDTH:.3g} B/s)")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = _BANDWIDTH_RE.match(value)
        if not match:
            raise ValueError(f"not a bandwidth: {quoted(value)} (write e.g. '450GB/s', '25GiB/s' or bytes per second)")
        raw = match["unit"]
        bits = raw.lower().endswith("bit") or (len(raw) == 2 and raw[1] == "b")
        unit = raw.lower().removesuffix("it") if bits else raw.lower()
        if (bits and unit not in _BIT_UNITS) or (not bits and unit not in _SIZE_UNITS):
            raise ValueError(f"unknown unit {quoted(raw)} in {quoted(value)} (known: GB/s, GiB/s, MB/s, TB/s, "
                             "Gb/s for bits, or bytes per second)")
        scale = Decimal(_BIT_UNITS[unit]) / 8 if bits else _SIZE_UNITS[unit]
        try:
            number = float(Decimal(match["num"]) * scale)
        except Overflow:  # an exponent past what Decimal computes with
            number = float("inf")
    else:
        raise ValueError(f"expected a bandwidth such as '450GB/s', got {type(value).__name__}")
    if not number > 0 or number != number:
        raise ValueError(f"a bandwidth must be positive (got {quoted(value)})")
    if number > MAX_BANDWIDTH:
        raise ValueError(f"bandwidth {quoted(value)} is absurdly large (limit {MAX_BANDWIDTH:.3g} B/s)")
    return number


def format_bandwidth(bytes_per_second: float) -> str:
    """`450 GB/s`: decimal units, as vendors state link speeds."""
    for scale, unit in ((10**12, "TB/s"), (10**9, "GB/s"), (10**6, "MB/s")):
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:g} {unit}"
    return f"{bytes_per_second:g} B/s"


GIB = 2**30
MIB = 2**20


BYTE_UNITS = (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", 2**10))


def byte_unit(num_bytes: int | float) -> tuple[str, int]:
    """The largest binary unit the figure reaches at least once: (`GiB`, 2**30), or (`B`, 1)."""
    return next(((name, size) for name, size in BYTE_UNITS if abs(num_bytes) >= size), ("B", 1))


def format_bytes(num_bytes: int | float) -> str:
    """`79.2 GiB`, `512.0 MiB` or `12 B`: the human form of a byte figure."""
    sign = "-" if num_bytes < 0 else ""
    unit, size = byte_unit(num_bytes)
    if size == 1:
        return f"{sign}{int(abs(num_bytes))} B"
    decimals = 2 if size >= GIB else 1
    return f"{sign}{abs(num_bytes) / size:.{decimals}f} {unit}"


def format_count(count: int) -> str:
    """`8.03B`, `69.0B`, `124.4M`: the human form of a parameter count."""
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= scale:
            value = count / scale
            return f"{value:.2f}{suffix}" if value < 10 else f"{value:.1f}{suffix}"
    return str(count)


def counted(n: int, noun: str, digits: str = ",") -> str:
    """`n` and its noun, plural unless one ("1 GPU", "8 GPUs", "2 microbatches"); `digits`
    formats n (thousands separated by default, as every figure shardplan prints)."""
    plural = noun if n == 1 else noun + "es" if noun.endswith(("h", "s")) else noun + "s"
    return f"{n:{digits}} {plural}"
