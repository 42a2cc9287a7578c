"""Three-phase schedule for encoders colocated with the LLM under a different layout.

Phase 1: every rank runs its encoders forward over its samples of the whole
step (a pipelined encoder streams them through its stages in chunks) and the
colocated communicator re-shards the outputs into the LLM's first-stage
layout (batch window = the global batch). Phase 2: the LLM runs
its microbatches (1F1B when pipelined) on detached per-microbatch slices of
what arrived, accumulating the boundary gradient. Phase 3: the accumulated
gradient goes back through the communicator and the encoders run backward.

Encoder and LLM never hold activations at the same time except the boundary
tensor, and the encoder parameters are idle during phase 2, so they may be
offloaded to host memory in between (`offload`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .graph import Upstream


class SlicedBoundary(Upstream):
    """The LLM first stage's upstream in phase 2: microbatch slices of the received boundary tensors.

    `received`: {name: packed tensor of this LLM DP shard's items, microbatch order};
    `offsets`: {name: token offset of each microbatch, M + 1 entries}. Gradients of
    the slices are written into one buffer per trainable encoder.
    """

    def __init__(self, received: Dict[str, torch.Tensor], offsets: Dict[str, List[int]], trainable: Dict[str, bool]):
        self.received, self.offsets, self.trainable = received, offsets, trainable
        self.grads = {n: torch.zeros_like(t) for n, t in received.items() if trainable[n]}

    def recv_forward(self, mb):
        out = {}
        for name, t in self.received.items():
            a, b = self.offsets[name][mb], self.offsets[name][mb + 1]
            piece = t[a:b].detach()
            out[name] = piece.requires_grad_() if self.trainable[name] else piece
        return out

    def send_backward(self, mb, grads):
        for name, g in grads.items():
            a, b = self.offsets[name][mb], self.offsets[name][mb + 1]
            self.grads[name][a:b] += g


def microbatch_offsets(counts: torch.Tensor, samples_per_microbatch: int) -> List[int]:
    """Token offsets of consecutive microbatches in a packed shard, from per-sample counts."""
    per_mb = counts.reshape(-1, samples_per_microbatch).sum(dim=1).tolist()
    out = [0]
    for c in per_mb:
        out.append(out[-1] + int(c))
    return out


class WholePass:
    """Phase 1 / phase 3 of a single-stage encoder: one forward over all of the rank's items.

    `run()` -> (packed output, per-unit counts), or (None, None) without a shard.
    """

    def __init__(self, run: Callable[[], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]):
        self.run, self.y = run, None

    def forward(self):
        self.y, counts = self.run()
        return self.y, counts

    def backward(self, grad: Optional[torch.Tensor]) -> None:
        y = self.y
        if y is not None and y.requires_grad and grad is not None and grad.numel():
            torch.autograd.backward(y, grad_tensors=grad)
        self.y = None


class StagedPass:
    """Phase 1 / phase 3 of a pipelined encoder: its stages stream chunks of the rank's items.

    Phase 1 runs every chunk forward, stage after stage (GPipe order, so stage
    s + 1 works on chunk c while stage s works on chunk c + 1); the last stage
    hands the concatenated packed output to the communicator. Phase 3 runs the
    chunks backward in the same order. Every stage sends and receives for
    every chunk, empty ones included (their messages are skipped on both sides
    alike), so neighbours never disagree on the message sequence.

    forward_chunk(c, x) -> output of chunk c (x: None on the first stage);
    `link`: StageLink to the neighbouring stages; counts(): the per-sample
    unit counts of the last stage's packed output.
    """

    def __init__(self, num_chunks: int, forward_chunk: Callable[[int, Any], torch.Tensor], link, first: bool,
                 last: bool, counts: Callable[[], torch.Tensor]):
        self.num_chunks, self.forward_chunk, self.link = num_chunks, forward_chunk, link
        self.first, self.last, self.counts = first, last, counts
        self.saved: List[Tuple[Any, torch.Tensor]] = []

    def forward(self):
        self.saved = []
        for c in range(self.num_chunks):
            x = None if self.first else self.link.recv_forward(c)
            y = self.forward_chunk(c, x)
            if not self.last:
                self.link.send_forward(c, y)
            self.saved.append((x, y))
        if not self.last:
            return None, None
        return torch.cat([y for _, y in self.saved], dim=0), self.counts()

    def backward(self, grad: Optional[torch.Tensor]) -> None:
        offset = 0
        for c, (x, y) in enumerate(self.saved):
            if self.last:
                n = y.shape[0]
                g = grad[offset:offset + n] if grad is not None else None
                offset += n
            else:
                g = self.link.recv_backward(c)
            if y.requires_grad and y.numel() and g is not None:
                torch.autograd.backward(y, grad_tensors=g)
            if not self.first:
                self.link.send_backward(c, x.grad if x.grad is not None else torch.zeros_like(x))
        self.saved = []


def run_three_phase(edges: List[Tuple[str, object, bool]], passes: Dict[str, Any],
                    llm_phase: Callable[[Dict[str, torch.Tensor], Dict[str, torch.Tensor]], Optional[SlicedBoundary]],
                    offload=None, on_grad=None, windows: Optional[Dict[str, Any]] = None) -> None:
    """One step. `edges`: (encoder, communicator, trainable) in config order (every rank, same order).

    passes[name]: this rank's `WholePass` or `StagedPass` of the encoder;
    windows[name]: the edge's plan for this step's items (`EdgePlan.for_window`; default the static plan);
    llm_phase(received, counts) runs phase 2 and returns the SlicedBoundary of
    a first-stage rank (else None). `offload`: object with `to_host()` /
    `to_device()` for the encoder parameters.
    """
    received, recv_counts = {}, {}
    for name, comm, trainable in edges:
        with torch.set_grad_enabled(trainable):
            y, counts = passes[name].forward()
        got = comm.forward(None if y is None else y.detach(), counts, (windows or {}).get(name))
        if got is not None:
            received[name], recv_counts[name] = got, comm.received_counts
    if offload is not None:
        offload.to_host()
    boundary = llm_phase(received, recv_counts)
    if offload is not None:
        offload.to_device()
    for name, comm, trainable in edges:
        if not trainable:
            continue
        g = None
        if boundary is not None and name in boundary.grads:
            g = boundary.grads[name]
            if on_grad is not None:
                g = on_grad(name, g)
        passes[name].backward(comm.backward(g))
