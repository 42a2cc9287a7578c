"""The ranks agree on a resume's verdict before the collective load, in a few small collectives.

Each rank checks what it holds: the checksums of its share of the files and the shapes of its own
parameters. The job must then stop on every rank with the same line, or go on on every rank. What
crosses the ranks does not grow with the world size: the first problem is found by a MIN reduction
of its position (module, layer, parameter) and its one message is broadcast from the rank that has
it; which parameters of the checkpoint no rank holds is a reduction over the checkpoint's own
parameter list, which every rank already reads (the index of a distributed checkpoint).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mimo.runtime import collective_device

Order = Tuple[int, int, int]
FILE_PROBLEM: Order = (-1, -1, -1)  # sorts before every parameter's problem (module, layer, shard index)
_NONE = 1 << 62  # no problem on this rank


def _code(order: Order) -> int:
    """`order` as one integer of the same sort order (each part shifted past -1, then packed)."""
    module, layer, index = (x + 1 for x in order)
    if not (0 <= module < 1 << 8 and 0 <= layer < 1 << 20 and 0 <= index < 1 << 30):
        raise ValueError(f"problem position out of range: {order}")
    return (module << 50) | (layer << 30) | index


def first_problem(problems: Sequence[Tuple[Order, str]]) -> Optional[Tuple[Order, str]]:
    """Collective: the first of every rank's problems in model order (ties: the lowest rank), the same
    on every rank; None when no rank has one."""
    device = collective_device()
    mine = min(problems) if problems else None
    mine_code = _code(mine[0]) if mine else _NONE
    code = torch.tensor([mine_code], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    if int(code) == _NONE:
        return None
    owner = torch.tensor([dist.get_rank() if mine_code == int(code) else dist.get_world_size()],
                         dtype=torch.int64, device=device)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    found: List[Optional[Tuple[Order, str]]] = [mine]
    dist.broadcast_object_list(found, src=int(owner), device=device)
    return found[0]


def held_by_none(keys: Sequence[str], held: Iterable[str]) -> List[str]:
    """Collective: those of `keys` (the same list, in the same order, on every rank) that no rank's
    `held` names."""
    held = set(held)
    mask = torch.tensor([k in held for k in keys], dtype=torch.int32, device=collective_device())
    dist.all_reduce(mask, op=dist.ReduceOp.MAX)
    return [k for k, h in zip(keys, mask.tolist()) if not h]
