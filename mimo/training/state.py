"""Full (unsharded) parameters and gradients, for parity checks and checkpoints."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist


def unshard(t: torch.Tensor, param: torch.nn.Parameter, tp_group) -> torch.Tensor:
    """Re-assemble a tensor-parallel shard along its partition dim (megatron's param attributes)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_group is None or dist.get_world_size(tp_group) == 1:
        return t.detach().clone()
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError("strided tensor-parallel partitions are not re-assembled")
    if getattr(param, "mimo_gated", False):
        # [gate_t; up_t] on each rank -> the full [gate; up].
        return torch.cat([_gather(h, tp_group, 0) for h in t.detach().chunk(2, dim=0)], dim=0)
    return _gather(t.detach(), tp_group, param.partition_dim)


def _gather(t: torch.Tensor, tp_group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def full_state(parts: Dict[str, torch.nn.Module], tp_groups: Dict[str, object], grads: bool = False,
               only_trainable: bool = False, layer_offsets: Optional[Dict[str, int]] = None) -> Dict[str, torch.Tensor]:
    """`module.param` -> full tensor (or its gradient), on every TP rank of the module.

    With pipeline stages, layer indices are made global with `layer_offsets`
    (module -> index of this stage's first layer); merging the dicts of all
    stages then gives the whole model.
    """
    from mimo.model.reference_init import global_name

    out = {}
    for module, m in parts.items():
        for name, p in m.named_parameters():
            if only_trainable and not p.requires_grad:
                continue
            t = p.grad if grads else p
            if t is None:
                continue
            key = global_name(name, (layer_offsets or {}).get(module, 0))
            out[f"{module}.{key}"] = unshard(t, p, tp_groups[module]).cpu()
    return out
