"""1F1B over the pipeline stages of one module.

Stage `s` of `p` runs `min(p - s - 1, M)` warm-up forwards, then alternates
one forward and one backward, then drains the remaining backwards. The
stage's work is given as a callable, so the same engine serves any module:

    forward_step(microbatch, input_or_None) -> output activation (or, on the
    last stage, a scalar loss already normalised for accumulation)

Activations live only between a microbatch's forward and its backward; at
most `p - s` are held at once, as in 1F1B.

`span(action, microbatch)`, if given, returns a context manager around each
forward ("F") and backward ("B") computation (timing; no communication inside).
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import torch

from .p2p import StagePeers


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor], inp: Optional[torch.Tensor]):
    if grad is None:  # last stage: output is the loss
        output.backward()
    else:
        torch.autograd.backward(output, grad_tensors=grad)
    if inp is None:
        return None
    return inp.grad if inp.grad is not None else torch.zeros_like(inp)


def run_1f1b(num_microbatches: int, stage: int, num_stages: int, peers: StagePeers,
             forward_step: Callable[[int, Optional[torch.Tensor]], torch.Tensor],
             span: Optional[Callable[[str, int], ContextManager]] = None) -> None:
    span = span or (lambda action, mb: nullcontext())
    last = stage == num_stages - 1
    warmup = min(num_stages - stage - 1, num_microbatches)
    in_flight = deque()  # (input, output) of microbatches awaiting backward

    for mb in range(warmup):
        x = peers.recv_forward()
        with span("F", mb):
            y = forward_step(mb, x)
        peers.send_forward(y)
        in_flight.append((x, y))

    steady = num_microbatches - warmup
    x = peers.recv_forward() if steady > 0 else None
    for i in range(steady):
        with span("F", warmup + i):
            y = forward_step(warmup + i, x)
        grad = None if last else peers.send_forward_recv_backward(y)
        in_flight.append((x, y))
        x0, y0 = in_flight.popleft()
        with span("B", i):
            gx = _backward(y0, grad, x0)
        if i == steady - 1:
            peers.send_backward(gx)
        else:
            x = peers.send_backward_recv_forward(gx)

    for i in range(steady, num_microbatches):
        x0, y0 = in_flight.popleft()
        grad = peers.recv_backward()
        with span("B", i):
            gx = _backward(y0, grad, x0)
        peers.send_backward(gx)
