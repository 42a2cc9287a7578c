"""Greedy number partitioning (longest processing time first), and dealing in rounds.

With a cardinality cap (microbatches of equal size) a full bin simply leaves
the heap. One heap operation per item keeps a step of thousands of samples
in the low milliseconds; `snake` needs no loop at all.
"""

from __future__ import annotations

import heapq
from typing import List, Sequence, Tuple

import numpy as np


def dealt(weights: np.ndarray, bins: int, tie: np.ndarray | None = None) -> np.ndarray:
    """Bin of every item, each bin getting exactly ``len(weights) / bins`` items.

    Items are taken heaviest first (ties: heavier ``tie`` first), each to the least-loaded
    bin that still has room (ties: lighter ``tie`` load). A bin holding a huge item gets
    nothing until the others catch up, then the light items that remain."""
    n = len(weights)
    if n % bins:
        raise ValueError(f"{n} items do not deal evenly into {bins} bins")
    cap = n // bins
    tie = np.zeros(n) if tie is None else np.asarray(tie, dtype=np.float64)
    order = np.lexsort((-tie, -weights)).tolist()        # heaviest first
    w, t = np.asarray(weights, dtype=np.float64).tolist(), tie.tolist()
    heap = [(0.0, 0.0, b) for b in range(bins)]
    count = [0] * bins
    out = np.empty(n, dtype=np.int64)
    for i in order:
        load, tl, b = heapq.heappop(heap)
        out[i] = b
        count[b] += 1
        if count[b] < cap:
            heapq.heappush(heap, (load + w[i], tl + t[i], b))
    return out


def snake(order: np.ndarray, bins: int) -> np.ndarray:
    """Row b: the items bin b gets when ``order`` (heaviest first) is dealt in rounds of
    ``bins``, to bins 0 .. bins-1 in even rounds and bins-1 .. 0 in odd ones, so the bin that
    got the heavier item of one round gets the lighter of the next. Rows keep ``order``."""
    n = len(order)
    if n % bins:
        raise ValueError(f"{n} items do not deal evenly into {bins} bins")
    rounds = np.asarray(order).reshape(-1, bins).copy()
    rounds[1::2] = rounds[1::2, ::-1]
    return rounds.T


def greedy(weights: Sequence[float], bins: int, secondary: Sequence[float]) -> Tuple[List[int], List[int]]:
    """Min-max greedy without a cap, items in the given order: each goes to the bin of least
    load (ties: least ``secondary`` load, then lowest bin). Items of zero weight cannot raise
    any bin's load, so they go, after the others, to the bin of least secondary load.
    Returns the items in the order they were placed and the bin of each."""
    heap = [(0.0, 0.0, b) for b in range(bins)]        # (load, secondary load, bin)
    items = [i for i, w in enumerate(weights) if w > 0]
    zero = [i for i, w in enumerate(weights) if w <= 0]
    where = []
    replace = heapq.heapreplace
    for w, t in zip([weights[i] for i in items], [secondary[i] for i in items]):
        load, s, b = heap[0]
        where.append(b)
        replace(heap, (load + w, s + t, b))
    if zero:
        heap = sorted((s, b) for _, s, b in heap)           # a sorted list is a heap
        for t in [secondary[i] for i in zero]:
            s, b = heap[0]
            where.append(b)
            replace(heap, (s + t, b))
    return items + zero, where
