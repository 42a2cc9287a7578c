"""Edge plan: the static routing of one encoder -> LLM boundary, from two layouts.

Pure Python. Every rank computes the identical plan from (src layout, dst
layout, batch window), which is what lets both sides of an edge agree on who
sends what to whom without exchanging any routing information.

Batch semantics
---------------
One call of a communicator moves one *batch window* of ``B`` units, in batch
order. A unit is whatever the encoder's DP divides: an item (image, audio
clip) in training, a sample in the static default plan.

* non-colocated edge: the window is one LLM microbatch across all LLM DP
  shards (its ``micro_batch_size * dL`` samples' items);
* colocated edge: the window is what the shared ranks hold for the phase
  (every item of the step for the three-phase schedule).

Source DP shard ``i`` owns units ``[src_bounds[i], src_bounds[i+1])`` and
destination DP shard ``j`` owns ``[dst_bounds[j], dst_bounds[j+1])``; any
bounds are allowed, empty shards included, so the two DP sizes need not
divide each other. Training derives the bounds per window from the data
(``mimo.data.items``: items divided over encoder ranks by tokens, the LLM
shard's samples' items on the other side), identically on every rank, and
makes the window's plan with :meth:`EdgePlan.for_window`. Without bounds the
plan divides ``B`` equally on both sides -- the sample-level relations
*equal*, *fan-in* (dE > dL) and *fan-out* (dE < dL) are that special case.

A *piece* is the intersection of one source interval with one destination
interval: the unit that is moved. Pieces are listed in batch order. Every
route (who sends which piece to whom, forward and backward) is derived from
the pieces, so both ends of every transfer agree on it without messages.

Where the tensor lives: a source shard is held by every TP rank of that DP
shard on the source's *last* PP stage (encoders run with CP = EP = 1); a
destination shard is needed by every TP x CP rank of that DP shard on the
destination's *first* PP stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

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


class Pieces(Sequence):
    """A window's pieces in window order, made on demand from four arrays: a window's plan is built per
    call on every rank of the edge, and a rank reads only its own shards' pieces."""

    def __init__(self, starts: np.ndarray, stops: np.ndarray, i: np.ndarray, j: np.ndarray):
        self.starts, self.stops, self.i, self.j = starts, stops, i, j

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, k: int) -> Piece:
        if not -len(self) <= k < len(self):
            raise IndexError(f"piece {k} of {len(self)}")
        k %= len(self)
        return Piece(k, int(self.i[k]), int(self.j[k]), int(self.starts[k]), int(self.stops[k]))

    def run(self, a: int, b: int) -> List[Piece]:
        return [self[k] for k in range(a, b)]


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
    src_bounds: Optional[List[int]] = None  # dp + 1 unit offsets; default: equal intervals
    dst_bounds: Optional[List[int]] = None
    # Tokens of each unit of the window, when every rank knows them (the trainer does: it reads the
    # whole step). Then no rank sends per-unit counts and every buffer is sized on the host, with no
    # device-to-host copy in the step; without them the counts travel as metadata first.
    unit_tokens: Optional[List[int]] = None
    placement: str = field(init=False)
    relation: str = field(init=False)
    ratio: int = field(init=False)
    pieces: Pieces = field(init=False)

    def __post_init__(self):
        s, d, b = self.src, self.dst, self.batch_window
        # The destination (LLM)'s ep / etp re-divide its own ranks for its experts: the boundary
        # sees its dense grid only.
        if s.cp != 1 or s.ep != 1:
            raise ValueError(f"source layout must have cp=1 and ep=1 at a boundary (got cp={s.cp}, ep={s.ep})")
        if b < 0 or (b == 0 and self.src_bounds is None):
            raise ValueError(f"batch window must be positive (got {b})")
        for name, dp, attr in (("source", s.dp, "src_bounds"), ("destination", d.dp, "dst_bounds")):
            bounds = getattr(self, attr)
            if bounds is None:
                if b % dp:
                    raise ValueError(f"batch window {b} is not divisible by the {name} DP size {dp}")
                setattr(self, attr, [k * (b // dp) for k in range(dp + 1)])
            elif (len(bounds) != dp + 1 or bounds[0] != 0 or bounds[-1] != b
                  or bool((np.diff(np.asarray(bounds, dtype=np.int64)) < 0).any())):
                raise ValueError(f"{name} bounds {list(bounds)} must be {dp + 1} non-decreasing offsets "
                                 f"from 0 to the batch window {b}")
        if self.unit_tokens is not None and len(self.unit_tokens) != b:
            raise ValueError(f"unit_tokens has {len(self.unit_tokens)} entries for a batch window of {b} units")
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
        return self.src_bounds[i], self.src_bounds[i + 1]

    def dst_interval(self, j: int) -> Tuple[int, int]:
        return self.dst_bounds[j], self.dst_bounds[j + 1]

    def for_window(self, src_bounds: List[int], dst_bounds: List[int],
                   unit_tokens: Optional[List[int]] = None) -> "EdgePlan":
        """The same edge for one window whose units are divided by the given bounds (and, if known
        to every rank, hold the given numbers of tokens)."""
        return type(self)(self.src, self.dst, src_bounds[-1], list(src_bounds), list(dst_bounds),
                          None if unit_tokens is None else list(unit_tokens))

    def _pieces(self) -> Pieces:
        """The non-empty intersections of source and destination shards, in window order. Every point
        where a shard of either side starts cuts the window, and each stretch between two cuts lies in
        exactly one shard of each side: the pieces are those stretches (built per window on every rank
        of the edge, so done in numpy, linear in the DP sizes)."""
        src = np.asarray(self.src_bounds, dtype=np.int64)
        dst = np.asarray(self.dst_bounds, dtype=np.int64)
        cuts = np.union1d(src, dst)
        starts = cuts[:-1]
        # The shard holding a piece: the last one starting at or before it (empty shards start there too).
        return Pieces(starts, cuts[1:], np.searchsorted(src, starts, "right") - 1,
                      np.searchsorted(dst, starts, "right") - 1)

    def pieces_of_src(self, i: int) -> List[Piece]:
        p = self.pieces
        return p.run(int(np.searchsorted(p.i, i, "left")), int(np.searchsorted(p.i, i, "right")))

    def pieces_of_dst(self, j: int) -> List[Piece]:
        p = self.pieces
        return p.run(int(np.searchsorted(p.j, j, "left")), int(np.searchsorted(p.j, j, "right")))

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
        """
        out: Dict[str, List[List[int]]] = {}
        if self.placement == NON_COLOCATED:
            out["src_tp"] = [self.src_holders(i) for i in range(self.src.dp)]
            out["dst_tpcp"] = [self.dst_receivers(j) for j in range(self.dst.dp)]
            out["dst_cp"] = [self.dst_cp_group(j, 0) for j in range(self.dst.dp)]
        else:
            out["dst_cp"] = [self.dst_cp_group(j, t) for j in range(self.dst.dp) for t in range(self.dst.tp)]
        return {k: [g for g in v if len(g) > 1] for k, v in out.items()}

    # -- routes -------------------------------------------------------------------
    def colocated_forward_routes(self) -> Tuple[List[Route], List[Route]]:
        """(transfers, local copies) that give every destination receiver its pieces.

        A receiver that holds the piece's source shard itself copies it locally
        (with sample-level equal DP and fan-out everything is rank-local);
        otherwise one holder is chosen deterministically, spreading receivers
        over holders. With a destination PP > 1 the transfers also carry
        shards held on later-stage ranks to the first-stage ranks.
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

    def colocated_forward_moves_of(self, rank: int) -> Tuple[List[Route], List[Route]]:
        """(sends, receives) of `rank` among `colocated_forward_routes`' transfers, in its order, found
        from this rank's own shards: the work does not grow with the number of ranks of the edge."""
        return self._moves_of(rank, (self.src_shard_of(rank), self.pieces_of_src, self.src_holders, "i"),
                              (self.dst_shard_of(rank), self.pieces_of_dst, self.dst_receivers, "j"))

    def colocated_backward_moves_of(self, rank: int) -> Tuple[List[Route], List[Route]]:
        """(sends, receives) of `rank` among `colocated_backward_routes`' transfers, in its order."""
        return self._moves_of(rank, (self.dst_shard_of(rank), self.pieces_of_dst, self.dst_receivers, "j"),
                              (self.src_shard_of(rank), self.pieces_of_src, self.src_holders, "i"))

    @staticmethod
    def _moves_of(rank: int, serving, served) -> Tuple[List[Route], List[Route]]:
        """One direction's moves of `rank`. Each side is (this rank's shard on that side or None, the
        pieces of a shard, the ranks of a shard, the piece field naming that side's shard). A piece
        moves from the serving side to each served rank that does not hold it already, from the
        serving rank at the served rank's position modulo their number (`colocated_*_routes`)."""
        serving_shard, serving_pieces, serving_ranks, serving_field = serving
        served_shard, served_pieces, served_ranks, served_field = served
        sends = []
        if serving_shard is not None:  # this rank serves
            mine = serving_ranks(serving_shard)
            h = mine.index(rank)
            for p in serving_pieces(serving_shard):
                theirs = getattr(p, served_field)
                for k, r in enumerate(served_ranks(theirs)):
                    if r not in mine and k % len(mine) == h:
                        sends.append(((theirs, k, p.index), Route(p.index, rank, r)))
        recvs = []
        if served_shard is not None:  # this rank is served
            k = served_ranks(served_shard).index(rank)
            for p in served_pieces(served_shard):
                servers = serving_ranks(getattr(p, serving_field))
                if rank not in servers:
                    recvs.append(Route(p.index, servers[k % len(servers)], rank))
        # The full listing's order: the served shard, the served rank's position, the piece.
        return [m for _, m in sorted(sends, key=lambda e: e[0])], recvs

    def describe(self) -> str:
        rel = f"dp {self.src.dp}:{self.dst.dp}"
        s, d = self.src, self.dst
        return (f"{self.placement} {rel} src(tp{s.tp} dp{s.dp} pp{s.pp} @{s.rank_offset}) -> "
                f"dst(tp{d.tp} cp{d.cp} dp{d.dp} pp{d.pp} @{d.rank_offset}) B={self.batch_window}")


def make_plan(src: Layout, dst: Layout, batch_window: Optional[int] = None) -> EdgePlan:
    """The edge's static plan: equal sample intervals over a window of `batch_window` samples,
    or, with None, an empty window (every call then passes its own plan, `for_window`)."""
    if batch_window is None:
        return EdgePlan(src, dst, 0, [0] * (src.dp + 1), [0] * (dst.dp + 1))
    return EdgePlan(src, dst, batch_window)
