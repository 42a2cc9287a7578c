"""Ports of the stage-node graph for non-colocated modules (see mimo.schedule.graph).

* `StageLink`: point-to-point between neighbouring stages of one module. Its
  tensor shape may change per microbatch (an encoder stage's activation has
  one row per item of the microbatch); both sides derive it from the data,
  so no shape travels. Paired ops post send and receive together (one
  `batch_isend_irecv`), so they cannot deadlock against the neighbour's paired
  op. No message tags (NCCL ignores them): encoders sharing a rank range talk
  to each other's neighbours in config order on both sides (mimo.schedule.fused),
  so messages between two ranks match in the order both post them.
* `BoundarySource` / `BoundaryJoin`: the two ends of encoder -> LLM edges,
  driven through the boundary communicators, whose halves block. A join
  (LLM first stage fed by several encoders) visits its edges in config order
  and has every boundary tensor of a microbatch before running it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .graph import Downstream, Upstream

ShapeOf = Callable[[int], Sequence[int]]


class StageLink(Upstream, Downstream):
    """One side of the link(s) of a stage: `prev` feeds it, it feeds `next` (global ranks or None)."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], in_shape: Optional[ShapeOf],
                 out_shape: Optional[ShapeOf], dtype: torch.dtype, device: torch.device):
        self.prev, self.next = prev_rank, next_rank
        self.in_shape, self.out_shape = in_shape, out_shape
        self.dtype, self.device = dtype, device

    def _run(self, sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[Sequence[int], int]]):
        """Post the sends and receives as one batch and wait for all of them.

        Empty tensors (a microbatch without items) are skipped on both sides
        alike, since both derive the shape from the data."""
        ops, outs = [], []
        for t, peer in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), peer))
        for shape, peer in recvs:
            buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, peer))
            outs.append(buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return outs

    def _fwd_in(self, mb):
        return (self.in_shape(mb), self.prev)

    def _bwd_in(self, mb):
        return (self.out_shape(mb), self.next)

    def recv_forward(self, mb):
        return self._run([], [self._fwd_in(mb)])[0].requires_grad_()

    def send_backward(self, mb, grad):
        self._run([(grad, self.prev)], [])

    def send_backward_recv_forward(self, mb_b, grad, mb_f):
        return self._run([(grad, self.prev)], [self._fwd_in(mb_f)])[0].requires_grad_()

    def send_forward(self, mb, out):
        self._run([(out, self.next)], [])

    def recv_backward(self, mb):
        return self._run([], [self._bwd_in(mb)])[0]

    def send_forward_recv_backward(self, mb_f, out, mb_b):
        return self._run([(out, self.next)], [self._bwd_in(mb_b)])[0]


class BoundarySource(Downstream):
    """An encoder's last stage: forward sends the packed shard, backward receives its gradient."""

    def __init__(self, comm, counts_of: Callable[[int], torch.Tensor], window_of: Callable[[int], object]):
        self.comm, self.counts_of, self.window_of = comm, counts_of, window_of

    def send_forward(self, mb, out):
        self.comm.forward(out.detach(), self.counts_of(mb), self.window_of(mb))

    def recv_backward(self, mb):
        return self.comm.backward(None)


class BoundaryJoin(Upstream):
    """The LLM's first stage: one boundary tensor per encoder edge, received in config order.

    `edges`: (encoder name, communicator, whether gradients flow back). A frozen
    encoder + projector gets no boundary backward: both ends know it from the config.
    `expect(mb)` -> {name: (window plan of the edge, per-unit token counts the data implies)};
    the counts are checked on receipt.
    `on_grad` lets tests tamper with a boundary gradient before it is sent.
    `all_at_once`: edges whose producers run all forwards before any backward
    (`run_island`); the first `recv_forward` takes every microbatch of them, in
    (microbatch, config) order — the order their producers send in.
    """

    def __init__(self, edges: List[Tuple[str, object, bool]],
                 expect: Callable[[int], Dict[str, Tuple[object, torch.Tensor]]], on_grad=None,
                 all_at_once: Sequence[str] = (), num_microbatches: int = 0):
        self.edges, self.expect, self.on_grad = edges, expect, on_grad
        self.all_at_once, self.num_microbatches = set(all_at_once), num_microbatches
        self.buffered: Optional[Dict[Tuple[str, int], torch.Tensor]] = None

    def _receive(self, mb, name, comm, trainable, want):
        window, counts = want[name]
        t = comm.forward(None, None, window)
        if not torch.equal(comm.received_counts.cpu(), counts.cpu()):
            raise RuntimeError(f"microbatch {mb}: boundary {name!r} delivered token counts "
                               f"{comm.received_counts.tolist()} but the batch needs {counts.tolist()}")
        return t.requires_grad_() if trainable else t

    def recv_forward(self, mb):
        if self.buffered is None and self.all_at_once:
            self.buffered = {}
            for k in range(self.num_microbatches):
                want = self.expect(k)
                for edge in self.edges:
                    if edge[0] in self.all_at_once:
                        self.buffered[(edge[0], k)] = self._receive(k, *edge, want)
        out = {}
        want = self.expect(mb)
        for edge in self.edges:
            name = edge[0]
            out[name] = (self.buffered.pop((name, mb)) if name in self.all_at_once
                         else self._receive(mb, *edge, want))
        return out

    def send_backward(self, mb, grads):
        for name, comm, trainable in self.edges:
            if trainable:
                g = grads[name]
                if self.on_grad is not None:
                    g = self.on_grad(name, g)
                comm.backward(g)


def run_island(num_microbatches: int, members: List, level: Dict[str, int], order: Dict[str, int]) -> None:
    """All forwards, then all backwards, for the stage nodes of one rank of an island.

    An island is a rank range shared by non-colocated encoders of different
    pipeline depths: a rank there holds nodes with different 1F1B warm-ups,
    which one thread cannot interleave safely against blocking edges. Instead
    every island rank handles its messages in one global order — microbatch,
    then sender level (distance to the sink; forward: far first, backward:
    near first), then encoder config order — so the smallest pending message
    always has both ends waiting for it and nothing deadlocks. Stages of one
    range are ordered alike for every encoder (pipeline stage grows with the
    rank), and a rank never holds two stages of one encoder, so these keys
    never tie. The LLM's join takes all island microbatches first
    (`BoundaryJoin.all_at_once`).

    members: `mimo.schedule.fused.Member`s; level[name]: distance of this rank's
    stage of `name` to the sink; order[name]: the encoder's config index.
    """
    by_name = {m.name: m for m in members}
    fwd = sorted([(level[m.name] + 1, order[m.name], "recv", m.name) for m in members if m.up is not None]
                 + [(level[m.name], order[m.name], "send", m.name) for m in members],
                 key=lambda e: (-e[0], e[1]))
    bwd = sorted([(level[m.name], order[m.name], "recv", m.name) for m in members if m.with_backward]
                 + [(level[m.name] + 1, order[m.name], "send", m.name) for m in members
                    if m.with_backward and m.up is not None],
                 key=lambda e: (e[0], e[1]))
    saved = {}
    for mb in range(num_microbatches):
        inputs = {}
        for _, _, kind, name in fwd:
            m = by_name[name]
            if kind == "recv":
                inputs[name] = m.up.recv_forward(mb)
            else:
                x = inputs.pop(name, None)
                y = m.forward_step(mb, x)
                m.down.send_forward(mb, y)
                if m.with_backward:
                    saved[(name, mb)] = (x, y)
    for mb in range(num_microbatches):
        pending = {}
        for _, _, kind, name in bwd:
            m = by_name[name]
            if kind == "recv":
                x, y = saved.pop((name, mb))
                pending[name] = m.backward_step(mb, x, y, m.down.recv_backward(mb))
            else:
                m.up.send_backward(mb, pending.pop(name))
