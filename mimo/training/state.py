"""Full (unsharded) parameters and gradients, for parity checks and checkpoints."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist


def unshard(t: torch.Tensor, param: torch.nn.Parameter, tp_group) -> torch.Tensor:
    """Re-assemble a tensor-parallel shard along its partition dim (megatron's param attributes)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_group is None or dist.get_world_size(tp_group) == 1:
        return t.detach().clone()
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    # Strided (megatron's gated MLP: [gate_r; up_r] on rank r): gather each part, then join.
    return torch.cat([_gather(piece, tp_group, dim) for piece in t.detach().chunk(stride, dim=dim)], dim=dim)


def _gather(t: torch.Tensor, tp_group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


TIED_COPY = "#tied_copy"


def state_key(module: str, name: str, param: torch.nn.Parameter, layer_offset: int, expert_offset: int = 0) -> str:
    """`module.<global name>`; a later pipeline stage's copy of a tied embedding is
    `module.embedding.word_embeddings.weight#tied_copy` (`mimo.model.stages.mark_tied_embedding`);
    a routed expert is named by its global index (`expert_offset` + its local one)."""
    from mimo.model.reference_init import global_name, source_name

    if getattr(param, "tied_copy", False):
        return f"{module}.{source_name(name, param, layer_offset)}{TIED_COPY}"
    return f"{module}.{global_name(name, layer_offset, expert_offset)}"


def tp_group_of(name: str, tp_group, experts=None):
    """The group a parameter's TP shards span: expert TP for a routed expert (`ExpertShard`), else TP."""
    from mimo.model.reference_init import is_expert

    return experts.tp_group if experts is not None and is_expert(name) else tp_group


def full_state(parts: Dict[str, torch.nn.Module], tp_groups: Dict[str, object], grads: bool = False,
               only_trainable: bool = False, layer_offsets: Optional[Dict[str, int]] = None,
               experts: Optional[Dict[str, object]] = None) -> Dict[str, torch.Tensor]:
    """`module.param` -> full tensor (or its gradient), on every TP rank of the module.

    With pipeline stages, layer indices are made global with `layer_offsets`
    (module -> index of this stage's first layer); merging the dicts of all
    stages then gives the whole model. An MoE module's routed experts (`experts`: module -> this
    rank's `mimo.model.reference_init.ExpertShard`) are named by global index and gathered over
    expert TP; merging the dicts of all EP ranks then gives every expert.
    """
    out = {}
    for module, m in parts.items():
        ex = (experts or {}).get(module)
        for name, p in m.named_parameters():
            if only_trainable and not p.requires_grad:
                continue
            # megatron-core DDP accumulates (and reduces) gradients in `main_grad`.
            t = getattr(p, "main_grad", p.grad) if grads else p
            if t is None:
                continue
            key = state_key(module, name, p, (layer_offsets or {}).get(module, 0), ex.offset if ex else 0)
            out[key] = unshard(t, p, tp_group_of(name, tp_groups[module], ex)).cpu()
    return out
