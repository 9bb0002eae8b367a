"""One-line summaries of a job."""

from __future__ import annotations

from ..spec.units import counted, format_count


def job_summary_line(file: str, summary: dict) -> str:
    """`job.toml: valid: llama-3-8b (8.03B params); world 16 = dp 2 x tp 4 x pp 2 x cp 1 on 2 nodes of 8`."""
    d = summary["degrees"]
    model = summary["model"] or "no model"
    adapters = f" + {format_count(summary['lora_params'])} LoRA" if summary.get("lora_params") else ""
    params = f" ({format_count(summary['params'])} params{adapters})" if summary["params"] else ""
    nodes = summary["nodes"]
    return (
        f"{file}: valid: {model}{params}; world {summary['world_size']} = dp {d['dp']} x tp {d['tp']} "
        f"x pp {d['pp']} x cp {d['cp']} on {counted(nodes, 'node')} "
        f"of {counted(summary['gpus_per_node'], 'GPU')}"
    )
