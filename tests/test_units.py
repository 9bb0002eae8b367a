"""Size strings and parameter counts (CONTRACT, "Units and conventions")."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardplan.spec.units import format_bytes, format_count, parse_count, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TiB", 3 * 2**39),
        ("2TiB", 2 * 2**40),
        ("1 KiB", 1024),
        ("4096", 4096),
        ("10B", 10),
        (4096, 4096),
        (0, 0),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7.5B", 7_500_000_000),
        ("124M", 124_000_000),
        ("1T", 10**12),
        ("7.5e9", 7_500_000_000),
        ("1.5K", 1500),
        (7_000_000, 7_000_000),
        (7.5e9, 7_500_000_000),
    ],
)
def test_counts(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("bad", ["80GX", "-1GiB", "GiB", "", "1e400GiB", True, 1.5, None, [1], "1..2GB"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["7.5Q", "-3", "B", "", "1e400", True, float("inf"), float("nan"), None, "7.5 B B"])
def test_bad_counts(bad):
    with pytest.raises(ValueError):
        parse_count(bad)


@given(st.integers(min_value=0, max_value=2**38), st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_size_units_scale_exactly(number, unit):
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    assert parse_size(f"{number}{unit}") == number * scale


def test_human_forms():
    assert format_bytes(80 * 2**30) == "80.00 GiB"
    assert format_bytes(512 * 2**20) == "512.0 MiB"
    assert format_bytes(12) == "12 B"
    assert format_count(8_030_261_248) == "8.03B"
    assert format_count(68_976_648_192) == "69.0B"
    assert format_count(124_439_808) == "124.4M"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("450GB/s", 450e9),  # NVLink 4: 900 GB/s bidirectional per H100 = 450 GB/s each way
        ("25GiB/s", 25 * 2**30),
        ("1.6TB/s", 1.6e12),
        ("50 GB/s", 50e9),
        ("400Gb/s", 50e9),  # NDR InfiniBand: 400 Gbit/s = 50 GB/s
        ("400Gbit/s", 50e9),
        (5e10, 5e10),
        (64, 64.0),
    ],
)
def test_bandwidths(text, expected):
    from shardplan.spec.units import parse_bandwidth

    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["100Gbps", "450GB", "-1GB/s", "0GB/s", "10XB/s", 0, True, "fast", "1e30GB/s"])
def test_bad_bandwidths(text):
    from shardplan.spec.units import parse_bandwidth

    with pytest.raises(ValueError):
        parse_bandwidth(text)
