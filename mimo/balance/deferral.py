"""Entrain's pairwise deferral as a bottleneck assignment (dissertation section 4.5.2).

Microbatches sorted by LLM work split into overloaded (top half) and
underloaded ones. For a pair (i, j) the best deferral moves the subset of i's
samples whose LLM work is closest to half the difference; that is a subset
sum, solved by dynamic programming over work rounded to ``resolution`` units
(the reachable sums of i do not depend on j, so one table per overloaded
microbatch serves every partner). ``V[i, j]`` is the pair's larger load after
deferral; the smallest threshold T that every overloaded microbatch meets,
alone (its own load) or with a distinct partner (``V <= T``), is found by
binary search over the candidate values, each checked by bipartite matching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class SubsetTable:
    """Reachable rounded sums of a microbatch's samples, as bitsets (Python ints: bit s is set
    when some subset sums to s), one per prefix of the samples to reconstruct subsets."""
    units: List[int]          # rounded work of each sample
    prefixes: List[int]       # prefixes[k]: sums reachable with the first k samples

    @classmethod
    def build(cls, work: Sequence[float], unit: float) -> "SubsetTable":
        units = np.maximum(0, np.rint(np.asarray(work, dtype=np.float64) / unit)).astype(np.int64).tolist()
        reach, prefixes = 1, [1]
        for u in units:
            reach |= reach << u
            prefixes.append(reach)
        return cls(units, prefixes)

    def closest(self, target: float) -> int:
        """The reachable sum closest to ``target`` (the smaller one on a tie)."""
        reach = self.prefixes[-1]
        t = max(0, math.floor(target))
        below = (reach & ((2 << t) - 1)).bit_length() - 1      # highest set bit <= t (0 is always set)
        rest = reach >> (t + 1)
        if not rest:
            return below
        above = t + (rest & -rest).bit_length()                  # lowest set bit > t
        return below if target - below <= above - target else above

    def subset(self, total: int) -> List[int]:
        """Positions of samples whose rounded work sums to ``total`` (a reachable sum)."""
        out = []
        for k in range(len(self.units), 0, -1):
            if not (self.prefixes[k - 1] >> total) & 1:   # unreachable without sample k-1: take it
                out.append(k - 1)
                total -= self.units[k - 1]
        return out[::-1]


def _match(V: List[List[float]], T: float, rows: Sequence[int]) -> Optional[Dict[int, int]]:
    """A distinct partner column with ``V[r][c] <= T`` for every row in ``rows`` (augmenting
    paths, lightest partner first: the last column is the lightest), or None."""
    owner: Dict[int, int] = {}
    cols = range(len(V[0]) - 1, -1, -1) if V else range(0)

    def augment(r: int, seen: set) -> bool:
        row = V[r]
        for c in cols:
            if row[c] > T or c in seen:
                continue
            seen.add(c)
            if c not in owner or augment(owner[c], seen):
                owner[c] = r
                return True
        return False

    for r in rows:
        if not augment(r, set()):
            return None
    return {r: c for c, r in owner.items()}


def bottleneck_pairs(over: np.ndarray, under: np.ndarray, V: np.ndarray) -> Tuple[float, Dict[int, int]]:
    """Smallest T and a pairing (overloaded row -> underloaded column) meeting it.

    ``over``/``under``: loads of the two halves, each heaviest first (len(under) >= len(over));
    ``V[i, j]``: the pair's bottleneck after its best deferral. A row with ``over[i] <= T``
    needs no partner."""
    floor = float(under.max()) if under.size else 0.0
    cands = np.unique(np.concatenate([V.ravel(), over]))
    cands = cands[cands >= floor].tolist()
    rows_v, loads = V.tolist(), over.tolist()
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        T = cands[mid]
        match = _match(rows_v, T, [i for i, load in enumerate(loads) if load > T])
        if match is None:
            lo = mid + 1
        else:
            best, hi = (T, match), mid - 1
    return best


def defer(loads: np.ndarray, members: Sequence[Sequence[int]], llm: np.ndarray,
          resolution: int = 1024) -> Tuple[List[Tuple[int, Optional[int], List[int]]], float]:
    """Pairs (overloaded mb, underloaded partner or None, samples deferred) in execution order,
    and the threshold T*. Every pair defers its own best subset: critical ones as matched,
    the others with the partner left to them (never above T*)."""
    K = len(loads)
    by_load = np.argsort(-loads, kind="stable")
    ol, ul = by_load[:K // 2], by_load[K // 2:]
    if len(ol) == 0 or loads.max() <= 0:
        return [(int(k), None, []) for k in by_load], float(loads.max(initial=0.0))
    unit = float(loads.max()) / resolution
    tables = [SubsetTable.build(llm[list(members[i])], unit) for i in ol]
    delta = (loads[ol][:, None] - loads[ul][None, :]) / 2 / unit
    moved = np.array([[t.closest(d) for d in row] for t, row in zip(tables, delta.tolist())]) * unit
    V = np.maximum(loads[ol][:, None] - moved, loads[ul][None, :] + moved)
    T, match = bottleneck_pairs(loads[ol], loads[ul], V)
    # Rows without a critical partner take the remaining columns, heaviest row with lightest column.
    free = [c for c in range(len(ul))[::-1] if c not in match.values()]
    for r in range(len(ol)):
        if r not in match:
            match[r] = free.pop(0)
    pairs = []
    for r in range(len(ol)):
        c = match[r]
        t = tables[r]
        chosen = t.subset(int(round(moved[r, c] / unit)))
        pairs.append((int(ol[r]), int(ul[c]), [members[ol[r]][p] for p in chosen]))
    pairs += [(int(ul[c]), None, []) for c in free]
    return pairs, T
