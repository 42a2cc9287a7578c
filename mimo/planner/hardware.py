"""Per-accelerator constants used by the analytical cost model.

Figures are public datasheet numbers (dense bf16, no sparsity) with a
conservative achievable fraction; calibration (see ``cost_model``) corrects
the remaining gap against measured layer timings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float          # dense bf16 FLOP/s
    efficiency: float          # achievable fraction of peak for large GEMMs
    memory_bandwidth: float    # HBM bytes/s
    intra_node_bandwidth: float  # per-GPU bytes/s inside a node (NVLink)
    inter_node_bandwidth: float  # per-GPU bytes/s across nodes (IB/RoCE)
    memory_bytes: float        # usable device memory
    gpus_per_node: int = 8
    reserved_bytes: float = 0.0  # context, allocator slack, workspaces
    # What the Megatron-faithful model (``megatron.py``) needs beyond the above:
    # achieved fraction of peak for large bf16 GEMMs (cuBLAS on H100 SXM reaches
    # 650-750 TFLOP/s on big square-ish shapes) and for fused attention
    # (FlashAttention forward ~50-60% of peak; its backward does 2.5x the FLOPs
    # at a lower rate: the FlashAttention-3 paper's H100 SXM5 figures for head
    # dim 128 at 8K-16K tokens give cuDNN 516-518 TFLOP/s backward against
    # 595-600 forward, FlashAttention-3 559-561 against 646-648, about 0.86x),
    # achieved NCCL bus bandwidth as a fraction of the link rate, and
    # per-message latency inside / across nodes.
    gemm_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    attention_backward_rate: float = 0.86
    link_efficiency: float = 0.8
    intra_node_latency: float = 8e-6
    inter_node_latency: float = 25e-6
    # Launch / tail cost of one small kernel: a transformer layer runs about
    # 20 kernels forward and 30 backward, which dominates tiny shards.
    kernel_overhead: float = 4e-6

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def bus_bandwidth(self, span_gpus: int) -> float:
        """Achieved collective bandwidth per GPU for a group spanning
        ``span_gpus`` consecutive ranks."""
        return self.link_bandwidth(span_gpus) * self.link_efficiency

    def latency(self, span_gpus: int) -> float:
        return self.intra_node_latency if span_gpus <= self.gpus_per_node else self.inter_node_latency

    def link_bandwidth(self, span_gpus: int) -> float:
        """Bandwidth of a collective/p2p whose participants span ``span_gpus``
        consecutive ranks: once it leaves a node the slow link dominates."""
        if span_gpus <= self.gpus_per_node:
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 989e12, 0.45, 3.35e12, 450e9, 50e9, 80 * GIB,
                    reserved_bytes=3 * GIB),
    "h200": GpuSpec("h200", 989e12, 0.45, 4.8e12, 450e9, 50e9, 141 * GIB,
                    reserved_bytes=3 * GIB),
    "a100": GpuSpec("a100", 312e12, 0.5, 2.0e12, 300e9, 25e9, 80 * GIB,
                    reserved_bytes=3 * GIB),
    # CPU "ranks" for tests and gloo runs: slow and uniform so that figures
    # stay easy to reason about; memory is host RAM shared by the ranks.
    "cpu": GpuSpec("cpu", 2e11, 0.5, 5e10, 1e10, 1e9, 64 * GIB),
}


def get_gpu(name) -> GpuSpec:
    """The spec named `name`; a GpuSpec itself (e.g. from a measured profile, `planner.profile`) as is."""
    if isinstance(name, GpuSpec):
        return name
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu type {name!r} (known: {', '.join(sorted(GPUS))})")
    return GPUS[key]


def gpu_kind(device_name: str) -> Optional[str]:
    """The planner's spec for a device name ("cpu" for CPU ranks), or None when it has none. The kind
    must be a word of the name ("NVIDIA GH200 480GB" is not an H200), and a memory size the name
    gives must be the spec's ("NVIDIA A100-SXM4-40GB" is not the 80 GB spec): a layout planned for
    more memory than the GPU has runs out of it."""
    name = device_name.strip().lower()
    if name == "cpu":
        return "cpu"
    for kind, spec in GPUS.items():
        if kind != "cpu" and re.search(rf"(?<![a-z0-9]){kind}(?![0-9])", name):
            size = re.search(r"(\d+)\s*gb\b", name)
            if size and abs(int(size.group(1)) * GIB - spec.memory_bytes) > 0.1 * spec.memory_bytes:
                return None
            return kind
    return None
