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
    conservative with them). Runs on the mask's device; CPU is fine.
    """
    _check_block_size(block_size)
    mask, docs = _as_2d(mask, document_ids)
    mask, docs = mask.cpu(), None if docs is None else docs.cpu()
    b, s = mask.shape
    n = num_blocks(s, block_size)
    if b == 0 or n == 0:
        return torch.zeros(n, dtype=torch.int64)
    pad = n * block_size - s
    m = torch.nn.functional.pad(mask, (0, pad))                      # padding is dead (0)
    live = (m & LOW) != 0
    # Distinct live values -> ids; dead tokens get id U (dropped below).
    values, inverse = torch.unique(torch.where(live, m, torch.zeros_like(m)), return_inverse=True)
    if values.numel() and values[0] == 0:
        values, inverse = values[1:], inverse - 1                    # id -1 = dead
    n_val = values.numel()
    N = b * n                                                        # flattened (row, block)
    if n_val == 0:
        return torch.zeros(n, dtype=torch.int64)
    blk = (torch.arange(b)[:, None] * n + torch.arange(n * block_size)[None, :] // block_size)  # [b, n*B]
    inv = inverse.reshape(b, -1)
    keep = inv >= 0
    presence = torch.zeros(N, n_val, dtype=torch.bool)
    presence[blk[keep], inv[keep]] = True

    # Value compatibility tables (u: query value, w: key value).
    u_low, u_causal = values & LOW, (values & CAUSAL) != 0
    overlap = (u_low[:, None] & u_low[None, :]) != 0
    comp_causal = (u_causal[:, None] & overlap).float()              # needs kb <= qb
    comp_bidir = ((~u_causal)[:, None] & (u_low[:, None] == u_low[None, :])).float()

    # Document range of each block over its live tokens; rows are separate documents.
    row = torch.arange(b)[:, None].expand(b, n * block_size)
    if docs is not None:
        d = torch.nn.functional.pad(docs, (0, pad))
        d = d - d.min()
        big = d.max() + 1
        key = row * big + d
        live_key = torch.where(live, key, torch.full_like(key, _NEG))
        prev = torch.cummax(live_key.reshape(-1), 0).values
        flat_live = live.reshape(-1)
        monotone = bool((prev[flat_live] == live_key.reshape(-1)[flat_live]).all())
        if not monotone:
            key = row
    else:
        key = row
    key = key.reshape(N, block_size)
    live_b = live.reshape(N, block_size)
    has_live = live_b.any(dim=1)
    dmax = torch.where(live_b, key, torch.full_like(key, _NEG)).amax(dim=1)
    dmin = torch.where(live_b, key, torch.full_like(key, -_NEG)).amin(dim=1)
    dmax_f = torch.cummax(dmax, 0).values                            # dead blocks inherit, stays sorted
    dmin_f = torch.where(has_live, dmin, dmax_f)

    # Group key blocks by their value set; count a group's members in an index range with
    # prefix sums. Chunked over groups and query blocks to bound memory.
    groups, group_of = torch.unique(presence, dim=0, return_inverse=True)
    n_grp = groups.shape[0]
    pf = presence.float()
    out = torch.zeros(N, dtype=torch.int64)
    q_idx = torch.nonzero(has_live).flatten()
    if q_idx.numel() == 0:
        return out.reshape(b, n).sum(dim=0)
    lo = torch.searchsorted(dmax_f, dmin[q_idx], right=False)         # first kb with dmax >= q's dmin
    hi = torch.searchsorted(dmin_f, dmax[q_idx], right=True)          # first kb with dmin > q's dmax
    hi_causal = torch.maximum(torch.minimum(hi, q_idx + 1), lo)       # causal: kb <= qb
    q_causal = pf[q_idx] @ comp_causal                                # [nq, U]
    q_bidir = pf[q_idx] @ comp_bidir
    g_chunk = max(1, (1 << 24) // (N + 1))
    for g0 in range(0, n_grp, g_chunk):
        g1 = min(n_grp, g0 + g_chunk)
        gf = groups[g0:g1].float()
        sel = (group_of >= g0) & (group_of < g1)
        cum = torch.zeros(g1 - g0, N + 1, dtype=torch.int32)
        pos = torch.nonzero(sel).flatten()
        cum[group_of[pos] - g0, pos + 1] = 1
        cum = torch.cumsum(cum, dim=1, dtype=torch.int32)             # [g, N+1]
        q_chunk = max(1, (1 << 22) // (g1 - g0))
        for s0 in range(0, q_idx.numel(), q_chunk):
            sl = slice(s0, s0 + q_chunk)
            a = (q_causal[sl] @ gf.T) > 0                             # [c, g]
            bb = (q_bidir[sl] @ gf.T) > 0
            base = cum[:, lo[sl]].T
            cnt_all = cum[:, hi[sl]].T - base
            cnt_causal = cum[:, hi_causal[sl]].T - base
            zero = torch.zeros_like(cnt_all)
            out[q_idx[sl]] += torch.where(bb, cnt_all, torch.where(a, cnt_causal, zero)).sum(dim=1).to(torch.int64)
    return out.reshape(b, n).sum(dim=0)


def tile_nonempty_dense(mask: torch.Tensor, block_size: int = 128,
                        document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ground truth for tests: bool [b, n, n] from the dense allowed matrix (small sizes only)."""
    from .inputs import allowed_matrix, check_inputs

    mask, docs = _as_2d(mask, document_ids)
    b, s = mask.shape
    n = num_blocks(s, block_size)
    dummy = torch.zeros(b, s, 1, 1)
    ok = allowed_matrix(check_inputs(dummy, dummy, dummy, mask, mask, q_document_ids=docs, k_document_ids=docs))
    pad = n * block_size - s
    ok = torch.nn.functional.pad(ok, (0, pad, 0, pad))
    return ok.reshape(b, n, block_size, n, block_size).any(dim=4).any(dim=2)


# ---------------------------------------------------------------------------------------------
# Assignment policies


def _chunks(items: Sequence[int], m: int) -> List[List[int]]:
    n = len(items)
    return [list(items[c * n // m:(c + 1) * n // m]) for c in range(m)]


def _lpt(work: List[int], cp: int, balanced_counts: bool) -> List[List[int]]:
    """Greedy LPT; with ``balanced_counts`` every rank ends with floor(n/cp) or ceil(n/cp) blocks."""
    n = len(work)
    order = sorted(range(n), key=lambda i: (-work[i], i))
    lo_cap, n_big = n // cp, n % cp                                  # n_big ranks may hold lo_cap + 1
    big_used = 0
    heap = [(0, 0, r) for r in range(cp)]                            # (load, blocks, rank)
    owned: List[List[int]] = [[] for _ in range(cp)]
    for i in order:
        while True:
            load, count, r = heapq.heappop(heap)
            full = balanced_counts and (count > lo_cap or (count == lo_cap and big_used >= n_big))
            if not full:
                break                                                # full ranks leave the heap
        if balanced_counts and count == lo_cap:
            big_used += 1
        owned[r].append(i)
        heapq.heappush(heap, (load + work[i], count + 1, r))
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
