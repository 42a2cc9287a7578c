"""Entrain's hierarchical microbatch assignment (dissertation Algorithm 4).

1. DP level: samples, heaviest encoder work first (ties: most LLM work
   first), are dealt to the D replicas in rounds, alternating direction
   (`lpt.snake`), M*m each.
2. Stratified assignment per replica: the M samples of most LLM work form the
   coarse set (about one per microbatch), the rest the fine set; each set,
   heaviest encoder work first, goes min-max greedy onto the M encoder
   microbatches (coarse first; ties in encoder load: least LLM load). Both sets
   together are one list scheduling run over encoder work, so Graham's
   (2 - 1/M) bound holds, and every microbatch gets fine samples to defer
   later. Microbatch sizes may differ. Samples without encoder work cannot
   unbalance the encoder, so they go where the LLM work is least.
3. Tie swaps (`swap_ties`): samples of equal encoder work are interchangeable
   for the encoder, which does not care which of them lands where.
   Swapping such samples between a replica's heaviest and lightest LLM
   microbatch keeps every encoder load exactly and evens out the LLM loads
   deferral starts from.
4. Pairwise deferral (`deferral.defer`): each overloaded microbatch runs right
   before its underloaded partner, whose LLM microbatch also runs the deferred
   samples: order ol0, ul0, ol1, ul1, ...
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .assignment import StepAssignment, _micro_batch_size
from .deferral import defer
from .lpt import greedy, snake


def stratified(enc: np.ndarray, llm: np.ndarray, ranked: np.ndarray, microbatches: int) -> np.ndarray:
    """Encoder microbatches of every replica (``ranked[d]``: replica d's samples, heaviest
    encoder work first, ties: most LLM work first) as a padded array ``[replica, microbatch,
    slot]`` of sample indices (``len(llm)`` marks no sample), each microbatch's samples in the
    order the greedy placed them."""
    D, per = ranked.shape
    fine = np.ones((D, per), dtype=bool)
    np.put_along_axis(fine, np.argsort(-llm[ranked], axis=1, kind="stable")[:, :microbatches], False, axis=1)
    # Per replica: the coarse set, then the fine set, each in the ranked order.
    ordered = np.take_along_axis(ranked, np.argsort(fine, axis=1, kind="stable"), axis=1)
    placed, bins = [], []
    for row, w, s in zip(ordered.tolist(), enc[ordered].tolist(), llm[ordered].tolist()):
        items, b = greedy(w, microbatches, s)
        placed.append([row[i] for i in items])
        bins.append(b)
    group = (np.arange(D)[:, None] * microbatches + np.array(bins)).ravel()
    by_group = np.argsort(group, kind="stable")               # keeps the placing order in a microbatch
    counts = np.bincount(group, minlength=D * microbatches)
    starts = np.cumsum(counts) - counts
    slot = np.arange(len(group)) - np.repeat(starts, counts)
    mem = np.full((D * microbatches, max(int(counts.max()), 1)), len(llm), dtype=np.int64)
    mem[group[by_group], slot] = np.array(placed).ravel()[by_group]
    return mem.reshape(D, microbatches, -1)


def swap_ties(enc: np.ndarray, llm: np.ndarray, mem: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """`stratified`'s array after at most M swaps per replica, and the microbatches' LLM loads.

    A swap exchanges a sample of the heaviest LLM microbatch with one of the lightest that
    has the same encoder work and less LLM work, the pair whose difference is closest to
    half the gap (first such pair on a tie); a replica with no pair that narrows the gap
    stops. Every replica's rounds run together."""
    mem = mem.copy()
    D, M, width = mem.shape
    n = len(llm)
    e_nan, l_nan = np.append(enc, np.nan), np.append(llm, np.nan)   # NaN never equals: no swap
    l_zero = np.append(llm, 0.0)

    def loads() -> np.ndarray:
        out = np.zeros((D, M))
        for p in range(width):                              # sums in list order, as sum() adds
            out += l_zero[mem[:, :, p]]
        return out

    load, act = loads(), np.arange(D)                       # act: replicas still swapping
    for _ in range(M):
        here = load[act]
        rows = np.arange(len(act))
        h, lo = here.argmax(1), here.argmin(1)
        gap = here[rows, h] - here[rows, lo]
        H, L = mem[act, h], mem[act, lo]                     # (replicas, width) each
        diff = l_nan[H][:, :, None] - l_nan[L][:, None, :]
        ok = (e_nan[H][:, :, None] == e_nan[L][:, None, :]) & (diff > 0) & (diff < gap[:, None, None])
        r = np.flatnonzero(ok.any(axis=(1, 2)))
        if not len(r):
            break
        best = np.where(ok[r], np.abs(diff[r] - (gap[r] / 2)[:, None, None]), np.inf).reshape(len(r), -1).argmin(1)
        i, j = best // width, best % width
        d = act[r]
        mem[d, h[r], i], mem[d, lo[r], j] = L[r, j], H[r, i]
        moved = diff[r, i, j]
        load[d, h[r]] -= moved
        load[d, lo[r]] += moved
        act = d
    return mem, loads()


def entrain(enc: np.ndarray, llm: np.ndarray, dp: int, microbatches: int, resolution: int = 1024) -> StepAssignment:
    _micro_batch_size(len(llm), dp, microbatches)
    ranked = snake(np.lexsort((-llm, -enc)), dp)    # row d: replica d's samples, heaviest encoder work first
    mem, loads = swap_ties(enc, llm, stratified(enc, llm, ranked, microbatches))
    sizes = (mem < len(llm)).sum(axis=2).tolist()
    replicas = [[mb[:k] for mb, k in zip(rank, ks)] for rank, ks in zip(mem.tolist(), sizes)]
    encoder, llm_side = [], []
    for mbs, (pairs, _) in zip(replicas, defer(loads, replicas, llm, resolution)):
        e_out, l_out = [], []
        for first, partner, moved in pairs:
            e_out.append(mbs[first])
            l_out.append([i for i in mbs[first] if i not in moved] if moved else list(mbs[first]))
            if partner is not None:
                e_out.append(mbs[partner])
                l_out.append(mbs[partner] + moved)
        encoder.append(e_out)
        llm_side.append(l_out)
    return StepAssignment(encoder, llm_side)
