"""Colocated communicator: one rank range seen through two logical grids.

Each rank knows, from the window's plan, which source shard it holds (encoder
last PP stage) and which destination shard it must materialise (LLM first PP
stage). Every destination rank assembles its shard piece by piece in batch
order: a piece whose source shard the rank holds itself is sliced locally; any
other piece arrives point-to-point from one deterministic holder. Sample-level
equal DP and fan-out are then entirely rank-local, fan-in moves the sibling
shards, and an item-level division moves exactly the items whose encoder rank
is not one of their LLM shard's ranks. With a destination PP > 1, ranks of
later LLM stages hold encoder shards too; their pieces travel to the
first-stage ranks and the gradients come back the same way. TP / CP
differences only change who receives: every TP x CP rank of a destination
shard gets the full shard.

An exchange is one ``batch_isend_irecv``: every rank lists its sends and its
receives in piece order, from the same plan. Forward first exchanges the
pieces' per-unit token counts, then their payloads (sizes from the counts);
a window whose unit sizes every rank knows (`EdgePlan.unit_tokens`) skips the
counts.

Backward: each destination rank first sums the CP-partial gradients over its
CP group (all-reduce, so every replica can serve as a gradient source); then
each source holder assembles the gradient of its interval from local slices
and transfers. Backward needs no metadata (both sides recorded the counts).

Local pieces are rounded through the wire dtype like transferred ones, so
replicas of one shard stay bitwise identical whatever path their pieces took.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .base import BoundaryCommunicator, cumulative, known_counts


class ColocatedCommunicator(BoundaryCommunicator):
    # -- the two halves ---------------------------------------------------------------
    def forward(self, tensor: Optional[torch.Tensor], counts: Optional[torch.Tensor],
                window=None, backward: bool = True) -> Optional[torch.Tensor]:
        plan = self._window(window)
        tensor, counts = self._check_source(tensor, counts, plan)
        role, r = self.role, self.rank
        sends, recvs = plan.colocated_forward_moves_of(r)
        if sends and not self.is_source:
            raise RuntimeError(f"rank {r} is routed to send pieces but holds no source shard")
        if self.is_source:
            s0, scum = plan.src_interval(role.src_shard)[0], cumulative(counts)

        def local_piece(k):  # (host counts, wire payload) of a piece of this rank's source shard
            a, b, t0, t1 = self.piece_range(plan.pieces[k], s0, scum)
            return counts[a:b], self.to_wire(tensor[t0:t1])

        if plan.unit_tokens is not None:  # every rank knows the sizes: no metadata travels
            out_meta = []
            metas = {m.piece: known_counts(plan, plan.pieces[m.piece].start, plan.pieces[m.piece].stop)
                     for m in recvs}
        else:
            out_meta = [(local_piece(m.piece)[0].to(self.device), m.dst) for m in sends]
            metas = {m.piece: self.empty_counts(plan.pieces[m.piece].samples) for m in recvs}
            self.exchange(out_meta, [(metas[m.piece], m.src) for m in recvs])
        out_payload = [(local_piece(m.piece)[1], m.dst) for m in sends]
        bufs = {k: self.empty_wire(int(c.sum())) for k, c in metas.items()}
        self.exchange(out_payload, [(bufs[m.piece], m.src) for m in recvs])
        for meta, _ in out_meta:
            if meta.numel():
                self.traffic.add("fwd", "intra", "meta", meta.numel() * 8)
        for payload, _ in out_payload:
            if payload.numel():
                self.traffic.add("fwd", "intra", "payload", self.wire_bytes(payload))

        out, ctx = None, {"src": counts, "plan": plan}
        if self.is_destination:
            parts: List[torch.Tensor] = []
            part_counts: List[torch.Tensor] = []
            for p in plan.pieces_of_dst(role.dst_shard):
                if p.index in bufs:
                    parts.append(self.from_wire(bufs[p.index]))
                    # Received metadata waits for the device here; known sizes are on the host already.
                    part_counts.append(metas[p.index].cpu())
                else:  # this rank holds the piece's source shard
                    meta, payload = local_piece(p.index)
                    parts.append(self.from_wire(payload))  # rounded like a transferred piece
                    part_counts.append(meta)
            out = torch.cat(parts) if parts else self.from_wire(self.empty_wire(0))
            ctx["dst"] = torch.cat(part_counts) if part_counts else torch.zeros(0, dtype=torch.int64)
            self.received_counts = ctx["dst"]
        if backward:  # a forward without a backward (frozen edge) keeps nothing
            self._saved.append(ctx)
        return out

    def backward(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        ctx, grad = self._pop_checked(grad)
        plan, role, r = ctx["plan"], self.role, self.rank
        if self.is_destination:
            dst_counts = ctx["dst"]
            cp_ranks = plan.dst_cp_group(role.dst_shard, role.dst_coords["tp"])
            if len(cp_ranks) > 1 and grad.numel() > 0:
                grad = grad.clone()  # all-reduce writes in place; the caller's gradient stays untouched
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group(cp_ranks))
                n = len(cp_ranks)
                self.traffic.add("bwd", "intra", "payload", 2 * (n - 1) * grad.numel() * grad.element_size() // n)
            d0, dcum = plan.dst_interval(role.dst_shard)[0], cumulative(dst_counts)
        if self.is_source:
            s0, scum = plan.src_interval(role.src_shard)[0], cumulative(ctx["src"])

        def local_grad(k):  # the gradient of a piece of this rank's destination shard
            _, _, t0, t1 = self.piece_range(plan.pieces[k], d0, dcum)
            return self.to_wire(grad[t0:t1])

        def piece_tokens(k):  # a piece of this rank's source shard: its counts were recorded in forward
            _, _, t0, t1 = self.piece_range(plan.pieces[k], s0, scum)
            return t1 - t0

        out_moves, in_moves = plan.colocated_backward_moves_of(r)
        sends = [(local_grad(m.piece), m.dst) for m in out_moves]
        bufs = {m.piece: (self.empty_wire(piece_tokens(m.piece)), m.src) for m in in_moves}
        self.exchange(sends, list(bufs.values()))
        for payload, _ in sends:
            if payload.numel():
                self.traffic.add("bwd", "intra", "payload", self.wire_bytes(payload))
        if not self.is_source:
            return None
        parts = []
        for p in plan.pieces_of_src(role.src_shard):
            if p.index in bufs:
                parts.append(self.from_wire(bufs[p.index][0]))
            else:  # this rank also received the piece's destination shard
                parts.append(self.from_wire(local_grad(p.index)))
        return torch.cat(parts) if parts else self.from_wire(self.empty_wire(0))
