"""The stage-node graph and the actions of one stage node: 1F1B, fused nodes, islands.

Every encoder stage and every LLM stage is a node; edges run stage to stage
inside a module and from each encoder's last stage into the LLM's first
stage, whose last stage is the sink. A node's 1F1B warm-up is its distance
to the sink, so the whole graph runs like one pipeline as deep as its
longest path, and every node has exactly one fewer warm-up forward than its
producer.

A node talks to its producers through an *upstream* port (`Up`) and to its
consumer through a *downstream* port (`Down`); ports append the rank's
send/recv or boundary actions to its plan. The combined steady-state ops name
both halves because their order matters on edges whose halves block
(boundary communicators): with producer warm-up `w + 1` and consumer warm-up
`w`, the consumer's edge sequence is F_w, B_0, F_{w+1}, B_1, ..., so the
producer must receive backward i before it sends forward w+1+i. Between
stages of one module a paired exchange is one group (one `batch_isend_irecv`),
so it cannot deadlock against the neighbour's paired exchange.

Boundary communicator calls appear as one `collective` per call, over the
ranks that take part in the edge (the source's last-stage ranks and the
LLM's first-stage ranks): which leaders exchange pieces depends on the
step's items, but every one of those ranks makes the call in the same order,
so a collective is the faithful, data-independent unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mimo.config import LANGUAGE

from .plan_types import ACTIVATION, BACKWARD, BOUNDARY, FORWARD, GRADIENT, RECV, SEND, RankActions


@dataclass(frozen=True)
class Node:
    """One pipeline stage of one module: a node of the stage graph."""
    module: str
    stage: int
    num_stages: int


def stage_nodes(pp_of: Dict[str, int], encoders: List[str]) -> Dict[Node, int]:
    """Every stage node with its distance (in edges) to the sink, the LLM's last stage.

    Edges run stage to stage inside a module and from each encoder's last stage
    into the LLM's first stage; a node's 1F1B warm-up is its distance to the sink,
    so the whole graph runs like one pipeline as deep as its longest path."""
    pl = pp_of[LANGUAGE]
    out = {Node(LANGUAGE, s, pl): pl - 1 - s for s in range(pl)}
    for name in encoders:
        pe = pp_of[name]
        for s in range(pe):
            out[Node(name, s, pe)] = (pe - 1 - s) + 1 + (pl - 1)
    return out


class Up:
    """Where a node's inputs come from; the default combined op hands back B_i before taking F_{w+1+i}."""

    def recv_forward(self, mb: int) -> None:
        pass

    def send_backward(self, mb: int) -> None:
        pass

    def send_backward_recv_forward(self, mb_b: int, mb_f: int) -> None:
        self.send_backward(mb_b)
        self.recv_forward(mb_f)


class Down:
    """Where a node's outputs go; the default combined op receives B_i before it sends F_{w+1+i}."""

    def send_forward(self, mb: int) -> None:
        pass

    def recv_backward(self, mb: int) -> None:
        pass

    def send_forward_recv_backward(self, mb_f: int, mb_b: int) -> None:
        self.recv_backward(mb_b)
        self.send_forward(mb_f)


class Link(Up, Down):
    """Point-to-point with the neighbouring stages of one module; a paired op is one group.

No message tags: towards the next stage only activations travel and back only gradients, each in
microbatch order, and encoders sharing ranks post in config order on both sides, so messages
between two ranks match in the order both post them. `grads_up` False: the stages before this one
train nothing (a frozen encoder's, in front of its projector), so no gradient goes back to them."""

    def __init__(self, out: RankActions, module: str, stage: int, prev: Optional[int], next_: Optional[int],
                 grads_up: bool = True):
        self.out, self.module, self.stage, self.prev, self.next = out, module, stage, prev, next_
        self.grad_peer = prev if grads_up else None

    def _x(self, *ops) -> None:
        self.out.p2p_group(self.module, self.stage, ops)

    def recv_forward(self, mb):
        self._x((RECV, ACTIVATION, mb, self.prev))

    def send_backward(self, mb):
        self._x((SEND, GRADIENT, mb, self.grad_peer))

    def send_backward_recv_forward(self, mb_b, mb_f):
        self._x((SEND, GRADIENT, mb_b, self.grad_peer), (RECV, ACTIVATION, mb_f, self.prev))

    def send_forward(self, mb):
        self._x((SEND, ACTIVATION, mb, self.next))

    def recv_backward(self, mb):
        self._x((RECV, GRADIENT, mb, self.next))

    def send_forward_recv_backward(self, mb_f, mb_b):
        self._x((SEND, ACTIVATION, mb_f, self.next), (RECV, GRADIENT, mb_b, self.next))


class Edge:
    """One boundary communicator as this rank calls it: a collective per call."""

    def __init__(self, out: RankActions, name: str, ranks: Sequence[int]):
        self.out, self.name, self.ranks = out, name, tuple(sorted(ranks))

    def forward(self, mb: Optional[int]) -> None:
        label = "step" if mb is None else f"mb {mb}"
        self.out.collective(f"{BOUNDARY} {self.name} activation {label}", self.ranks, self.name, mb, ACTIVATION)

    def backward(self, mb: Optional[int]) -> None:
        label = "step" if mb is None else f"mb {mb}"
        self.out.collective(f"{BOUNDARY} {self.name} gradient {label}", self.ranks, self.name, mb, GRADIENT)


class Source(Down):
    """An encoder's last stage: its outputs go to the LLM through the boundary communicator."""

    def __init__(self, edge: Edge):
        self.edge = edge

    def send_forward(self, mb):
        self.edge.forward(mb)

    def recv_backward(self, mb):
        self.edge.backward(mb)


class Join(Up):
    """The LLM's first stage fed by non-colocated edges, visited in config order (the order their producers use):
    (edge, trainable, all_at_once) — island edges deliver every microbatch at the first receive."""

    def __init__(self, edges: List[Tuple[Edge, bool, bool]], num_microbatches: int):
        self.edges, self.M, self.buffered = edges, num_microbatches, False

    def recv_forward(self, mb):
        if not self.buffered and any(e[2] for e in self.edges):
            self.buffered = True
            for k in range(self.M):
                for edge, _, at_once in self.edges:
                    if at_once:
                        edge.forward(k)
        for edge, _, at_once in self.edges:
            if not at_once:
                edge.forward(mb)

    def send_backward(self, mb):
        for edge, trainable, _ in self.edges:
            if trainable:
                edge.backward(mb)


class Member:
    """One encoder stage of a rank; `with_backward` False: the stage runs forward only (nothing at or
    before it trains)."""

    def __init__(self, name: str, stage: int, up: Optional[Up], down: Down, with_backward: bool):
        self.name, self.stage, self.up, self.down, self.with_backward = name, stage, up, down, with_backward


class FusedUp(Up):
    def __init__(self, members: List[Member]):
        self.members = [m for m in members if m.up is not None]

    def recv_forward(self, mb):
        for m in self.members:
            m.up.recv_forward(mb)

    def send_backward(self, mb):
        for m in self.members:
            if m.with_backward:
                m.up.send_backward(mb)


class FusedDown(Down):
    def __init__(self, members: List[Member]):
        self.members = members

    def send_forward(self, mb):
        for m in self.members:
            m.down.send_forward(mb)

    def recv_backward(self, mb):
        for m in self.members:
            if m.with_backward:
                m.down.recv_backward(mb)


Step = Callable[[int], None]


def work(out: RankActions, op: str, members: Sequence[Tuple[str, int]]) -> Step:
    """A forward or backward step over (module, stage) pairs, in order."""
    def step(mb):
        for module, stage in members:
            out.local(op, module, stage, mb)
    return step


def node_actions(M: int, warmup: int, up: Optional[Up], down: Optional[Down], forward: Step, backward: Step,
                 with_backward: bool = True) -> None:
    """1F1B over one stage node: `warmup` forwards, then one forward and one backward at a time, then
the remaining backwards. A node without backward (nothing trainable behind its consumer) runs all
forwards in order."""
    if not with_backward:
        for mb in range(M):
            if up:
                up.recv_forward(mb)
            forward(mb)
            if down:
                down.send_forward(mb)
        return
    warmup = min(warmup, M)
    for mb in range(warmup):
        if up:
            up.recv_forward(mb)
        forward(mb)
        down.send_forward(mb)
    steady = M - warmup
    if up and steady > 0:
        up.recv_forward(warmup)
    for i in range(steady):
        forward(warmup + i)
        if down:
            down.send_forward_recv_backward(warmup + i, i)
        backward(i)
        if up:
            if i == steady - 1:
                up.send_backward(i)
            else:
                up.send_backward_recv_forward(i, warmup + i + 1)
    for i in range(steady, M):
        if down:
            down.recv_backward(i)
        backward(i)
        if up:
            up.send_backward(i)


def island_actions(out: RankActions, M: int, members: List[Member], level: Dict[str, int],
                   order: Dict[str, int]) -> None:
    """All forwards, then all backwards, of the stage nodes of one island rank.

An island is a rank range shared by non-colocated encoders of different pipeline depths: a rank
there holds nodes with different 1F1B warm-ups, which one thread cannot interleave safely against
blocking edges. Instead every island rank handles its messages in one global order (microbatch,
then sender level: forward far first, backward near first, then encoder config order), so the
smallest pending message always has both ends waiting for it. Stages of one range are ordered alike
for every encoder and a rank never holds two stages of one encoder, so these keys never tie. The
LLM's join takes all island microbatches first (`Join`'s all-at-once edges); the price is memory."""
    fwd = sorted([(level[m.name] + 1, order[m.name], RECV, m) for m in members if m.up is not None]
                 + [(level[m.name], order[m.name], SEND, m) for m in members], key=lambda e: (-e[0], e[1]))
    bwd = sorted([(level[m.name], order[m.name], RECV, m) for m in members if m.with_backward]
                 + [(level[m.name] + 1, order[m.name], SEND, m) for m in members
                    if m.with_backward and m.up is not None], key=lambda e: (e[0], e[1]))
    for mb in range(M):
        for _, _, kind, m in fwd:
            if kind == RECV:
                m.up.recv_forward(mb)
            else:
                out.local(FORWARD, m.name, m.stage, mb)
                m.down.send_forward(mb)
    for mb in range(M):
        for _, _, kind, m in bwd:
            if kind == RECV:
                m.down.recv_backward(mb)
                out.local(BACKWARD, m.name, m.stage, mb)
            else:
                m.up.send_backward(mb)


def fused_node(out: RankActions, M: int, warmup: int, members: List[Member]) -> None:
    """Encoders sharing a rank range with one pp: their nodes have one warm-up, so the rank steps them
in lock-step as one node. A fused port handles all backward messages of a step before all forward
ones, members in config order: the order of the consumer side too."""
    if len(members) == 1:
        m = members[0]
        return node_actions(M, warmup, m.up, m.down, work(out, FORWARD, [(m.name, m.stage)]),
                            work(out, BACKWARD, [(m.name, m.stage)]), m.with_backward)
    up = FusedUp(members) if members[0].up is not None else None
    node_actions(M, warmup, up, FusedDown(members), work(out, FORWARD, [(m.name, m.stage) for m in members]),
                 work(out, BACKWARD, [(m.name, m.stage) for m in members if m.with_backward]),
                 any(m.with_backward for m in members))
