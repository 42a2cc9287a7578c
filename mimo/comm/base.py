"""What both communicators share: validation, packing by sample counts, wire casts, P2P helpers.

The boundary tensor of a shard is *packed*: ``[total_tokens_of_shard, hidden]``
plus a LongTensor of per-sample token counts (one entry per sample of the
shard, zeros allowed). Moving samples therefore means moving token ranges
given by cumulative counts.
"""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mimo.runtime import collective_device

from .plan import EdgePlan, Piece
from .traffic import Traffic


_group_cache: Dict[Tuple[int, ...], object] = {}
_group_cache_world = [None]


def get_group(ranks: Sequence[int]):
    """Process group over `ranks`, created once per rank list. Collective over the world.

    Every rank asks for the same rank lists in the same order (communicators
    are built collectively), so cache hits and misses agree across ranks and
    the underlying new_group calls stay matched. Sharing one group between
    edges is safe because collectives on it run in program order on every member.
    """
    if _group_cache_world[0] is not dist.group.WORLD:  # a fresh process group invalidates the cache
        _group_cache.clear()
        _group_cache_world[0] = dist.group.WORLD
    key = tuple(ranks)
    if key not in _group_cache:
        _group_cache[key] = dist.new_group(list(key))
    return _group_cache[key]


def cumulative(counts: torch.Tensor) -> List[int]:
    """Token offsets of a shard's units; `counts` should live on the host (a device tensor is
    copied to it, which waits for the device)."""
    out = [0]
    for c in counts.tolist():
        out.append(out[-1] + int(c))
    return out


def known_counts(plan: EdgePlan, a: int, b: int) -> torch.Tensor:
    """Host int64 token counts of units [a, b) of a plan whose unit sizes every rank knows."""
    return torch.tensor(plan.unit_tokens[a:b], dtype=torch.int64)


class BoundaryCommunicator:
    """One rank's view of one edge. Built collectively by :func:`mimo.comm.build_communicator`.

    ``forward(tensor, counts, window=None)``: ``window`` is the edge plan of
    this call (:meth:`EdgePlan.for_window`, the same on every rank of the
    edge; default: the static plan the communicator was built with). Source ranks (holders of a source shard) pass
    their packed shard and its per-sample counts; every other rank passes
    ``(None, None)``. Destination ranks (first-stage ranks of a destination
    shard, every TP x CP rank) get their packed shard, other ranks ``None``;
    the destination shard's counts are then in ``received_counts``.

    ``backward(grad)``: destination ranks pass the gradient of what forward
    gave them, others ``None``; source ranks get the gradient of their shard.
    Gradient contract on a destination shard: TP replicas carry identical
    gradients (only the TP-rank-0 replica is read by the non-colocated
    communicator); CP ranks carry partial gradients that are *summed* (each CP
    rank receives the full shard but only its own chunk of the fused sequence
    depends on it, so the per-CP gradients are disjoint parts of the total).

    Several forwards may be in flight (pipeline microbatches): each forward
    saves its routing state and backward consumes the oldest (FIFO, the order
    1F1B runs backwards in); `forward(..., backward=False)` (an edge whose
    gradient never comes back) saves nothing. Ranks with no role in the edge
    may skip calls.
    """

    def __init__(self, plan: EdgePlan, hidden: int, dtype: torch.dtype, wire_dtype: Optional[torch.dtype],
                 groups: Dict[Tuple[int, ...], object], device: Optional[torch.device] = None):
        self.plan = plan
        self.hidden = hidden
        self.dtype = dtype
        self.wire_dtype = wire_dtype or dtype
        self.rank = dist.get_rank()
        self.role = plan.role(self.rank)
        self.traffic = Traffic()
        self.received_counts: Optional[torch.Tensor] = None
        self._groups = groups
        self._saved = deque()
        self.device = torch.device(device) if device is not None else collective_device()

    # -- roles --------------------------------------------------------------------
    @property
    def is_source(self) -> bool:
        return self.role.src_shard is not None

    @property
    def is_destination(self) -> bool:
        return self.role.dst_shard is not None

    @property
    def pending(self) -> int:
        """Forwards whose backward has not run yet."""
        return len(self._saved)

    def group(self, ranks: Sequence[int]):
        return self._groups[tuple(ranks)]

    # -- validation (before any communication, so a bad call fails with a clear message) ---
    def _window(self, window: Optional[EdgePlan]) -> EdgePlan:
        if window is None:
            return self.plan
        if window.src != self.plan.src or window.dst != self.plan.dst:
            raise ValueError(f"rank {self.rank}: window plan is for another edge ({window.describe()})")
        return window

    def _check_source(self, tensor, counts, plan: EdgePlan) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the shard on the edge's device, its per-unit counts on the host); None, None off-source."""
        if not self.is_source:
            if tensor is not None:
                raise ValueError(f"rank {self.rank} holds no source shard of this edge but was given a tensor")
            return None, None
        where = f"rank {self.rank} (source shard {self.role.src_shard})"
        if tensor is None or counts is None:
            raise ValueError(f"{where} must pass its boundary tensor and per-sample token counts")
        a, b = plan.src_interval(self.role.src_shard)
        n = b - a
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or counts.dim() != 1:
            raise ValueError(f"{where}: counts must be a 1-D int64 tensor")
        counts = counts.cpu()  # sizes are worked out on the host (a no-op for host counts)
        if counts.numel() != n:
            raise ValueError(f"{where}: counts has {counts.numel()} entries but the shard holds {n} units "
                             f"(units [{a}, {b}) of the batch window)")
        if bool((counts < 0).any()):
            raise ValueError(f"{where}: counts must be non-negative")
        if tensor.dim() != 2 or tensor.shape[1] != self.hidden:
            raise ValueError(f"{where}: tensor must be [tokens, {self.hidden}], got {list(tensor.shape)}")
        total = int(counts.sum())
        if tensor.shape[0] != total:
            raise ValueError(f"{where}: tensor has {tensor.shape[0]} tokens but counts sum to {total}")
        if tensor.dtype != self.dtype:
            raise ValueError(f"{where}: tensor dtype {tensor.dtype} differs from the edge's compute dtype {self.dtype}")
        if plan.unit_tokens is not None and counts.tolist() != plan.unit_tokens[a:b]:
            raise ValueError(f"{where}: counts differ from the window's unit sizes")
        return tensor.detach().to(self.device).contiguous(), counts

    def _check_grad(self, grad, ctx) -> Optional[torch.Tensor]:
        if not self.is_destination:
            if grad is not None:
                raise ValueError(f"rank {self.rank} received no destination shard but was given a gradient")
            return None
        where = f"rank {self.rank} (destination shard {self.role.dst_shard})"
        shape = (int(ctx["dst"].sum()), self.hidden)
        if grad is None:
            raise ValueError(f"{where} must pass the gradient of its boundary tensor")
        if tuple(grad.shape) != tuple(shape):
            raise ValueError(f"{where}: gradient shape {list(grad.shape)} differs from the forward output {list(shape)}")
        return grad.detach().to(self.device, self.dtype).contiguous()

    def _pop_checked(self, grad):
        """(saved forward state, validated gradient); the state is only consumed if the gradient is valid."""
        if not self._saved:
            raise RuntimeError("backward called without a matching forward on this edge")
        grad = self._check_grad(grad, self._saved[0])
        return self._saved.popleft(), grad

    # -- wire format ------------------------------------------------------------------
    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wire_dtype).contiguous()

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)

    def wire_bytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def empty_wire(self, tokens: int) -> torch.Tensor:
        return torch.empty(tokens, self.hidden, dtype=self.wire_dtype, device=self.device)

    def empty_counts(self, samples: int) -> torch.Tensor:
        return torch.empty(samples, dtype=torch.int64, device=self.device)

    # -- piece slicing ------------------------------------------------------------
    @staticmethod
    def piece_range(p: Piece, shard_start: int, cum: List[int]) -> Tuple[int, int, int, int]:
        """(first sample, last sample + 1, first token, last token + 1) of piece p within a shard."""
        a, b = p.start - shard_start, p.stop - shard_start
        return a, b, cum[a], cum[b]

    # -- P2P: one batch_isend_irecv per exchange, no tags ---------------------------------
    def exchange(self, sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive of one exchange together and wait for all of them.

        Both ends list their transfers in piece order, derived from the same
        plan, and a pair of ranks exchanges at most one message per piece, so
        messages match by order alone (NCCL ignores tags). Empty tensors are
        skipped on both sides alike (their size is known to both).
        """
        ops = ([dist.P2POp(dist.isend, t, peer) for t, peer in sends if t.numel() > 0]
               + [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs if t.numel() > 0])
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def scope(self, a: int, b: int) -> str:
        same = ((self.plan.src.contains(a) and self.plan.src.contains(b))
                or (self.plan.dst.contains(a) and self.plan.dst.contains(b)))
        return "intra" if same else "cross"

    def broadcast(self, t: torch.Tensor, root: int, ranks: Sequence[int], direction: str, kind: str) -> None:
        if t.numel() == 0:
            return
        dist.broadcast(t, src=root, group=self.group(ranks))
        if self.rank == root:
            self.traffic.add(direction, "intra", kind, self.wire_bytes(t) * (len(ranks) - 1), len(ranks) - 1)

    # -- the two halves (implemented by the placement-specific subclasses) -------------
    def forward(self, tensor: Optional[torch.Tensor], counts: Optional[torch.Tensor], window=None,
                backward: bool = True) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def backward(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        raise NotImplementedError
