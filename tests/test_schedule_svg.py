"""`shardplan schedule --svg`: a well-formed standalone SVG that a real browser draws.

The browser test renders the SVG with headless Chromium (Debian's `chromium` package) and
decodes the screenshot with the standard library: the picture must carry the forward,
backward and idle colours of the timeline. It is skipped where /usr/bin/chromium is absent.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

from conftest import run_cli
from shardplan.core.schedule import plan_schedule
from shardplan.render.schedule import IDLE_FILL, MAX_SVG_WIDTH, PALETTE, schedule_svg, svg_bands

SVG_NS = "{http://www.w3.org/2000/svg}"
CHROMIUM = "/usr/bin/chromium"


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                               ("zero-bubble", 1), ("round-robin", 3)])
def test_svg_is_well_formed_and_draws_every_action(schedule, virtual):
    plan = plan_schedule(schedule, 4, 8, virtual)
    root = ET.fromstring(schedule_svg(plan).encode("utf-8"))
    assert root.tag == f"{SVG_NS}svg"
    assert int(root.get("width")) > 0 and int(root.get("height")) > 0
    rects = root.findall(f"{SVG_NS}rect")
    actions = {r.find(f"{SVG_NS}title").text for r in rects if r.find(f"{SVG_NS}title") is not None}
    assert len(actions) == sum(len(order) for order in plan.orders)
    idle = [r for r in rects if r.get("fill") == IDLE_FILL and r.get("width") != "14"]
    assert len(idle) == plan.idle
    texts = "".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))
    assert f"bubble {float(plan.bubble):.1%}" in texts


@pytest.mark.parametrize("schedule, pp, microbatches, virtual", [
    ("1f1b", 8, 64, 1), ("gpipe", 4, 128, 1), ("interleaved-1f1b", 4, 32, 2), ("zero-bubble", 8, 48, 1),
])
def test_a_long_schedule_wraps_into_bands_one_screen_wide(schedule, pp, microbatches, virtual):
    plan = plan_schedule(schedule, pp, microbatches, virtual)
    root = ET.fromstring(schedule_svg(plan).encode("utf-8"))
    assert int(root.get("width")) <= MAX_SVG_WIDTH
    bands = sum(1 for t in root.iter(f"{SVG_NS}text") if t.text == "rank 0")
    assert bands > 1  # these would be 2,500-6,000 pixels wide in one band
    rects = root.findall(f"{SVG_NS}rect")
    idle = [r for r in rects if r.get("fill") == IDLE_FILL and r.get("width") != "14"]
    cell = int(idle[0].get("width"))
    drawn = [r for r in rects if r.find(f"{SVG_NS}title") is not None]
    # Every time unit of every rank drawn exactly once: busy units in action boxes (an action
    # across a band's end in two pieces), the rest idle.
    assert len(idle) == plan.idle
    assert sum(int(r.get("width")) for r in drawn) == cell * (plan.pp * plan.makespan - plan.idle)
    assert len({r.find(f"{SVG_NS}title").text for r in drawn}) == sum(len(order) for order in plan.orders)
    assert len(idle) + sum(int(r.get("width")) // cell for r in drawn) == plan.pp * plan.makespan


def test_bands_are_as_few_and_as_even_as_fit():
    assert svg_bands(30, 20, 60) == [(0, 30)]
    bands = svg_bands(213, 27, 65)  # 1f1b pp 8 x 64: (1400 - 65 - 16) // 27 = 48 units fit
    assert len(bands) == 5 and [stop - start for start, stop in bands] == [43, 43, 43, 43, 41]
    assert bands[0][0] == 0 and bands[-1][1] == 213


def test_svg_escapes_and_stays_standalone():
    text = schedule_svg(plan_schedule("1f1b", 2, 2))
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg"')
    assert "href" not in text and "<script" not in text  # nothing fetched, nothing run


# --- a real browser ----------------------------------------------------------------------

def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) with zlib only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


def _colours(png: bytes) -> set[tuple[int, int, int]]:
    width, bpp, rows = _png_pixels(png)
    return {tuple(row[x * bpp:x * bpp + 3]) for row in rows for x in range(width)}


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                    reason="needs Debian's chromium (apt-get install -y chromium)")
def test_chromium_draws_the_svg(tmp_path):
    svg = tmp_path / "schedule.svg"
    result = run_cli("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zero-bubble", "--svg", str(svg))
    assert result.code == 0, result.err
    png = tmp_path / "schedule.png"
    profile = tempfile.mkdtemp(dir=tmp_path)
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=1000,400", svg.as_uri()],
        capture_output=True, timeout=120, check=True,
    )
    colours = _colours(png.read_bytes())
    # The browser drew the timeline: forward, backward, weight-gradient and idle fills.
    for fill in (PALETTE["F"][0], PALETTE["B"][0], PALETTE["W"][0], IDLE_FILL):
        assert _rgb(fill) in colours, fill
    assert len(colours) >= 8
