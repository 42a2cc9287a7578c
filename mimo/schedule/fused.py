"""Several stage nodes on one rank, run as one node (encoders sharing a rank range).

Encoders that share a rank range away from the LLM put more than one stage
node on a rank. When those nodes are equally far from the sink they have the
same 1F1B warm-up, so the rank can step them in lock-step: one fused forward
runs every member's forward for the microbatch, one fused backward every
member's backward.

Order is what keeps blocking edges deadlock-free: a fused port always handles
all backward messages of a step before all forward messages, members in
config order — the same order as the consumer side (`BoundaryJoin`, or another
fused node). A member without backward (frozen encoder and projector: its
consumer sends no gradient) takes part in forwards only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .graph import Downstream, Upstream


@dataclass
class Member:
    name: str
    forward_step: Callable[[int, Any], Any]
    backward_step: Callable[[int, Any, Any, Any], Any]
    up: Optional[Upstream]
    down: Optional[Downstream]
    with_backward: bool


class FusedUpstream(Upstream):
    def __init__(self, members: List[Member]):
        self.members = [m for m in members if m.up is not None]

    def recv_forward(self, mb):
        return {m.name: m.up.recv_forward(mb) for m in self.members}

    def send_backward(self, mb, grads):
        for m in self.members:
            if m.with_backward:
                m.up.send_backward(mb, grads[m.name])


class FusedDownstream(Downstream):
    def __init__(self, members: List[Member]):
        self.members = [m for m in members if m.down is not None]

    def send_forward(self, mb, outs):
        for m in self.members:
            m.down.send_forward(mb, outs[m.name])

    def recv_backward(self, mb):
        return {m.name: m.down.recv_backward(mb) for m in self.members if m.with_backward}


def fuse(members: List[Member]) -> Tuple[Callable, Callable, Optional[Upstream], Optional[Downstream], bool]:
    """(forward_step, backward_step, up, down, with_backward) of the fused node, for `run_node`."""
    if any((m.up is None) != (members[0].up is None) or (m.down is None) != (members[0].down is None)
           for m in members):
        raise ValueError("fused stage nodes must all have, or all lack, a producer and a consumer")

    def forward_step(mb, xs: Optional[Dict[str, Any]]):
        return {m.name: m.forward_step(mb, None if xs is None else xs[m.name]) for m in members}

    def backward_step(mb, xs, ys: Dict[str, Any], grads: Optional[Dict[str, Any]]):
        out = {}
        for m in members:
            if m.with_backward:
                out[m.name] = m.backward_step(mb, None if xs is None else xs[m.name], ys[m.name],
                                              None if grads is None else grads[m.name])
        return out

    up = FusedUpstream(members) if members[0].up is not None else None
    down = FusedDownstream(members) if members[0].down is not None else None
    return forward_step, backward_step, up, down, any(m.with_backward for m in members)
