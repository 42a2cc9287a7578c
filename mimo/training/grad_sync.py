"""Per-module data-parallel gradient reduction and a global gradient norm across modules."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist


def trainable(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]


def allreduce_gradients(params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
    """Sum gradients over a module's DP (x CP) group, in one flat buffer.

    SUM, not mean: each rank's loss is already divided by the token count of
    the global batch, so the sum is exactly the single-rank gradient. A
    parameter that saw no data this step (an encoder whose shard held no
    items) contributes zeros, which keeps every rank's buffer the same shape.
    """
    _sum_flat(params, group)


def allreduce_sequence_parallel_gradients(params: List[torch.nn.Parameter],
                                          group: Optional[dist.ProcessGroup]) -> None:
    """Sum, over the module's TP group, the gradients of weights replicated across TP but fed
    only this rank's sequence shard under sequence parallelism (layernorms, row-parallel biases;
    megatron marks them `sequence_parallel`). Afterwards every TP rank holds the whole gradient."""
    sp = [p for p in params if getattr(p, "sequence_parallel", False)]
    if group is None or dist.get_world_size(group) == 1:
        return
    _sum_flat(sp, group)


def _sum_flat(params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
    """Fill missing gradients with zeros, then SUM all of them over `group` in one flat buffer."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def local_grad_sq_norm(params: List[torch.nn.Parameter], tp_rank: int, dp_cp_rank: int) -> torch.Tensor:
    """This rank's share of the global squared gradient norm, counting each element once.

    After DP reduction all DP/CP replicas hold the same gradients, so only
    DP/CP rank 0 contributes. Tensor-parallel shards are disjoint pieces and
    all contribute; parameters replicated across TP contribute from TP rank 0.
    """
    total = torch.zeros((), dtype=torch.float64)
    if dp_cp_rank != 0:
        return total
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += p.grad.detach().double().pow(2).sum().cpu()
    return total


def clip_by_global_norm(groups_of_params: List[List[torch.nn.Parameter]], local_sq: torch.Tensor,
                        max_norm: float, device: torch.device) -> float:
    """One norm over every module on every rank (one world all-reduce); scale if above max_norm."""
    sq = local_sq.to(device)
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for params in groups_of_params:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return norm
