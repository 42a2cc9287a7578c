"""Host-side collectives over every rank in two levels: each node's ranks with their leader, then the leaders.

The data side agrees on small things over all ranks (each step's plan digest, the record index at
start-up) on gloo, off the training streams, on the thread that loads steps ahead. One gloo group
of all ranks would connect every pair of them: at 1,024 ranks some 1,023 sockets per process
(past a default `ulimit -n` of 1,024) and half a million connections set up through the store at
start-up. Here each rank connects only to the ranks of its node, and each node's leader (its first
rank) to the other leaders: at 1,024 ranks on 128 nodes of 8, 7 sockets per rank and 127 more per
leader. A reduction fans in to the leader, runs over the leaders and fans back out: three small
collectives in place of one.

Nodes are blocks of `per_node` consecutive ranks (torchrun numbers a node's ranks consecutively;
the smallest LOCAL_WORLD_SIZE of all ranks); where they are not, the results are the same, only
the sockets are not node-local.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .distributed import collective_device


class FanIn:
    """Collective at construction (every rank, the same point of start-up): the gloo groups."""

    def __init__(self, timeout_minutes: float, per_node: Optional[int] = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if per_node is None:
            # Every rank must make the same groups: nodes launched with different process counts
            # take the smallest (any blocks give the same results; only the sockets are less local).
            local = torch.tensor([int(os.environ.get("LOCAL_WORLD_SIZE", self.world))], dtype=torch.int64,
                                 device=collective_device())
            dist.all_reduce(local, op=dist.ReduceOp.MIN)
            per_node = int(local)
        per_node = min(max(1, per_node), self.world)
        timeout = timedelta(minutes=timeout_minutes)
        self.leader = self.rank - self.rank % per_node  # the global rank of this node's leader
        self.node = None
        # Every rank creates every group, in the same order (torch requires it of new_group).
        for first in range(0, self.world, per_node):
            group = dist.new_group(list(range(first, min(first + per_node, self.world))), backend="gloo",
                                   timeout=timeout)
            if first == self.leader:
                self.node = group
        self.leaders = dist.new_group(list(range(0, self.world, per_node)), backend="gloo", timeout=timeout)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.MAX) -> None:
        """In place, like `dist.all_reduce` over every rank (a host tensor; MAX, MIN or SUM)."""
        dist.all_reduce(tensor, op=op, group=self.node)
        if self.is_leader:
            dist.all_reduce(tensor, op=op, group=self.leaders)
        dist.broadcast(tensor, src=self.leader, group=self.node)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        mine: Optional[List[Any]] = [None] * dist.get_world_size(self.node) if self.is_leader else None
        dist.gather_object(obj, mine, dst=self.leader, group=self.node)
        out: List[Any] = [None]
        if self.is_leader:
            nodes: List[Any] = [None] * dist.get_world_size(self.leaders)
            dist.all_gather_object(nodes, mine, group=self.leaders)
            out = [[o for node in nodes for o in node]]
        dist.broadcast_object_list(out, src=self.leader, group=self.node)
        return out[0]
