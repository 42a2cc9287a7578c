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

``build_communicator`` is collective over the whole world (it may create
process groups): every rank calls it for every edge, in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mimo.topology.layout import Layout

from .autograd import BoundaryTransform, boundary_transform
from .base import BoundaryCommunicator, get_group
from .colocated import ColocatedCommunicator
from .noncolocated import NonColocatedCommunicator
from .plan import COLOCATED, EQUAL, FAN_IN, FAN_OUT, NON_COLOCATED, EdgePlan, Piece, RankRole, Route, make_plan
from .traffic import Traffic

def build_communicator(src_layout: Layout, dst_layout: Layout, batch_window: Optional[int], hidden: int,
                       dtype: torch.dtype = torch.float32, wire_dtype: Optional[torch.dtype] = None,
                       plan: Optional[EdgePlan] = None, device: Optional[torch.device] = None) -> BoundaryCommunicator:
    """Collective: build this rank's communicator for the edge src_layout -> dst_layout.

    `batch_window`: samples moved per forward call (B above), or None when every
    call passes its own window plan (item-level encoder DP); `hidden`: the
    boundary tensor's last dim; `dtype`: compute dtype on both sides;
    `wire_dtype`: dtype on the wire (default `dtype`); `plan`: a precomputed
    plan (tests use it to inject deliberately broken routings); `device`: where
    buffers live (default: the current CUDA device under NCCL, else CPU).
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
    for _, rank_lists in sorted(plan.groups().items()):
        for ranks in rank_lists:
            groups[tuple(ranks)] = get_group(ranks)
    cls = ColocatedCommunicator if plan.placement == COLOCATED else NonColocatedCommunicator
    return cls(plan, hidden, dtype, wire_dtype, groups, device)


__all__ = [
    "COLOCATED", "EQUAL", "FAN_IN", "FAN_OUT", "NON_COLOCATED", "BoundaryCommunicator", "BoundaryTransform",
    "ColocatedCommunicator", "EdgePlan", "NonColocatedCommunicator", "Piece", "RankRole", "Route", "Traffic",
    "boundary_transform", "build_communicator", "get_group", "make_plan",
]
