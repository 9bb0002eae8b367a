"""The job's `[cluster]` table -> the time model's `Hardware`, or None when it is unknown.

Hardware is known when the cluster names a GPU preset (`gpu`, which fills every figure from
presets/gpus/) or gives `peak_tflops` itself (CONTRACT). Keys written in `[cluster]` override
the preset's. Without a GPU preset, the figures not given are taken from
`FALLBACK_GPU`'s and listed in `Hardware.name` so the output says which were assumed.
"""

from __future__ import annotations

from functools import lru_cache

from ..core.hardware import Hardware
from ..spec.job import ClusterSpec, LoraSpec
from .files import read_document
from .presets import find_preset

FALLBACK_GPU = "h100-sxm"
TERA = 1e12

# [cluster] key -> Hardware field (bandwidths are already bytes/s after validation).
_FIGURES = {
    "memory_bandwidth": "memory_bandwidth",
    "intra_node_bandwidth": "intra_node_bandwidth",
    "inter_node_bandwidth": "inter_node_bandwidth",
    "host_bandwidth": "host_bandwidth",
    "host_memory_bandwidth": "host_memory_bandwidth",
}
_EFFICIENCIES = ("matmul_efficiency", "memory_efficiency", "intra_node_efficiency", "inter_node_efficiency")


@lru_cache(maxsize=16)
def _preset_cluster(name: str) -> ClusterSpec:
    data = read_document(find_preset(name, "gpus", "cluster.gpu").path).data.get("cluster", {})
    return ClusterSpec.model_validate(data)


def hardware_of(cluster: ClusterSpec) -> Hardware | None:
    """The time model's hardware for this cluster, or None when it is unknown."""
    if cluster.peak_tflops is None:
        return None
    fallback = _preset_cluster(FALLBACK_GPU)
    assumed = []

    def figure(key: str) -> float:
        value = getattr(cluster, key)
        if value is None:
            assumed.append(key)
            value = getattr(fallback, key)
        return float(value)

    peak = float(cluster.peak_tflops) * TERA
    fp32 = cluster.peak_fp32_tflops
    if fp32 is None:
        assumed.append("peak_fp32_tflops")
        fp32 = fallback.peak_fp32_tflops * cluster.peak_tflops / fallback.peak_tflops
    values = {field: figure(key) for key, field in _FIGURES.items()}
    efficiencies = {key: getattr(cluster, key) for key in _EFFICIENCIES if getattr(cluster, key) is not None}
    name = cluster.gpu or f"{cluster.peak_tflops:g} TFLOP/s GPU"
    if assumed and cluster.gpu is None:
        name += f" ({', '.join(assumed)} as {FALLBACK_GPU})"
    link = {"intra_node_link": cluster.intra_node_link} if cluster.intra_node_link else {}  # else NVLink
    return Hardware(name=name, peak_flops=peak, peak_fp32_flops=float(fp32) * TERA, **values, **efficiencies, **link)


def lora_of(lora: LoraSpec | None):
    """The time model's view of `[lora]`: adapter rank and target linears, or None."""
    if lora is None:
        return None
    from ..core.time_plan import LoraShape

    return LoraShape(rank=lora.rank, targets=tuple(lora.targets), nf4=lora.base_dtype == "nf4")
