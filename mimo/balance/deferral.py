"""Entrain's pairwise deferral as a bottleneck assignment (dissertation section 4.5.2).

Microbatches sorted by LLM work split into overloaded (top half) and
underloaded ones. For a pair (i, j) the best deferral moves the subset of i's
samples whose LLM work is closest to half the difference; that is a subset
sum, solved by dynamic programming over work rounded to ``resolution`` units
(the reachable sums of i do not depend on j, so one table per overloaded
microbatch serves every partner, and all pairs are looked up at once).
``V[i, j]`` is the pair's larger load after deferral; the smallest threshold
T that every overloaded microbatch meets, alone (its own load) or with a
distinct partner (``V <= T``), is found by binary search over the candidate
values, each checked by bipartite matching.
"""

from __future__ import annotations

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
    def build(cls, units: Sequence[int]) -> "SubsetTable":
        reach, prefixes = 1, [1]
        for u in units:
            reach |= reach << u
            prefixes.append(reach)
        return cls(list(units), prefixes)

    def subset(self, total: int) -> List[int]:
        """Positions of samples whose rounded work sums to ``total`` (a reachable sum)."""
        out = []
        for k in range(len(self.units), 0, -1):
            if not (self.prefixes[k - 1] >> total) & 1:   # unreachable without sample k-1: take it
                out.append(k - 1)
                total -= self.units[k - 1]
        return out[::-1]


def closest_sums(tables: Sequence[SubsetTable], targets: np.ndarray) -> np.ndarray:
    """``out[r, c]``: the sum reachable in ``tables[r]`` closest to ``targets[r, c]`` (>= 0; the
    smaller sum on a tie). One numpy pass over every table: the set bits of all bitsets,
    keyed ``row * width + sum``, form one sorted array that a binary search answers."""
    width = max(t.prefixes[-1].bit_length() for t in tables) + 1
    nbytes = (width + 7) // 8
    raw = b"".join(t.prefixes[-1].to_bytes(nbytes, "little") for t in tables)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little").reshape(len(tables), -1)
    keys = np.flatnonzero(bits)                        # row * (8 * nbytes) + sum, ascending
    stride = 8 * nbytes
    base = (np.arange(len(tables)) * stride)[:, None]
    t = np.clip(np.floor(targets).astype(np.int64), 0, width - 1)
    at = np.searchsorted(keys, base + t, side="right")  # keys[at - 1]: highest sum <= t (0 is always set)
    lo = keys[at - 1] - base
    nxt = keys[np.minimum(at, len(keys) - 1)] - base
    hi = np.where((at < len(keys)) & (nxt < stride), nxt, -1)  # lowest sum > t in the same row, or none
    return np.where((hi < 0) | (targets - lo <= hi - targets), lo, hi)


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
    # No T below the lightest microbatch's load, nor below any row's best option (alone or
    # with its best partner): those candidates cannot pass, so they are not tried.
    floor = max(float(under.max()) if under.size else 0.0,
                float(np.minimum(over, V.min(axis=1, initial=np.inf)).max(initial=0.0)))
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


def defer(loads: np.ndarray, members: Sequence[Sequence[Sequence[int]]], llm: np.ndarray,
          resolution: int = 1024) -> List[Tuple[List[Tuple[int, Optional[int], List[int]]], float]]:
    """Per replica (``loads[d]``: its microbatches' LLM loads, ``members[d]``: their samples):
    pairs (overloaded mb, underloaded partner or None, samples deferred) in execution order,
    and the threshold T*. Every pair defers its own best subset: critical ones as matched,
    the others with the partner left to them (never above T*). The subset-sum lookups of
    every replica run as one batch."""
    K = loads.shape[1]
    by_load = np.argsort(-loads, axis=1, kind="stable")
    top = loads.max(axis=1, initial=0.0)
    units = top / resolution
    split = [d for d in range(len(loads)) if K // 2 and top[d] > 0]
    # Rounded work of every sample of every overloaded microbatch, in one numpy pass.
    flat, unit_of, sizes = [], [], []
    for d in split:
        for i in by_load[d, :K // 2]:
            flat += members[d][i]
            sizes.append(len(members[d][i]))
            unit_of.append(units[d])
    rounded = np.maximum(0, np.rint(llm[flat] / np.repeat(unit_of, sizes))).astype(np.int64).tolist()
    tables, start = [], 0
    for size in sizes:
        tables.append(SubsetTable.build(rounded[start:start + size]))
        start += size
    deltas = [(loads[d, by_load[d, :K // 2]][:, None] - loads[d, by_load[d, K // 2:]][None, :]) / 2 / units[d]
              for d in split]
    sums = closest_sums(tables, np.concatenate(deltas)) if tables else None
    out = [([(int(k), None, []) for k in by_load[d]], float(top[d])) for d in range(len(loads))]
    for n, d in enumerate(split):
        r0 = n * (K // 2)
        out[d] = _pairs(loads[d], by_load[d], members[d], tables[r0:r0 + K // 2], sums[r0:r0 + K // 2], units[d])
    return out


def _pairs(loads, by_load, members, tables, sums, unit):
    K = len(loads)
    ol, ul = by_load[:K // 2], by_load[K // 2:]
    moved = sums * unit
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
        chosen = tables[r].subset(int(sums[r, c]))
        pairs.append((int(ol[r]), int(ul[c]), [members[ol[r]][p] for p in chosen]))
    pairs += [(int(ul[c]), None, []) for c in free]
    return pairs, T
