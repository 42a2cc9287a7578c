"""Entrain's pairwise deferral as a bottleneck assignment (dissertation section 4.5.2).

Microbatches sorted by LLM work split into overloaded (top half) and
underloaded ones. For a pair (i, j) the best deferral moves the subset of i's
samples whose LLM work is closest to half the difference; that is a subset
sum, solved by dynamic programming over work rounded to ``resolution`` units
(the reachable sums of i do not depend on j, so one table per overloaded
microbatch serves every partner, and all pairs are looked up at once).
``V[i, j]`` is the pair's larger load after deferral; the smallest threshold
T that every overloaded microbatch meets, alone (its own load) or with a
distinct partner (``V <= T``), is found by search over the sorted candidate
values (galloping up from the lowest that can pass, then bisecting), each
checked by bipartite matching.
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

    @property
    def movable(self) -> int:
        """Sums of the subsets that may be deferred: any but the whole microbatch, whose LLM side
        would be left empty. With every unit positive only the whole set reaches the total; a
        sample of zero units is never taken (`subset` leaves what it need not take), so then the
        total leaves that sample behind."""
        reach = self.prefixes[-1]
        if self.units and min(self.units) > 0:
            reach &= ~(1 << sum(self.units))
        return reach

    def subset(self, total: int) -> List[int]:
        """Positions of samples whose rounded work sums to ``total`` (a reachable sum)."""
        out = []
        for k in range(len(self.units), 0, -1):
            if total == 0:                                 # the empty rest: nothing more to take
                break
            if not (self.prefixes[k - 1] >> total) & 1:   # unreachable without sample k-1: take it
                out.append(k - 1)
                total -= self.units[k - 1]
        return out[::-1]


def closest_sums(tables: Sequence[SubsetTable], targets: np.ndarray) -> np.ndarray:
    """``out[r, c]``: the movable sum of ``tables[r]`` closest to ``targets[r, c]`` (>= 0; the
    smaller sum on a tie). One numpy pass over every table: the set bits of all bitsets,
    keyed ``row * width + sum``, form one sorted array that a binary search answers."""
    reach = [t.movable for t in tables]
    width = max(r.bit_length() for r in reach) + 1
    nbytes = (width + 7) // 8
    raw = b"".join(r.to_bytes(nbytes, "little") for r in reach)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    keys = np.flatnonzero(bits.view(bool))             # row * (8 * nbytes) + sum, ascending
    stride = 8 * nbytes
    base = (np.arange(len(tables)) * stride)[:, None]
    t = np.minimum(np.maximum(np.floor(targets).astype(np.int64), 0), width - 1)
    at = np.searchsorted(keys, base + t, side="right")  # keys[at - 1]: highest sum <= t (0 is always set)
    lo = keys[at - 1] - base
    nxt = keys[np.minimum(at, len(keys) - 1)] - base
    hi = np.where((at < len(keys)) & (nxt < stride), nxt, -1)  # lowest sum > t in the same row, or none
    return np.where((hi < 0) | (targets - lo <= hi - targets), lo, hi)


def _match(adjacent: List[int], rows: Sequence[int]) -> Optional[Dict[int, int]]:
    """A distinct partner column for every row in ``rows`` (bit c of ``adjacent[r]``: column c
    may partner row r), or None.

    Augmenting paths (Kuhn); a row first takes its lightest free partner (the highest column
    is the lightest) and only then displaces an earlier row, lightest partner first. Rows
    come heaviest first, so the heaviest overloaded microbatch gets the lightest partner it
    can, as in a fold."""
    owner: Dict[int, int] = {}
    taken = 0                                               # bitset of owned columns

    def augment(r: int, seen: List[int]) -> bool:
        nonlocal taken
        free = adjacent[r] & ~taken
        if free:
            c = free.bit_length() - 1
            owner[c] = r
            taken |= 1 << c
            return True
        rest = adjacent[r] & ~seen[0]
        while rest:
            c = rest.bit_length() - 1
            rest &= ~(1 << c)
            if seen[0] >> c & 1:                            # seen deeper down meanwhile
                continue
            seen[0] |= 1 << c
            if augment(owner[c], seen):
                owner[c] = r
                return True
        return False

    for r in rows:
        if not augment(r, [0]):
            return None
    return {r: c for c, r in owner.items()}


def bottleneck_pairs(over: np.ndarray, under: np.ndarray, V: np.ndarray) -> Tuple[float, Dict[int, int]]:
    """Smallest T and a pairing (overloaded row -> underloaded column) meeting it.

    ``over``/``under``: loads of the two halves, each heaviest first (len(under) >= len(over));
    ``V[i, j]``: the pair's bottleneck after its best deferral. A row with ``over[i] <= T``
    needs no partner."""
    # No T below the heaviest underloaded microbatch's load, nor below any row's best option (alone or
    # with its best partner): those candidates cannot pass, so they are not tried.
    floor = max(float(under.max()) if under.size else 0.0,
                float(np.minimum(over, V.min(axis=1)).max()) if V.size else 0.0)
    cands = np.sort(np.concatenate([V.ravel(), over]))       # repeated values cost a check at most
    cands = cands[np.searchsorted(cands, floor):].tolist()
    loads = over.tolist()

    def check(k: int) -> Optional[Dict[int, int]]:
        T = cands[k]
        packed = np.packbits(V <= T, axis=1, bitorder="little")   # row r: bit c set where V[r, c] <= T
        stride = 8 * packed.shape[1]
        every, row = int.from_bytes(packed.tobytes(), "little"), (1 << stride) - 1
        adjacent = [(every >> (r * stride)) & row for r in range(len(loads))]
        return _match(adjacent, [i for i, load in enumerate(loads) if load > T])

    # T* is mostly the lowest candidate: gallop up from it (1, 2, 4, ... steps), then bisect.
    lo, step, hi, best = 0, 1, len(cands) - 1, None
    while lo <= hi:
        k = min(lo + step - 1, hi)
        match = check(k)
        if match is not None:
            best, hi = (cands[k], match), k - 1
            break
        lo, step = k + 1, 2 * step
    while lo <= hi:
        mid = (lo + hi) // 2
        match = check(mid)
        if match is None:
            lo = mid + 1
        else:
            best, hi = (cands[mid], match), mid - 1
    return best


def defer(loads: np.ndarray, members: Sequence[Sequence[Sequence[int]]], llm: np.ndarray,
          resolution: int = 1024) -> List[Tuple[List[Tuple[int, Optional[int], List[int]]], float]]:
    """Per replica (``loads[d]``: its microbatches' LLM loads, ``members[d]``: their samples):
    pairs (overloaded mb, underloaded partner or None, samples deferred) in execution order,
    and the threshold T*. Every pair defers its own best subset: critical ones as matched,
    the others with the partner left to them (never above T*). Every replica's subset-sum
    lookups and bottleneck matrix are computed together."""
    D, K = loads.shape
    h = K // 2
    by_load = np.argsort(-loads, axis=1, kind="stable")
    top = loads.max(axis=1) if K else np.zeros(D)
    split = np.flatnonzero(top > 0) if h else np.zeros(0, dtype=np.int64)
    out: List = [None] * D
    for d in sorted(set(range(D)) - set(split.tolist())):    # nothing to defer
        out[d] = ([(int(k), None, []) for k in by_load[d]], float(top[d]))
    if not len(split):
        return out
    ol, ul = by_load[split, :h], by_load[split, h:]
    over = np.take_along_axis(loads[split], ol, axis=1)
    under = np.take_along_axis(loads[split], ul, axis=1)
    units = top[split] / resolution
    # Rounded work of every sample of every overloaded microbatch, in one numpy pass.
    flat, sizes = [], []
    for d, rows in zip(split.tolist(), ol.tolist()):
        for i in rows:
            flat += members[d][i]
            sizes.append(len(members[d][i]))
    rounded = np.maximum(0, np.rint(llm[flat] / np.repeat(np.repeat(units, h), sizes))).astype(np.int64).tolist()
    tables, start = [], 0
    for size in sizes:
        tables.append(SubsetTable.build(rounded[start:start + size]))
        start += size
    delta = (over[:, :, None] - under[:, None, :]) / 2 / units[:, None, None]
    sums = closest_sums(tables, delta.reshape(len(split) * h, -1)).reshape(delta.shape)
    moved = sums * units[:, None, None]
    V = np.maximum(over[:, :, None] - moved, under[:, None, :] + moved)
    for n, d in enumerate(split.tolist()):
        T, match = bottleneck_pairs(over[n], under[n], V[n])
        # Rows without a critical partner take the remaining columns, heaviest row with lightest column.
        taken = set(match.values())
        free = [c for c in range(K - h - 1, -1, -1) if c not in taken]
        for r in range(h):
            if r not in match:
                match[r] = free.pop(0)
        o, u, mbs = ol[n].tolist(), ul[n].tolist(), members[d]
        pairs = []
        for r in range(h):
            c = match[r]
            moved = [mbs[o[r]][p] for p in tables[n * h + r].subset(int(sums[n, r, c]))]
            # The subset was chosen on rounded work: a move whose exact work leaves the pair no
            # lighter than its overloaded microbatch alone is not made.
            exact = sum(llm[i] for i in moved)
            if moved and max(over[n, r] - exact, under[n, c] + exact) >= over[n, r]:
                moved = []
            pairs.append((o[r], u[c], moved))
        out[d] = (pairs + [(u[c], None, []) for c in free], T)
    return out
