"""Inter-GPU workload balancing for context parallelism (Cornstarch §5.1).

The sequence is cut into blocks of ``block_size`` tokens. The attention work of
a query block is the number of ``block_size x block_size`` tiles of its row
that are not entirely masked out (the kernels skip empty tiles), summed over
the batch. Blocks are then dealt to the ``cp_size`` ranks of a context-parallel
group by one of four policies:

``lpt``        longest-processing-time first (Graham's greedy): blocks in
               descending workload order, each to the least-loaded rank that
               still has room. Every rank ends with floor(n/cp) or ceil(n/cp)
               blocks, so ranks also get the same number of tokens (±1 block):
               the linear layers around attention stay balanced and the
               padded local length (all ranks run the same shape) wastes at
               most one block.
``lpt_free``   the same greedy without the per-rank block cap (Cornstarch's
               Algorithm 2 as published); better attention balance in some
               cases, but token counts per rank may differ widely.
``zigzag``     megatron-style: 2*cp chunks, rank r gets chunks r and 2cp-1-r.
``contiguous`` cp consecutive chunks.
``random``     a seeded random permutation cut into cp equal chunks.

Chunking rule (zigzag, contiguous, random) when ``n`` is not divisible: chunk
``c`` of ``m`` is blocks ``[c*n//m, (c+1)*n//m)``, so chunk sizes differ by at
most one (and chunks are empty when ``n < m``).

Tile test. Per block we record which distinct live mask values occur (a token
is live when its low bits are non-zero; padding never attends nor is seen),
plus the block's document range. A tile (qb, kb) is counted when, for some
value u present in qb and some value w present in kb,
  * u is causal, ``u & w & LOW != 0`` and kb <= qb, or
  * u is not causal and ``u & LOW == w & LOW``,
and the two blocks' document ranges overlap. Positions are the token indices
(the causal test of the contract). Without document ids this test is
**exact**: for kb < qb every key precedes every query, for kb > qb none does,
and a diagonal tile is non-empty iff its block holds a live token (a live
token always sees itself), which is what the value test says there too. With
document ids it is **conservative**: exact when no live block spans two
documents, otherwise it may over-count tiles that pair a block straddling a
document boundary (values of one document matched with values of another).
Document ids that are not non-decreasing along each row (over live tokens)
are ignored (still conservative).
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence

import numpy as np
import torch

from .mask import CAUSAL, LOW

POLICIES = ("lpt", "lpt_free", "zigzag", "contiguous", "random")
_NEG = -(1 << 62)


def _as_2d(mask: torch.Tensor, document_ids: Optional[torch.Tensor]):
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int64:
        raise TypeError("mask must be an int64 bitfield tensor [b, s] or [s]")
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
        if document_ids is not None and document_ids.dim() == 1:
            document_ids = document_ids.unsqueeze(0)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [b, s] or [s], got shape {tuple(mask.shape)}")
    if document_ids is not None:
        if tuple(document_ids.shape) != tuple(mask.shape):
            raise ValueError(f"document_ids shape {tuple(document_ids.shape)} differs from mask {tuple(mask.shape)}")
        document_ids = document_ids.to(torch.int64)
    return mask, document_ids


def num_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def block_workloads(mask: torch.Tensor, block_size: int = 128,
                    document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-empty tiles per query block, summed over the batch: int64 [ceil(s / block_size)].

    See the module docstring for the tile test (exact without document ids,
    conservative with them). Computed on the CPU with numpy: the tokens are
    read once to cut them into runs of equal (value, document) that never
    cross a block; everything after that works on runs and blocks, so a
    1M-token sequence costs a few passes over memory, not a sort.
    """
    _check_block_size(block_size)
    mask, docs = _as_2d(mask, document_ids)
    m = mask.cpu().numpy()
    b, s = m.shape
    n = num_blocks(s, block_size)
    if b == 0 or n == 0:
        return torch.zeros(n, dtype=torch.int64)
    N = b * n                                                        # flattened (row, block)
    v = m.reshape(-1)
    d = None
    if docs is not None:
        d = docs.cpu().numpy().reshape(-1)
    # Run starts: value or document changes, and every block / row start.
    change = np.empty(b * s, dtype=bool)
    change[0] = True
    np.not_equal(v[1:], v[:-1], out=change[1:])
    if d is not None:
        change[1:] |= d[1:] != d[:-1]
    change.reshape(b, s)[:, ::block_size] = True
    starts = np.flatnonzero(change)
    row, col = np.divmod(starts, s)
    rv = v[starts]
    live = (rv & LOW) != 0                                           # a token is live by its low bits
    if not live.any():
        return torch.zeros(n, dtype=torch.int64)
    starts, row, rv = starts[live], row[live], rv[live]
    rb = row * n + col[live] // block_size                           # flattened block of each live run
    # Document key of each live run; rows are separate documents. Keys that are
    # not non-decreasing along the flattened live tokens are ignored.
    if d is not None:
        dl = d[starts] - int(d.min())
        key = row * (int(dl.max()) + 1) + dl
        if key.size > 1 and bool((key[1:] < key[:-1]).any()):
            key = row
    else:
        key = row

    values, inv = np.unique(rv, return_inverse=True)
    n_val = values.size
    presence = np.zeros((N, n_val), dtype=bool)
    presence[rb, inv] = True
    # Live runs are in block order: per block, first run index -> min / max document key.
    first = np.flatnonzero(np.r_[True, rb[1:] != rb[:-1]])
    lb = rb[first]
    dmin = np.full(N, _NEG, dtype=np.int64)
    dmax = np.full(N, _NEG, dtype=np.int64)
    dmin[lb] = np.minimum.reduceat(key, first)
    dmax[lb] = np.maximum.reduceat(key, first)
    has_live = np.zeros(N, dtype=bool)
    has_live[lb] = True
    dmax_f = np.maximum.accumulate(dmax)                            # dead blocks inherit, stays sorted
    dmin_f = np.where(has_live, dmin, dmax_f)

    # Value compatibility (u: query value, w: key value), lifted to groups of
    # blocks with the same value set.
    u_low, u_causal = values & LOW, (values & CAUSAL) != 0
    overlap = (u_low[:, None] & u_low[None, :]) != 0
    comp_causal = (u_causal[:, None] & overlap).astype(np.float32)   # needs kb <= qb
    comp_bidir = ((~u_causal)[:, None] & (u_low[:, None] == u_low[None, :])).astype(np.float32)
    if n_val < 63:
        code = presence.astype(np.int64) @ (np.int64(1) << np.arange(n_val, dtype=np.int64))
        _, first_of, group_of = np.unique(code, return_index=True, return_inverse=True)
        groups = presence[first_of]
    else:
        groups, group_of = np.unique(presence, axis=0, return_inverse=True)
    group_of = group_of.reshape(-1)
    n_grp = groups.shape[0]
    gf = groups.astype(np.float32)
    pair_causal = (gf @ comp_causal @ gf.T) > 0                      # [g_q, g_k]
    pair_bidir = (gf @ comp_bidir @ gf.T) > 0

    out = np.zeros(N, dtype=np.int64)
    q_idx = lb                                                       # blocks with a live token
    lo = np.searchsorted(dmax_f, dmin[q_idx], side="left")           # first kb with dmax >= q's dmin
    hi = np.searchsorted(dmin_f, dmax[q_idx], side="right")          # first kb with dmin > q's dmax
    hi_causal = np.maximum(np.minimum(hi, q_idx + 1), lo)            # causal: kb <= qb
    gq = group_of[q_idx]
    # Members of each key group in an index range, by prefix sums over blocks.
    for g in range(n_grp):
        cum = np.zeros(N + 1, dtype=np.int64)
        np.cumsum(group_of == g, out=cum[1:])
        bid = pair_bidir[gq, g]
        cau = pair_causal[gq, g] & ~bid
        base = cum[lo]
        out[q_idx] += np.where(bid, cum[hi] - base, 0) + np.where(cau, cum[hi_causal] - base, 0)
    return torch.from_numpy(out.reshape(b, n).sum(axis=0))


# ---------------------------------------------------------------------------------------------
# Assignment policies


def _chunks(items: Sequence[int], m: int) -> List[List[int]]:
    n = len(items)
    return [list(items[c * n // m:(c + 1) * n // m]) for c in range(m)]


def _lpt(work: List[int], cp: int, balanced_counts: bool) -> List[List[int]]:
    """Greedy LPT; with ``balanced_counts`` every rank ends with floor(n/cp) or ceil(n/cp) blocks.

    Blocks go in (descending work, index) order, each to the rank with the
    smallest (load, blocks, rank) that still has room. The heap holds that
    triple packed into one integer, ``(load * (n + 1) + blocks) * cp + rank``
    (same order, cheaper to compare), so a 8192-block plan takes a few ms."""
    n = len(work)
    order = np.lexsort((np.arange(n), -np.asarray(work, dtype=np.int64))).tolist() if n else []
    lo_cap, n_big = n // cp, n % cp                                  # n_big ranks may hold lo_cap + 1
    big_used = 0
    unit = (n + 1) * cp
    heap = list(range(cp))                                           # load 0, no blocks, rank r
    counts = [0] * cp
    owned: List[List[int]] = [[] for _ in range(cp)]
    pop, replace = heapq.heappop, heapq.heapreplace
    for i in order:
        key = heap[0]
        r = key % cp
        if balanced_counts:
            while counts[r] > lo_cap or (counts[r] == lo_cap and big_used >= n_big):
                pop(heap)                                            # full ranks leave the heap
                key = heap[0]
                r = key % cp
            if counts[r] == lo_cap:
                big_used += 1
        owned[r].append(i)
        counts[r] += 1
        replace(heap, key + work[i] * unit + cp)
    return [sorted(o) for o in owned]


def assign_from_workloads(workloads, cp_size: int, policy: str = "lpt", seed: int = 0) -> List[List[int]]:
    """Each rank's block indices (ascending); every block exactly once."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    work = [int(w) for w in (workloads.tolist() if isinstance(workloads, torch.Tensor) else workloads)]
    n = len(work)
    if policy in ("lpt", "lpt_free"):
        return _lpt(work, cp_size, balanced_counts=policy == "lpt")
    if policy == "contiguous":
        return _chunks(list(range(n)), cp_size)
    if policy == "zigzag":
        chunks = _chunks(list(range(n)), 2 * cp_size)
        return [chunks[r] + chunks[2 * cp_size - 1 - r] for r in range(cp_size)]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    return [sorted(c) for c in _chunks(perm, cp_size)]


def assign_blocks(mask: torch.Tensor, cp_size: int, block_size: int = 128, policy: str = "lpt",
                  document_ids: Optional[torch.Tensor] = None, seed: int = 0) -> List[List[int]]:
    """Assign the mask's query blocks to ``cp_size`` ranks; see the module docstring for policies."""
    _check_block_size(block_size)
    if policy in ("lpt", "lpt_free"):
        work = block_workloads(mask, block_size, document_ids)
    else:
        mask2, _ = _as_2d(mask, document_ids)
        work = [0] * num_blocks(mask2.shape[1], block_size)
    return assign_from_workloads(work, cp_size, policy, seed)


def rank_workloads(assignment: Sequence[Sequence[int]], workloads) -> List[int]:
    w = workloads.tolist() if isinstance(workloads, torch.Tensor) else list(workloads)
    return [int(sum(w[i] for i in blocks)) for blocks in assignment]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean - 1 (0 when perfectly balanced or empty)."""
    mean = sum(loads) / len(loads) if loads else 0
    return (max(loads) / mean - 1.0) if mean > 0 else 0.0


def check_assignment(assignment: Sequence[Sequence[int]], n_blocks: int) -> None:
    """Raise if the assignment is not a partition of range(n_blocks) into ascending lists."""
    seen = []
    for r, blocks in enumerate(assignment):
        if list(blocks) != sorted(blocks):
            raise ValueError(f"rank {r}: block indices are not ascending")
        seen.extend(blocks)
    if sorted(seen) != list(range(n_blocks)):
        raise ValueError(f"assignment does not cover blocks 0..{n_blocks - 1} exactly once")
