"""The executor: runs one rank's step plan, action by action.

The plan (`mimo.schedule.plan`) says *what* a rank does and in which order;
the executor walks it and hands each action to an `ActionRunner` (the
trainer's `RankStep`, which knows models and data). Point-to-point actions
of one group are posted together with one `torch.distributed.batch_isend_irecv`
and waited for together, with no message tags: `check_plan` proved before the first step
that every peer posts the matching messages in the same order.

An empty tensor (a microbatch without images on an encoder stage) is not
posted: both peers derive its shape from the same data, so both skip it.
"""

from __future__ import annotations

from typing import List, Protocol

import torch
import torch.distributed as dist

from .plan_types import BACKWARD, COLLECTIVE, FORWARD, RECV, SEND, Action, StepPlan


class ActionRunner(Protocol):
    """What a plan's actions do on one rank (implemented by the trainer)."""

    def forward(self, a: Action) -> None: ...

    def backward(self, a: Action) -> None: ...

    def outgoing(self, a: Action) -> torch.Tensor:
        """The tensor a `send` action carries."""

    def incoming(self, a: Action) -> torch.Tensor:
        """An empty buffer, shaped from the data, for a `recv` action."""

    def arrived(self, a: Action, tensor: torch.Tensor) -> None:
        """The buffer of a `recv` action, once filled."""

    def collective(self, a: Action) -> None: ...

    def local(self, a: Action) -> None:
        """Any other action (optimizer, offload, reload)."""


def run_plan(plan: StepPlan, rank: int, runner: ActionRunner) -> None:
    """Run rank `rank`'s actions of `plan` in order."""
    for group in plan.groups(rank):
        op = group[0].op
        if op in (SEND, RECV):
            run_p2p_group(group, runner)
        elif op == FORWARD:
            runner.forward(group[0])
        elif op == BACKWARD:
            runner.backward(group[0])
        elif op == COLLECTIVE:
            runner.collective(group[0])
        else:
            runner.local(group[0])


def run_p2p_group(group: List[Action], runner: ActionRunner) -> None:
    """One group of sends and receives: posted as one batch, completed together."""
    ops, arrivals = [], []
    for a in group:
        if a.op == SEND:
            t = runner.outgoing(a)
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, a.peer))
        else:
            buf = runner.incoming(a)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, a.peer))
            arrivals.append((a, buf))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for a, buf in arrivals:
        runner.arrived(a, buf)
