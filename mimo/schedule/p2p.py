"""Point-to-point exchanges between neighbouring pipeline stages.

Every exchange posts its send and its receive together (one
``batch_isend_irecv``) and then waits for both, so two neighbours that both
send before they receive (the steady 1F1B state) cannot deadlock, on gloo as
on NCCL. No message tags (NCCL ignores them): towards the next stage only
activations travel and back only gradients, each in microbatch order, so
messages match in the order both sides post them.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

# Which counter a receive advances (not message tags: nothing is sent with a tag).
FORWARD, BACKWARD = "activation", "gradient"


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
        self._next = {FORWARD: 0, BACKWARD: 0}

    def _exchange(self, send: Optional[Tuple[torch.Tensor, int]], recv: Optional[Tuple[int, str]]):
        ops: List = []
        out = None
        if send is not None:
            tensor, dst = send
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), dst))
        if recv is not None:
            src, kind = recv
            mb = self._next[kind]
            self._next[kind] += 1
            out = torch.empty(self.shape_of(mb), dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, out, src))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out

    def recv_forward(self) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        x = self._exchange(None, (self.prev, FORWARD))
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            self._exchange((y, self.next), None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        return self._exchange((y, self.next), (self.next, BACKWARD))

    def send_backward(self, g: Optional[torch.Tensor]) -> None:
        if self.prev is not None:
            self._exchange((g, self.prev), None)

    def send_backward_recv_forward(self, g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        x = self._exchange((g, self.prev), (self.prev, FORWARD))
        return x.requires_grad_()

    def recv_backward(self) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        return self._exchange(None, (self.next, BACKWARD))
