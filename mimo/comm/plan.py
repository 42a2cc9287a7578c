"""Edge plan: the static routing of one encoder -> LLM boundary, from two layouts.

Pure Python. Every rank computes the identical plan from (src layout, dst
layout, batch window), which is what lets both sides of an edge agree on who
sends what to whom without exchanging any routing information.

Batch semantics
---------------
One call of a communicator moves one *batch window* of ``B`` samples.

* non-colocated edge: ``B = micro_batch_size * dL`` -- one LLM microbatch
  across all LLM DP shards;
* colocated edge: ``B`` = the samples the shared ranks hold for the phase
  (e.g. every sample of the step for the three-phase schedule).

Source DP shard ``i`` of ``dE`` owns samples ``[i*B/dE, (i+1)*B/dE)``;
destination DP shard ``j`` of ``dL`` owns ``[j*B/dL, (j+1)*B/dL)``. The
relation is *equal* (dE == dL), *fan-in* (dE > dL: dE/dL source shards are
concatenated in batch order into one destination shard) or *fan-out*
(dE < dL: one source shard is split into dL/dE destination shards). Either DP
must divide the other; other ratios are rejected.

A *piece* is the intersection of one source interval with one destination
interval: the unit that is moved. Pieces are listed in batch order.

Where the tensor lives: a source shard is held by every TP rank of that DP
shard on the source's *last* PP stage (encoders run with CP = EP = 1); a
destination shard is needed by every TP x CP rank of that DP shard on the
destination's *first* PP stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from mimo.topology.layout import Layout

COLOCATED, NON_COLOCATED = "colocated", "non-colocated"
EQUAL, FAN_IN, FAN_OUT = "equal", "fan-in", "fan-out"


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) of the window, moving from source shard i to destination shard j."""

    index: int
    i: int
    j: int
    start: int
    stop: int

    @property
    def samples(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Route:
    """One point-to-point transfer of piece `piece` from rank `src` to rank `dst`."""

    piece: int
    src: int
    dst: int


@dataclass
class RankRole:
    rank: int
    src_coords: Optional[Dict[str, int]]
    dst_coords: Optional[Dict[str, int]]
    src_shard: Optional[int]  # the source shard this rank holds, if any
    dst_shard: Optional[int]  # the destination shard this rank receives, if any
    is_src_leader: bool
    is_dst_leader: bool


def placement_of(src: Layout, dst: Layout) -> str:
    a, b = set(src.ranks), set(dst.ranks)
    if a == b:
        return COLOCATED
    if a.isdisjoint(b):
        return NON_COLOCATED
    raise ValueError(f"source ranks [{src.ranks.start}, {src.ranks.stop}) and destination ranks "
                     f"[{dst.ranks.start}, {dst.ranks.stop}) partially overlap: an edge must be "
                     "colocated (same ranks) or non-colocated (disjoint ranks)")


@dataclass
class EdgePlan:
    src: Layout
    dst: Layout
    batch_window: int
    placement: str = field(init=False)
    relation: str = field(init=False)
    ratio: int = field(init=False)
    pieces: List[Piece] = field(init=False)

    def __post_init__(self):
        s, d, b = self.src, self.dst, self.batch_window
        if s.cp != 1 or s.ep != 1:
            raise ValueError(f"source layout must have cp=1 and ep=1 at a boundary (got cp={s.cp}, ep={s.ep})")
        if d.ep != 1:
            raise ValueError(f"destination layout must have ep=1 at a boundary (got ep={d.ep})")
        if b <= 0:
            raise ValueError(f"batch window must be positive (got {b})")
        for name, dp in (("source", s.dp), ("destination", d.dp)):
            if b % dp:
                raise ValueError(f"batch window {b} is not divisible by the {name} DP size {dp}")
        if s.dp % d.dp and d.dp % s.dp:
            raise ValueError(f"source DP {s.dp} and destination DP {d.dp}: one must divide the other "
                             "(equal, fan-in or fan-out)")
        self.placement = placement_of(s, d)
        if s.dp == d.dp:
            self.relation, self.ratio = EQUAL, 1
        elif s.dp > d.dp:
            self.relation, self.ratio = FAN_IN, s.dp // d.dp
        else:
            self.relation, self.ratio = FAN_OUT, d.dp // s.dp
        self.pieces = self._pieces()

    # -- intervals ---------------------------------------------------------
    def src_interval(self, i: int) -> Tuple[int, int]:
        n = self.batch_window // self.src.dp
        return i * n, (i + 1) * n

    def dst_interval(self, j: int) -> Tuple[int, int]:
        n = self.batch_window // self.dst.dp
        return j * n, (j + 1) * n

    def _pieces(self) -> List[Piece]:
        out = []
        for j in range(self.dst.dp):
            d0, d1 = self.dst_interval(j)
            for i in range(self.src.dp):
                s0, s1 = self.src_interval(i)
                lo, hi = max(s0, d0), min(s1, d1)
                if lo < hi:
                    out.append(Piece(len(out), i, j, lo, hi))
        out.sort(key=lambda p: p.start)
        return [Piece(k, p.i, p.j, p.start, p.stop) for k, p in enumerate(out)]

    def pieces_of_src(self, i: int) -> List[Piece]:
        return [p for p in self.pieces if p.i == i]

    def pieces_of_dst(self, j: int) -> List[Piece]:
        return [p for p in self.pieces if p.j == j]

    # -- where shards live ---------------------------------------------------
    def src_holders(self, i: int) -> List[int]:
        """Ranks holding source shard i: its TP ranks on the last PP stage (tp order)."""
        return [self.src.rank(tp=t, dp=i, pp=self.src.pp - 1) for t in range(self.src.tp)]

    def dst_receivers(self, j: int) -> List[int]:
        """Ranks needing destination shard j: its TP x CP ranks on the first PP stage (tp fastest)."""
        return [self.dst.rank(tp=t, cp=c, dp=j, pp=0) for c in range(self.dst.cp) for t in range(self.dst.tp)]

    def src_leader(self, i: int) -> int:
        return self.src.rank(tp=0, dp=i, pp=self.src.pp - 1)

    def dst_leader(self, j: int) -> int:
        return self.dst.rank(tp=0, cp=0, dp=j, pp=0)

    def dst_cp_group(self, j: int, t: int) -> List[int]:
        """First-stage ranks of destination shard j with TP coordinate t (one per CP rank)."""
        return [self.dst.rank(tp=t, cp=c, dp=j, pp=0) for c in range(self.dst.cp)]

    def src_shard_of(self, rank: int) -> Optional[int]:
        if not self.src.contains(rank):
            return None
        c = self.src.coords(rank)
        return c["dp"] if c["pp"] == self.src.pp - 1 else None

    def dst_shard_of(self, rank: int) -> Optional[int]:
        if not self.dst.contains(rank):
            return None
        c = self.dst.coords(rank)
        return c["dp"] if c["pp"] == 0 else None

    def role(self, rank: int) -> RankRole:
        i, j = self.src_shard_of(rank), self.dst_shard_of(rank)
        return RankRole(
            rank=rank,
            src_coords=self.src.coords(rank) if self.src.contains(rank) else None,
            dst_coords=self.dst.coords(rank) if self.dst.contains(rank) else None,
            src_shard=i, dst_shard=j,
            is_src_leader=i is not None and self.src_leader(i) == rank,
            is_dst_leader=j is not None and self.dst_leader(j) == rank,
        )

    # -- groups (rank lists, deterministic order) ------------------------------
    def groups(self) -> Dict[str, List[List[int]]]:
        """Local collective groups the communicator needs, each of size > 1.

        src_tp:  per source shard, its last-stage TP ranks (leader broadcasts gradients);
        dst_tpcp: per destination shard, its first-stage TP x CP ranks (leader broadcasts activations);
        dst_cp:  first-stage CP ranks of a destination shard (per-CP partial gradients are summed):
                 non-colocated, only the leader's (TP rank 0) -- the other TP replicas are identical;
                 colocated, one per TP coordinate, since any replica may serve a gradient piece;
        fwd_gather / bwd_gather: colocated all-gather groups (see colocated_gathers).
        """
        out: Dict[str, List[List[int]]] = {}
        if self.placement == NON_COLOCATED:
            out["src_tp"] = [self.src_holders(i) for i in range(self.src.dp)]
            out["dst_tpcp"] = [self.dst_receivers(j) for j in range(self.dst.dp)]
            out["dst_cp"] = [self.dst_cp_group(j, 0) for j in range(self.dst.dp)]
        else:
            out["dst_cp"] = [self.dst_cp_group(j, t) for j in range(self.dst.dp) for t in range(self.dst.tp)]
            for d in ("fwd", "bwd"):
                out[f"{d}_gather"] = [members for members, _ in (self.colocated_gathers(d) or [])]
        return {k: [g for g in v if len(g) > 1] for k, v in out.items()}

    # -- routes -------------------------------------------------------------------
    def leader_routes(self) -> List[Route]:
        """Non-colocated forward routes: source leader -> destination leader, one per piece.

        Backward uses the same routes reversed.
        """
        return [Route(p.index, self.src_leader(p.i), self.dst_leader(p.j)) for p in self.pieces]

    def colocated_forward_routes(self) -> Tuple[List[Route], List[Route]]:
        """(transfers, local copies) that give every destination receiver its pieces.

        A receiver that holds the piece's source shard itself copies it locally
        (equal DP and fan-out are then entirely rank-local); otherwise one
        holder is chosen deterministically, spreading receivers over holders.
        For aligned fan-in the transfers are exactly the all-gather among the
        ranks whose source intervals form one destination shard; with a
        destination PP > 1 they also carry shards held on later-stage ranks to
        the first-stage ranks.
        """
        moves, local = [], []
        for j in range(self.dst.dp):
            receivers = self.dst_receivers(j)
            for k, r in enumerate(receivers):
                for p in self.pieces_of_dst(j):
                    holders = self.src_holders(p.i)
                    if r in holders:
                        local.append(Route(p.index, r, r))
                    else:
                        moves.append(Route(p.index, holders[k % len(holders)], r))
        return moves, local

    def colocated_backward_routes(self) -> Tuple[List[Route], List[Route]]:
        """(transfers, local copies) that give every source holder its gradient pieces.

        Destination ranks have summed their CP partials first, so any receiver
        of shard j can supply the gradient of a piece of j.
        """
        moves, local = [], []
        for i in range(self.src.dp):
            holders = self.src_holders(i)
            for k, s in enumerate(holders):
                for p in self.pieces_of_src(i):
                    receivers = self.dst_receivers(p.j)
                    if s in receivers:
                        local.append(Route(p.index, s, s))
                    else:
                        moves.append(Route(p.index, receivers[k % len(receivers)], s))
        return moves, local

    def colocated_gathers(self, direction: str) -> Optional[List[Tuple[List[int], Dict[int, int]]]]:
        """The transfers of `direction` ("fwd" / "bwd") as disjoint all-gathers, if they are exactly that.

        Returns [(sorted member ranks, {member: piece it contributes})] when
        the transfers split into groups in which every member sends one piece
        (the same to every other member, pieces of equal sample count) and
        receives every other member's piece -- the aligned fan-in forward and
        fan-out backward. Otherwise None, and point-to-point transfers are
        used (e.g. destination PP > 1, where stage-1 ranks only send).
        """
        if self.placement != COLOCATED:
            return None
        moves = (self.colocated_forward_routes() if direction == "fwd" else self.colocated_backward_routes())[0]
        if not moves:
            return []
        parent: Dict[int, int] = {}

        def find(x):
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for m in moves:
            parent[find(m.src)] = find(m.dst)
        comps: Dict[int, List[int]] = {}
        for r in sorted(parent):
            comps.setdefault(find(r), []).append(r)
        out = []
        for members in sorted(comps.values()):
            inside = [m for m in moves if m.src in members]
            sent: Dict[int, set] = {}
            for m in inside:
                sent.setdefault(m.src, set()).add(m.piece)
            if set(sent) != set(members) or any(len(v) != 1 for v in sent.values()):
                return None
            contrib = {r: next(iter(v)) for r, v in sent.items()}
            expected = {(contrib[a], a, b) for a in members for b in members if a != b}
            if {(m.piece, m.src, m.dst) for m in inside} != expected or len(inside) != len(expected):
                return None
            if len({self.pieces[p].samples for p in contrib.values()}) != 1:
                return None
            out.append((members, contrib))
        return out

    def describe(self) -> str:
        rel = {EQUAL: "equal", FAN_IN: f"fan-in {self.ratio}:1", FAN_OUT: f"fan-out 1:{self.ratio}"}[self.relation]
        s, d = self.src, self.dst
        return (f"{self.placement} {rel} src(tp{s.tp} dp{s.dp} pp{s.pp} @{s.rank_offset}) -> "
                f"dst(tp{d.tp} cp{d.cp} dp{d.dp} pp{d.pp} @{d.rank_offset}) B={self.batch_window}")


def make_plan(src: Layout, dst: Layout, batch_window: int) -> EdgePlan:
    return EdgePlan(src, dst, batch_window)
