"""Colocated communicator: one rank range seen through two logical grids.

Each rank knows, from the plan, which source shard it holds (encoder last PP
stage) and which destination shard it must materialise (LLM first PP stage).
Every destination rank assembles its shard piece by piece in batch order: a
piece whose source shard the rank holds itself is sliced locally; any other
piece arrives point-to-point from one deterministic holder.

With PP = 1 on both sides this is exactly the shared-rank transform: equal DP
is rank-local; fan-in all-gathers among the ranks whose source intervals form
one destination shard, and its backward selects the rank's own interval
locally; fan-out selects locally, and its backward all-gathers the sibling
gradient intervals. The plan recognises these all-gather patterns
(``EdgePlan.colocated_gathers``) and they run as real all-gathers, padded to
the longest member's token count since pieces hold different token counts.
With a destination PP > 1, ranks of later LLM stages hold encoder shards too;
their pieces travel to the first-stage ranks and the gradients come back the
same way. TP / CP differences only change who receives: every TP x CP rank of
a destination shard gets the full shard.

Backward: each destination rank first sums the CP-partial gradients over its
CP group (all-reduce, so every replica can serve as a gradient source); then
each source holder assembles the gradient of its interval from local slices
and transfers. Point-to-point backward needs no metadata (both sides recorded
the counts); a gathered backward exchanges each member's token count to pad.

Local pieces are rounded through the wire dtype like transferred ones, so
replicas of one shard stay bitwise identical whatever path their pieces took.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .base import TAG_BWD, TAG_FWD, TAG_META, BoundaryCommunicator, cumulative


class ColocatedCommunicator(BoundaryCommunicator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        r, plan = self.rank, self.plan
        self._gather, self._send, self._recv = {}, {}, {}
        for d, moves in (("fwd", plan.colocated_forward_routes()[0]), ("bwd", plan.colocated_backward_routes()[0])):
            gathers = plan.colocated_gathers(d)
            if gathers is not None:  # all-gather mode: None here means this rank exchanges nothing
                self._gather[d] = next(((m, c) for m, c in gathers if r in m), None)
            self._send[d] = [m for m in moves if m.src == r]
            self._recv[d] = {m.piece: m.src for m in moves if m.dst == r}

    # -- exchanges: -> ({piece: wire payload}, {piece: sample counts}) of pieces from other ranks ---
    def _p2p(self, d: str, local_piece, counts_of):
        """Point-to-point transfers of direction d.

        local_piece(k) -> (meta or None, wire payload) of piece k held here;
        counts_of(k) -> the sample counts of a received piece k (forward: None,
        then metadata is exchanged first).
        """
        pieces, works, keep = self.plan.pieces, [], []
        tag = TAG_FWD if d == "fwd" else TAG_BWD
        for m in self._send[d]:
            meta, payload = local_piece(m.piece)
            if meta is not None:
                keep.append(meta)
                works.append(self.isend(meta, m.dst, TAG_META))
                self.traffic.add(d, "intra", "meta", meta.numel() * 8)
            if payload.numel() > 0:
                keep.append(payload)
                works.append(self.isend(payload, m.dst, tag))
                self.traffic.add(d, "intra", "payload", self.wire_bytes(payload))
        metas = {}
        for k, src in self._recv[d].items():
            metas[k] = counts_of(k)
            if metas[k] is None:
                metas[k] = self.empty_counts(pieces[k].samples)
                self.irecv(metas[k], src, TAG_META).wait()
        bufs = {}
        for k, src in self._recv[d].items():
            bufs[k] = self.empty_wire(int(metas[k].sum()))
            if bufs[k].numel() > 0:
                works.append(self.irecv(bufs[k], src, tag))
        for w in works:
            w.wait()
        return bufs, metas

    def _all_gather(self, d: str, local_piece):
        """The same exchange when it is an all-gather: every member contributes one piece."""
        if self._gather[d] is None:
            return {}, {}
        members, contrib = self._gather[d]
        group = self.group(members)
        order = dist.get_process_group_ranks(group)  # all_gather lists results in group-rank order
        n = len(order)
        meta, payload = local_piece(contrib[self.rank])
        if meta is not None:
            metas = [self.empty_counts(meta.numel()) for _ in order]
            dist.all_gather(metas, meta, group=group)
            self.traffic.add(d, "intra", "meta", (n - 1) * meta.numel() * 8, n - 1)
            tokens = [int(m.sum()) for m in metas]
        else:
            sizes = [self.empty_counts(1) for _ in order]
            dist.all_gather(sizes, torch.tensor([payload.shape[0]], dtype=torch.int64, device=self.device), group=group)
            self.traffic.add(d, "intra", "meta", (n - 1) * 8, n - 1)
            tokens, metas = [int(x) for x in sizes], [None] * n
        longest = max(tokens)
        outs = [self.empty_wire(longest) for _ in order]
        if longest > 0:
            padded = torch.zeros(longest, self.hidden, dtype=self.wire_dtype, device=self.device)
            padded[:payload.shape[0]] = payload
            dist.all_gather(outs, padded, group=group)
            self.traffic.add(d, "intra", "payload", (n - 1) * self.wire_bytes(padded), n - 1)
        bufs, got_metas = {}, {}
        for idx, r in enumerate(order):
            if r != self.rank:
                bufs[contrib[r]] = outs[idx][:tokens[idx]]
                got_metas[contrib[r]] = metas[idx]
        return bufs, got_metas

    def _exchange(self, d, local_piece, counts_of):
        if d in self._gather:
            return self._all_gather(d, local_piece)
        return self._p2p(d, local_piece, counts_of)

    # -- the two halves ---------------------------------------------------------------
    def forward(self, tensor: Optional[torch.Tensor], counts: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        tensor, counts = self._check_source(tensor, counts)
        plan, role = self.plan, self.role
        if self.is_source:
            s0, scum = plan.src_interval(role.src_shard)[0], cumulative(counts)

        def local_piece(k):  # a piece of this rank's source shard
            a, b, t0, t1 = self.piece_range(plan.pieces[k], s0, scum)
            return counts[a:b].contiguous(), self.to_wire(tensor[t0:t1])

        if (self._send["fwd"] or (self._gather.get("fwd") is not None)) and not self.is_source:
            raise RuntimeError(f"rank {self.rank} is routed to send pieces but holds no source shard")
        bufs, metas = self._exchange("fwd", local_piece, lambda k: None)
        out, ctx = None, {"src": counts}
        if self.is_destination:
            parts: List[torch.Tensor] = []
            part_counts: List[torch.Tensor] = []
            for p in plan.pieces_of_dst(role.dst_shard):
                if p.index in bufs:
                    parts.append(self.from_wire(bufs[p.index]))
                    part_counts.append(metas[p.index])
                else:  # this rank holds the piece's source shard
                    meta, payload = local_piece(p.index)
                    parts.append(self.from_wire(payload))  # rounded like a transferred piece
                    part_counts.append(meta)
            out = torch.cat(parts)
            ctx["dst"] = torch.cat(part_counts)
            self.received_counts = ctx["dst"]
        self._saved.append(ctx)
        return out

    def backward(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        ctx, grad = self._pop_checked(grad)
        plan, role = self.plan, self.role
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

        def local_piece(k):  # the gradient of a piece of this rank's destination shard
            _, _, t0, t1 = self.piece_range(plan.pieces[k], d0, dcum)
            return None, self.to_wire(grad[t0:t1])

        def counts_of(k):  # a piece of this rank's source shard: its counts were recorded in forward
            a, b, _, _ = self.piece_range(plan.pieces[k], s0, scum)
            return ctx["src"][a:b]

        bufs, _ = self._exchange("bwd", local_piece, counts_of)
        if not self.is_source:
            return None
        parts = []
        for p in plan.pieces_of_src(role.src_shard):
            if p.index in bufs:
                parts.append(self.from_wire(bufs[p.index]))
            else:  # this rank also received the piece's destination shard
                parts.append(self.from_wire(local_piece(p.index)[1]))
        return torch.cat(parts)
