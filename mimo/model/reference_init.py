"""Layout-independent initialisation: every layout loads its shards from one full state dict.

The full (TP = 1, PP = 1) module is built on the CPU from the module's seed;
each rank then copies the slice its stage and tensor-parallel rank own. Two
layouts of the same config therefore start from bit-identical weights, which
is what step-level parity between layouts needs. Costs one full copy of the
module in host memory per rank while initialising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
# megatron-core's SequentialMLP experts: `...mlp.experts.local_experts.<local index>.linear_fc1.weight`.
_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertShard:
    """Which experts of an MoE module a rank's part holds: global index of its first local expert
    (ep rank x experts per EP rank), its expert-TP rank and size, and the expert-TP group (for gathers)."""

    offset: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None


def expert_shard(lang, grid) -> Optional[ExpertShard]:
    """The ExpertShard of an MoE LLM's grid (`mimo.topology.ModuleGrid`) on this rank; None without experts."""
    if not getattr(lang, "is_moe", False) or not grid.is_member:
        return None
    lay, ec = grid.layout, grid.expert_coords
    return ExpertShard(offset=ec["ep"] * (lang.num_moe_experts // lay.ep), tp_rank=ec["etp"], tp_size=lay.etp,
                       tp_group=grid.groups.get("expt_tp"))


def is_expert(name: str) -> bool:
    """Whether parameter `name` belongs to a routed expert (sharded over EP and expert TP)."""
    return _EXPERT.search(name) is not None


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """`decoder.layers.1.x` of a stage whose first layer is global layer 4 -> `decoder.layers.5.x`;
    a routed expert's local index becomes its global one (`expert_offset` + local index)."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)
    if expert_offset:
        name = _EXPERT.sub(lambda m: f"{m.group(1)}local_experts.{int(m.group(2)) + expert_offset}.", name, count=1)
    return name


def tp_of(name: str, tp_rank: int, tp_size: int, experts: Optional[ExpertShard]):
    """(rank, size) of the TP split `name` is sliced by: expert TP for routed experts, else TP."""
    if experts is not None and is_expert(name):
        return experts.tp_rank, experts.tp_size
    return tp_rank, tp_size


TIED_OUTPUT, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def source_name(local_name: str, param: torch.nn.Parameter, layer_offset: int, expert_offset: int = 0) -> str:
    """The global name whose value initialises `param`: its own, except for a later pipeline stage's
    copy of a tied embedding (`mimo.model.stages.mark_tied_embedding`), which starts as the embedding."""
    if getattr(param, "tied_copy", False):
        return EMBEDDING
    return global_name(local_name, layer_offset, expert_offset)


def tp_slice(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's contiguous chunk along megatron's partition dim (or the whole tensor)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    stride = getattr(param, "partition_stride", 1)
    if stride != 1:
        # Strided (megatron's gated MLP, stride 2): a rank holds chunk r of each of the
        # `stride` parts of the full tensor, e.g. [gate_r; up_r].
        pieces = full.chunk(tp_size * stride, dim=param.partition_dim)
        return torch.cat(pieces[tp_rank::tp_size], dim=param.partition_dim)
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


def load_shard(module: torch.nn.Module, full_state: Dict[str, torch.Tensor], layer_offset: int, tp_rank: int,
               tp_size: int, experts: Optional[ExpertShard] = None) -> None:
    """Copy each parameter's slice of the full state into `module` (same names up to the layer offset
    and, for routed experts, the expert offset)."""
    for name, p in module.named_parameters():
        key = source_name(name, p, layer_offset, experts.offset if experts else 0)
        if key not in full_state:
            raise KeyError(f"reference state has no {key!r} (for stage parameter {name!r})")
        copy_shard(name, p, full_state[key], *tp_of(name, tp_rank, tp_size, experts))


def copy_shard(name: str, param: torch.nn.Parameter, full: torch.Tensor, tp_rank: int, tp_size: int) -> None:
    """Copy this TP rank's slice of the full value `full` into `param` (cast to its dtype)."""
    piece = tp_slice(full, param, tp_rank, tp_size)
    if piece.shape != param.shape:
        raise ValueError(f"{name}: shard shape {tuple(piece.shape)} != parameter shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(piece)


def full_shape(param: torch.nn.Parameter, tp_size: int) -> torch.Size:
    """The unsharded shape of a (possibly TP-split) parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
    return torch.Size(shape)
