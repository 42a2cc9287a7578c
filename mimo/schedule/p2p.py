"""Point-to-point exchanges between neighbouring pipeline stages.

Every exchange posts its send and its receive together and then waits for
both, so two neighbours that both send before they receive (the steady
1F1B state) cannot deadlock, on gloo as on NCCL.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

FORWARD_TAG, BACKWARD_TAG = 11, 12


class StagePeers:
    """How one stage reaches its neighbours (global ranks; None at the ends).

    `shape` is the activation shape, or a function of the microbatch index
    when it varies (context parallelism gives each microbatch its own local
    length). Activations and gradients both arrive in microbatch order, so
    two counters say which microbatch the next receive belongs to.
    """

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int],
                 shape: Union[Tuple[int, ...], Callable[[int], Tuple[int, ...]]],
                 dtype: torch.dtype, device: torch.device):
        self.prev, self.next = prev_rank, next_rank
        self.shape_of = shape if callable(shape) else (lambda mb, s=tuple(shape): s)
        self.dtype, self.device = dtype, device
        self._next = {FORWARD_TAG: 0, BACKWARD_TAG: 0}

    def _exchange(self, send: Optional[Tuple[torch.Tensor, int, int]], recv: Optional[Tuple[int, int]]):
        ops: List = []
        out = None
        if send is not None:
            tensor, dst, tag = send
            ops.append(dist.isend(tensor.detach().contiguous(), dst=dst, tag=tag))
        if recv is not None:
            src, tag = recv
            mb = self._next[tag]
            self._next[tag] += 1
            out = torch.empty(self.shape_of(mb), dtype=self.dtype, device=self.device)
            ops.append(dist.irecv(out, src=src, tag=tag))
        for op in ops:
            op.wait()
        return out

    def recv_forward(self) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        x = self._exchange(None, (self.prev, FORWARD_TAG))
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            self._exchange((y, self.next, FORWARD_TAG), None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        return self._exchange((y, self.next, FORWARD_TAG), (self.next, BACKWARD_TAG))

    def send_backward(self, g: Optional[torch.Tensor]) -> None:
        if self.prev is not None:
            self._exchange((g, self.prev, BACKWARD_TAG), None)

    def send_backward_recv_forward(self, g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        x = self._exchange((g, self.prev, BACKWARD_TAG), (self.prev, FORWARD_TAG))
        return x.requires_grad_()

    def recv_backward(self) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        return self._exchange(None, (self.next, BACKWARD_TAG))
