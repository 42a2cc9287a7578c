"""Boundary communicators: move an encoder -> LLM boundary tensor between two layouts.

A boundary step moves one *batch window* of B units -- items (images, clips) in
training, divided over the encoder's DP ranks (see :mod:`mimo.comm.plan` for the
exact batch semantics): forward materialises each LLM DP shard's units on the
LLM's first-stage TP x CP ranks; backward returns each encoder DP rank's
gradient to the encoder's last-stage TP ranks.

    comm = build_communicator(src_layout, dst_layout, batch_window, hidden,
                              dtype=torch.float32, wire_dtype=torch.bfloat16)
    out = comm.forward(x_or_None, counts_or_None, window)  # packed [tokens, hidden] + per-unit counts;
                                                           # window: this call's plan (plan.for_window)
    counts = comm.received_counts                   # destination shard's counts
    g = comm.backward(grad_or_None)                 # source-layout gradient, or None

The communicator's local collectives (a leader's broadcast to its TP x CP
ranks, the CP sum of gradients) run over groups the two modules' grids
already have (`module_groups`: the encoder's `tp`, the LLM's `tp_cp` and
`cp`), so an edge adds no process group, and on NCCL no communicator and no
buffers. Without them ``build_communicator`` creates its own groups, which is
collective over the whole world: every rank then calls it for every edge, in
the same order.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mimo.topology.layout import Layout

from .autograd import BoundaryTransform, boundary_transform
from .base import BoundaryCommunicator, get_group
from .colocated import ColocatedCommunicator
from .noncolocated import NonColocatedCommunicator
from .plan import COLOCATED, EQUAL, FAN_IN, FAN_OUT, NON_COLOCATED, EdgePlan, Piece, RankRole, Route, make_plan
from .traffic import Traffic

# Which group of which module's grid each kind of edge group is (`EdgePlan.groups`): side 0 is the
# source (encoder), side 1 the destination (LLM).
_GRID_GROUP = {"src_tp": (0, "tp"), "dst_tpcp": (1, "tp_cp"), "dst_cp": (1, "cp")}


def build_communicator(src_layout: Layout, dst_layout: Layout, batch_window: Optional[int], hidden: int,
                       dtype: torch.dtype = torch.float32, wire_dtype: Optional[torch.dtype] = None,
                       plan: Optional[EdgePlan] = None, device: Optional[torch.device] = None,
                       module_groups: Optional[Tuple[Dict, Dict]] = None) -> BoundaryCommunicator:
    """Build this rank's communicator for the edge src_layout -> dst_layout.

    `batch_window`: samples moved per forward call (B above), or None when every
    call passes its own window plan (item-level encoder DP); `hidden`: the
    boundary tensor's last dim; `dtype`: compute dtype on both sides;
    `wire_dtype`: dtype on the wire (default `dtype`); `plan`: a precomputed
    plan (tests use it to inject deliberately broken routings); `device`: where
    buffers live (default: the current CUDA device under NCCL, else CPU);
    `module_groups`: this rank's groups of the source's and the destination's
    grids (`ModuleGrid.groups`, empty where it holds no part), whose groups
    the edge then uses. Without them the call is collective over the world.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_communicator needs torch.distributed to be initialised")
    if hidden <= 0:
        raise ValueError(f"hidden must be positive (got {hidden})")
    plan = plan or make_plan(src_layout, dst_layout, batch_window)
    world = dist.get_world_size()
    for name, lay in (("source", plan.src), ("destination", plan.dst)):
        if lay.ranks.stop > world:
            raise ValueError(f"{name} layout needs ranks up to {lay.ranks.stop - 1} but the world has {world}")
    groups = {}
    rank = dist.get_rank()
    for kind, rank_lists in sorted(plan.groups().items()):
        for ranks in rank_lists:
            if module_groups is None:
                groups[tuple(ranks)] = get_group(ranks)
            elif rank in ranks:  # only a member calls a group
                groups[tuple(ranks)] = _grid_group(module_groups, kind, ranks)
    cls = ColocatedCommunicator if plan.placement == COLOCATED else NonColocatedCommunicator
    return cls(plan, hidden, dtype, wire_dtype, groups, device)


def _grid_group(module_groups: Tuple[Dict, Dict], kind: str, ranks: List[int]):
    """The module grid's group that is the edge group `ranks` of `kind` (a bug if it is not)."""
    side, key = _GRID_GROUP[kind]
    group = module_groups[side].get(key)
    held = None if group is None else sorted(dist.get_process_group_ranks(group))
    if held != sorted(ranks):
        raise RuntimeError(f"boundary group {kind} over ranks {list(ranks)}: the "
                           f"{('source', 'destination')[side]} grid's {key!r} group of this rank is "
                           f"{'missing' if held is None else held}")
    return group


__all__ = [
    "COLOCATED", "EQUAL", "FAN_IN", "FAN_OUT", "NON_COLOCATED", "BoundaryCommunicator", "BoundaryTransform",
    "ColocatedCommunicator", "EdgePlan", "NonColocatedCommunicator", "Piece", "RankRole", "Route", "Traffic",
    "boundary_transform", "build_communicator", "get_group", "make_plan",
]
