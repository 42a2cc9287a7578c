"""Layout-independent initialisation: every layout loads its shards from one full state dict.

The full (TP = 1, PP = 1) module is built on the CPU from the module's seed;
each rank then copies the slice its stage and tensor-parallel rank own. Two
layouts of the same config therefore start from bit-identical weights, which
is what step-level parity between layouts needs. Costs one full copy of the
module in host memory per rank while initialising.
"""

from __future__ import annotations

import re
from typing import Dict

import torch

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_name(local_name: str, layer_offset: int) -> str:
    """`decoder.layers.1.x` of a stage whose first layer is global layer 4 -> `decoder.layers.5.x`."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)


TIED_OUTPUT, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def source_name(local_name: str, param: torch.nn.Parameter, layer_offset: int) -> str:
    """The global name whose value initialises `param`: its own, except for a later pipeline stage's
    copy of a tied embedding (`mimo.model.stages.mark_tied_embedding`), which starts as the embedding."""
    if getattr(param, "tied_copy", False):
        return EMBEDDING
    return global_name(local_name, layer_offset)


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
               tp_size: int) -> None:
    """Copy each parameter's slice of the full state into `module` (same names up to the layer offset)."""
    for name, p in module.named_parameters():
        key = source_name(name, p, layer_offset)
        if key not in full_state:
            raise KeyError(f"reference state has no {key!r} (for stage parameter {name!r})")
        copy_shard(name, p, full_state[key], tp_rank, tp_size)


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
