"""The host-state codec's int8 quantisation against torchao's own function: the same codes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from shardplan.runtime.offload_codec import _qmap, _torchao, quantize_with_qmap  # noqa: E402


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_equal_torchaos(signed):
    """Every code equals torchao's `quantize_8bit_with_qmap` (torchao/optim/quant_utils.py) on
    random values of the map's range and on the map's own entries, the midpoints between them
    and the floats next to those midpoints, where rounding decides."""
    qmap = _qmap(signed)
    low = -1.0 if signed else 0.0
    middles = (qmap[1:] + qmap[:-1]) / 2
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([
        torch.rand(200_000, generator=generator) * (1.0 - low) + low,
        qmap, middles,
        torch.nextafter(middles, torch.tensor(2.0)), torch.nextafter(middles, torch.tensor(-2.0)),
        torch.tensor([low, 1.0, 0.0]),
    ]).clamp(low, 1.0)
    expected = _torchao().quantize_8bit_with_qmap(values, qmap)
    assert torch.equal(quantize_with_qmap(values, qmap), expected)
