"""Non-colocated communicator: disjoint rank ranges, traffic through boundary leaders.

Leaders: source shard i -> rank (tp=0, dp=i, last PP stage) of the source;
destination shard j -> rank (tp=0, cp=0, dp=j, first PP stage) of the LLM.
Only leaders cross the range boundary, one message pair (counts, payload) per
piece (the payload alone when the window knows its unit sizes), so the
cross-range volume follows the batch-shard relation (one copy of the boundary
tensor plus its counts) and never the product of TP widths.

Forward: each source leader sends every piece of its shard to the leader of
the destination shard containing it (fan-out splits, fan-in sends many to
one); the destination leader concatenates in batch order and broadcasts the
counts, then the payload, within its TP x CP group. Every CP rank therefore
holds the full shard and cuts out the part of the fused sequence it needs.

Forward and backward transfers of a rank are each one ``batch_isend_irecv``
(forward: counts first, unless known, then payloads), listed in piece order on
both ends.
The pieces come from the window's plan: with item-level encoder DP a source
leader sends only the runs of its own items, to the leaders of the LLM
shards holding their samples, and gets exactly their gradients back.

Backward: on each destination shard the CP partial gradients of the TP-rank-0
replica are summed onto the leader (TP replicas are identical: megatron
all-reduces the input gradient of the first layer over TP); the leader splits
the gradient along the recorded pieces and returns each to the source leader
that sent it; the source leader concatenates and broadcasts within its TP
group. Sizes are known from forward, so backward sends no metadata. When the
window's plan carries every unit's token count (`EdgePlan.unit_tokens`, as the
trainer's windows do), forward sends no metadata either: every rank sizes its
buffers on the host, and nothing waits for the device to learn a size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .base import BoundaryCommunicator, cumulative, known_counts


class NonColocatedCommunicator(BoundaryCommunicator):
    def forward(self, tensor: Optional[torch.Tensor], counts: Optional[torch.Tensor],
                window=None, backward: bool = True) -> Optional[torch.Tensor]:
        plan = self._window(window)
        tensor, counts = self._check_source(tensor, counts, plan)
        role, ctx = self.role, {"plan": plan}
        known = plan.unit_tokens is not None
        if self.is_source:
            i = role.src_shard
            ctx["src"] = (tuple(tensor.shape), counts)
            if role.is_src_leader:
                s0, cum, metas, payloads = plan.src_interval(i)[0], cumulative(counts), [], []
                for p in plan.pieces_of_src(i):
                    a, b, t0, t1 = self.piece_range(p, s0, cum)
                    dst = plan.dst_leader(p.j)
                    if not known:
                        metas.append((counts[a:b].to(self.device), dst))
                    payloads.append((self.to_wire(tensor[t0:t1]), dst))
                self.exchange(metas, [])
                self.exchange(payloads, [])
                for meta, dst in metas:
                    self.traffic.add("fwd", self.scope(self.rank, dst), "meta", meta.numel() * 8)
                for payload, dst in payloads:
                    if payload.numel():
                        self.traffic.add("fwd", self.scope(self.rank, dst), "payload", self.wire_bytes(payload))
        out = None
        if self.is_destination:
            j = role.dst_shard
            receivers = plan.dst_receivers(j)
            leader = plan.dst_leader(j)
            d0, d1 = plan.dst_interval(j)
            if role.is_dst_leader:
                pieces = plan.pieces_of_dst(j)
                if known:
                    metas = [known_counts(plan, p.start, p.stop) for p in pieces]
                else:
                    metas = [self.empty_counts(p.samples) for p in pieces]
                    self.exchange([], [(m, plan.src_leader(p.i)) for m, p in zip(metas, pieces)])
                bufs = [self.empty_wire(int(m.sum())) for m in metas]
                self.exchange([], [(buf, plan.src_leader(p.i)) for buf, p in zip(bufs, pieces)])
                dst_counts = torch.cat(metas) if metas else torch.zeros(0, dtype=torch.int64)
                wire = torch.cat(bufs) if bufs else self.empty_wire(0)
            else:
                dst_counts = known_counts(plan, d0, d1) if known else self.empty_counts(d1 - d0)
            if len(receivers) > 1:
                if not known:
                    self.broadcast(dst_counts, leader, receivers, "fwd", "meta")
                if not role.is_dst_leader:
                    wire = self.empty_wire(int(dst_counts.sum()))
                self.broadcast(wire, leader, receivers, "fwd", "payload")
            out = self.from_wire(wire)  # wire is a fresh buffer, so out never aliases the caller's tensor
            dst_counts = dst_counts.cpu()  # on the host already when the sizes are known
            ctx["dst"] = dst_counts
            self.received_counts = dst_counts
        if backward:  # a forward without a backward (frozen edge) keeps nothing
            self._saved.append(ctx)
        return out

    def backward(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        ctx, grad = self._pop_checked(grad)
        plan, role = ctx["plan"], self.role
        if self.is_destination:
            dst_counts = ctx["dst"]
            j = role.dst_shard
            if role.dst_coords["tp"] == 0:
                cp_ranks = plan.dst_cp_group(j, 0)
                leader = plan.dst_leader(j)
                if len(cp_ranks) > 1 and grad.numel() > 0:
                    grad = grad.clone()  # reduce writes in place; the caller's gradient stays untouched
                    dist.reduce(grad, dst=leader, op=dist.ReduceOp.SUM, group=self.group(cp_ranks))
                    if self.rank != leader:
                        self.traffic.add("bwd", "intra", "payload", grad.numel() * grad.element_size())
                if role.is_dst_leader:
                    d0, cum, sends = plan.dst_interval(j)[0], cumulative(dst_counts), []
                    for p in plan.pieces_of_dst(j):
                        _, _, t0, t1 = self.piece_range(p, d0, cum)
                        sends.append((self.to_wire(grad[t0:t1]), plan.src_leader(p.i)))
                    self.exchange(sends, [])
                    for payload, src in sends:
                        if payload.numel():
                            self.traffic.add("bwd", self.scope(self.rank, src), "payload", self.wire_bytes(payload))
        if not self.is_source:
            return None
        shape, counts = ctx["src"]
        i = role.src_shard
        holders = plan.src_holders(i)
        if role.is_src_leader:
            s0, cum = plan.src_interval(i)[0], cumulative(counts)
            bufs = []
            for p in plan.pieces_of_src(i):
                _, _, t0, t1 = self.piece_range(p, s0, cum)
                bufs.append((self.empty_wire(t1 - t0), plan.dst_leader(p.j)))
            self.exchange([], bufs)
            wire = torch.cat([b for b, _ in bufs]) if bufs else self.empty_wire(0)
        else:
            wire = self.empty_wire(shape[0])
        if len(holders) > 1:
            self.broadcast(wire, holders[0], holders, "bwd", "payload")
        return self.from_wire(wire)
