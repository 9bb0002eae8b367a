"""StepTime -> the estimate's time lines, its `--explain` terms, and the JSON `time` object."""

from __future__ import annotations

from rich.text import Text

from ..core.step_time import StepTime
from ..core.time_explain import seconds_text

LABELS = {
    "forward": "forward", "backward": "backward", "recompute": "recompute",
    "tensor_parallel": "tensor parallel", "context_parallel": "context parallel",
    "pipeline_p2p": "pipeline sends", "pipeline_bubble": "pipeline bubble",
    "data_parallel": "data parallel", "offload": "offload", "optimizer": "optimizer",
}


def _value(value: float, unit: str) -> str:
    if unit == "s":
        return seconds_text(value)
    if unit == "":
        return f"{value:.1%}"
    return f"{value:,.0f} {unit}"


def time_lines(timing: StepTime) -> list[Text]:
    """Two lines under the memory summary: the step and its rates, then where it goes."""
    head = (f"time per step {seconds_text(timing.step_seconds)} on {timing.hardware.name}: "
            f"{timing.tokens_per_second:,.0f} tokens/s ({timing.tokens_per_second_per_gpu:,.0f} per GPU), "
            f"MFU {timing.mfu:.1%}, HFU {timing.hfu:.1%}")
    shares = [f"{LABELS[k]} {v / timing.step_seconds:.0%}" for k, v in timing.breakdown.items()
              if v / timing.step_seconds >= 0.005]
    bottleneck = LABELS.get(timing.bottleneck, timing.bottleneck)
    return [Text(head, style="bold"), Text(f"  bottleneck {bottleneck}; " + ", ".join(shares), style="dim")]


def time_explain_lines(timing: StepTime) -> list[Text]:
    lines = [Text("time (one step):", style="bold")]
    for term in timing.explain():
        value = "" if term.label == "hardware" else f" = {_value(term.value, term.unit)}"
        lines.append(Text(f"  {term.label}: {term.formula}{value}"))
    return lines


def _hardware_document(timing: StepTime) -> dict:
    hw = timing.hardware
    return {
        "name": hw.name,
        "peak_tflops": hw.peak_flops / 1e12,
        "peak_fp32_tflops": hw.peak_fp32_flops / 1e12,  # MFU's peak under precision = "fp32"
        "memory_bandwidth": hw.memory_bandwidth,
        "intra_node_bandwidth": hw.intra_node_bandwidth,
        "inter_node_bandwidth": hw.inter_node_bandwidth,
        "host_bandwidth": hw.host_bandwidth,
        "host_memory_bandwidth": hw.host_memory_bandwidth,
        "efficiencies": {"matmul": hw.matmul_efficiency, "memory": hw.memory_efficiency,
                         "intra_node": hw.intra_node_efficiency, "inter_node": hw.inter_node_efficiency},
    }


def time_document(timing: StepTime, explain: bool) -> dict:
    """The contract's `time` object (seconds, tokens/s, fractions), plus the figures used."""
    doc = {
        "step_seconds": timing.step_seconds,
        "tokens_per_second": timing.tokens_per_second,
        "tokens_per_second_per_gpu": timing.tokens_per_second_per_gpu,
        "mfu": timing.mfu,
        "hfu": timing.hfu,
        "bottleneck": timing.bottleneck,
        "breakdown": dict(timing.breakdown),
        "tokens_per_step": timing.tokens_per_step,
        "model_flops_per_step": timing.model_flops_per_step,
        "hardware_flops_per_step": timing.hardware_flops_per_step,
        "hardware": _hardware_document(timing),
    }
    if explain:
        doc["terms"] = [{"label": t.label, "value": t.value, "unit": t.unit, "formula": t.formula}
                        for t in timing.explain()]
    return doc
