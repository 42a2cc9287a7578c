"""Entrain's hierarchical microbatch assignment (dissertation Algorithm 4).

1. DP level: samples, heaviest encoder work first (ties: heaviest LLM work
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
   for the encoder, and the greedy is blind to which of them lands where.
   Swapping such samples between a replica's heaviest and lightest LLM
   microbatch keeps every encoder load exactly and evens out the LLM loads
   deferral starts from.
4. Pairwise deferral (`deferral.defer`): each overloaded microbatch runs right
   before its underloaded partner, whose LLM microbatch also runs the deferred
   samples: order ol0, ul0, ol1, ul1, ...
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .assignment import StepAssignment, _micro_batch_size
from .deferral import defer
from .lpt import greedy, snake


def stratified(enc: np.ndarray, llm: np.ndarray, samples: np.ndarray, microbatches: int) -> List[List[int]]:
    """Encoder microbatches (global sample indices) of one replica."""
    longest = np.argsort(-llm[samples], kind="stable")
    coarse, fine = samples[longest[:microbatches]], samples[longest[microbatches:]]
    ordered = np.concatenate([part[np.lexsort((-llm[part], -enc[part]))] for part in (coarse, fine)])
    bins = greedy(enc[ordered].tolist(), microbatches, llm[ordered].tolist())
    ordered = ordered.tolist()
    return [[ordered[i] for i in b] for b in bins]


def swap_ties(enc: np.ndarray, llm: np.ndarray,
              replicas: List[List[List[int]]]) -> Tuple[List[List[List[int]]], np.ndarray]:
    """Each replica's microbatches after at most M swaps, and their LLM loads.

    A swap exchanges a sample of the heaviest LLM microbatch with one of the lightest that
    has the same encoder work and less LLM work, the pair whose difference is closest to
    half the gap (first such pair on a tie); a replica with no pair that narrows the gap
    stops. Every replica's rounds run together on padded (replica, microbatch, slot) arrays."""
    D, M, n = len(replicas), len(replicas[0]), len(llm)
    width = max(len(mb) for rank in replicas for mb in rank)
    mem = np.full((D, M, width), n, dtype=np.int64)       # slot n: no sample
    for d, rank in enumerate(replicas):
        for k, mb in enumerate(rank):
            mem[d, k, :len(mb)] = mb
    e_nan, l_nan = np.append(enc, np.nan), np.append(llm, np.nan)   # NaN never equals: no swap
    l_zero = np.append(llm, 0.0)
    loads = np.zeros((D, M))
    for p in range(width):                                  # sums in list order, as sum() adds
        loads += l_zero[mem[:, :, p]]
    rows, active = np.arange(D), np.ones(D, dtype=bool)
    for _ in range(M):
        h, lo = loads.argmax(1), loads.argmin(1)
        gap = loads[rows, h] - loads[rows, lo]
        H, L = mem[rows, h], mem[rows, lo]                   # (D, width) each
        diff = l_nan[H][:, :, None] - l_nan[L][:, None, :]
        ok = ((e_nan[H][:, :, None] == e_nan[L][:, None, :]) & (diff > 0) & (diff < gap[:, None, None])
              & active[:, None, None])
        active = ok.any(axis=(1, 2))
        if not active.any():
            break
        best = np.where(ok, np.abs(diff - (gap / 2)[:, None, None]), np.inf).reshape(D, -1).argmin(1)
        r = np.flatnonzero(active)
        i, j = best[r] // width, best[r] % width
        a, b = H[r, i], L[r, j]
        mem[r, h[r], i], mem[r, lo[r], j] = b, a
        moved = diff[r, i, j]
        loads[r, h[r]] -= moved
        loads[r, lo[r]] += moved
    out = [[[i for i in mb if i < n] for mb in rank] for rank in mem.tolist()]
    fresh = np.zeros((D, M))
    for p in range(width):
        fresh += l_zero[mem[:, :, p]]
    return out, fresh


def entrain(enc: np.ndarray, llm: np.ndarray, dp: int, microbatches: int, resolution: int = 1024) -> StepAssignment:
    _micro_batch_size(len(llm), dp, microbatches)
    of_sample = snake(enc, dp, tie=llm)
    mine = np.argsort(of_sample, kind="stable").reshape(dp, -1)     # row d: replica d's samples
    replicas, loads = swap_ties(enc, llm, [stratified(enc, llm, s, microbatches) for s in mine])
    encoder, llm_side = [], []
    for mbs, (pairs, _) in zip(replicas, defer(loads, replicas, llm, resolution)):
        e_out, l_out = [], []
        for first, partner, moved in pairs:
            keep = set(moved)
            e_out.append(mbs[first])
            l_out.append([i for i in mbs[first] if i not in keep] if keep else list(mbs[first]))
            if partner is not None:
                e_out.append(mbs[partner])
                l_out.append(mbs[partner] + moved)
        encoder.append(e_out)
        llm_side.append(l_out)
    return StepAssignment(encoder, llm_side)
