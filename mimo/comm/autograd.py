"""The boundary transform as an autograd op, for colocated edges with PP = 1 on both sides.

There every rank holds a source shard and receives a destination shard, and
all ranks run forward and backward together, so the communicator's two
halves can sit inside one torch.autograd.Function: ``loss.backward()`` on
every rank runs the backward transform collectively. Pipelined schedules
call ``comm.forward`` / ``comm.backward`` themselves instead.
"""

from __future__ import annotations

import torch

from .base import BoundaryCommunicator
from .plan import COLOCATED


class BoundaryTransform(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, counts, comm):
        ctx.comm = comm
        return comm.forward(tensor, counts)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.backward(grad.contiguous()), None, None


def boundary_transform(comm: BoundaryCommunicator, tensor: torch.Tensor, counts: torch.Tensor):
    """Differentiable layout transform: returns (destination tensor, destination counts)."""
    plan = comm.plan
    if plan.placement != COLOCATED or plan.src.pp != 1 or plan.dst.pp != 1:
        raise ValueError("boundary_transform needs a colocated edge with pp=1 on both sides "
                         f"(got {plan.describe()}); use comm.forward / comm.backward from the schedule")
    out = BoundaryTransform.apply(tensor, counts, comm)
    return out, comm.received_counts
