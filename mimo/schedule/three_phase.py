"""Three-phase schedule for encoders colocated with the LLM under a different layout.

Phase 1: every rank runs its encoders forward over its samples of the whole
step and the colocated communicator re-shards the outputs into the LLM's
first-stage layout (batch window = the global batch). Phase 2: the LLM runs
its microbatches (1F1B when pipelined) on detached per-microbatch slices of
what arrived, accumulating the boundary gradient. Phase 3: the accumulated
gradient goes back through the communicator and the encoders run backward.

Encoder and LLM never hold activations at the same time except the boundary
tensor, and the encoder parameters are idle during phase 2, so they may be
offloaded to host memory in between (`offload`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .graph import Upstream


class SlicedBoundary(Upstream):
    """The LLM first stage's upstream in phase 2: microbatch slices of the received boundary tensors.

    `received`: {name: packed tensor of this LLM DP shard's samples, microbatch order};
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


def run_three_phase(edges: List[Tuple[str, object, bool]],
                    encoder_forward: Callable[[str], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]],
                    llm_phase: Callable[[Dict[str, torch.Tensor], Dict[str, torch.Tensor]], Optional[SlicedBoundary]],
                    offload=None, on_grad=None) -> None:
    """One step. `edges`: (encoder, communicator, trainable) in config order (every rank, same order).

    encoder_forward(name) -> (packed output, per-sample counts) of this rank's
    encoder shard, or (None, None) if it holds none; llm_phase(received, counts)
    runs phase 2 and returns the SlicedBoundary of a first-stage rank (else None).
    `offload`: object with `to_host()` / `to_device()` for the encoder parameters.
    """
    outputs, received, recv_counts = {}, {}, {}
    for name, comm, trainable in edges:
        with torch.set_grad_enabled(trainable):
            y, counts = encoder_forward(name)
        outputs[name] = y
        got = comm.forward(None if y is None else y.detach(), counts)
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
        gy = comm.backward(g)
        y = outputs[name]
        if y is not None and y.requires_grad and gy is not None and gy.numel():
            torch.autograd.backward(y, grad_tensors=gy)
