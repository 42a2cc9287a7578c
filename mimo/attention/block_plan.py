"""Tile classification and work lists, computed on device once per mask.

Every (query block, key block) tile is EMPTY (never launched), FULL (no
per-element mask) or PARTIAL (mask materialised from the bits). From the
classification we build, per query block, the ordered list of non-empty key
blocks (forward and dQ), per key block the list of non-empty query blocks
(dK/dV) — each list holds its partial tiles first, then its full ones, each in
ascending order, so the kernels run them as two loops specialised at compile
time — and the forward work items: rows longer than ``split_tiles`` are cut
into several items whose partial results are merged (intra-GPU balancing).

Plans are cached, keyed on the identity of the caller's mask tensors (storage,
offset, shape, strides, dtype, device) plus sizes and tile settings; the
tensors' autograd version counters are checked on a hit, so an in-place update
rebuilds (and replaces) the plan. An entry lives exactly as long as the
storages of its mask tensors: a finalizer on each storage removes it, and the
cache holds no reference to them. So a microbatch's plan stays for as long as
its mask can still be used (its forward, and its recomputed forward in the
backward, however many microbatches are in flight), and goes with it: no size
limit to thrash against, no stale entry for recycled memory. Writes that bypass
the version counter (``t.data[...] = ...``) are not detected: call
``clear_block_cache()`` after them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .inputs import AttentionInputs

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass
class TileLists:
    """Compacted non-empty tiles along one axis of the [b, n_rows, n_cols] grid."""

    idx: torch.Tensor      # int32 [b*n_rows, n_cols]; first cnt[r] entries are the non-empty columns:
    #                        the npart[r] partial ones ascending, then the full ones ascending
    full: torch.Tensor     # int8  [b*n_rows, n_cols]; 1 where that tile is FULL
    cnt: torch.Tensor      # int32 [b*n_rows]
    npart: torch.Tensor    # int32 [b*n_rows]; how many of the listed tiles are PARTIAL
    nonempty: torch.Tensor  # int32 [k]; rows with cnt > 0 (the only ones launched)


@dataclass
class ForwardItems:
    row: torch.Tensor      # int32 [n_items] flattened (batch, query block)
    start: torch.Tensor    # int32 [n_items] offset into the row's tile list
    length: torch.Tensor   # int32 [n_items] number of tiles
    slot: torch.Tensor     # int32 [n_items] partial-output slot, -1 = writes the output directly
    agg_row: torch.Tensor  # int32 [n_agg] split rows
    agg_slot: torch.Tensor  # int32 [n_agg] first slot of the row (its slots are consecutive)
    agg_len: torch.Tensor  # int32 [n_agg]
    n_slots: int


@dataclass
class BlockPlan:
    block_m: int
    block_n: int
    n_qb: int
    n_kb: int
    status: torch.Tensor   # int8 [b, n_qb, n_kb]
    rows: TileLists        # per query block
    cols: TileLists        # per key block
    items: Optional[ForwardItems]

    def counts(self) -> dict:
        """Number of empty, partial and full tiles (synchronises the device)."""
        return {name: int((self.status == code).sum()) for name, code in
                (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}


@dataclass
class _Entry:
    plan: BlockPlan
    versions: tuple                 # the key tensors' version counters when the plan was built
    storages: tuple                 # weak references to their storages (a hit checks they are the same)
    finalizers: list                # one per storage: removes the entry when the storage is freed


_cache: "dict[tuple, _Entry]" = {}
_cache_lock = threading.RLock()  # re-entrant: a storage's finalizer may run while this thread holds it
_stats = {"hits": 0, "misses": 0}


def clear_block_cache() -> None:
    """Drop every cached plan (call after mutating a mask behind autograd's back)."""
    with _cache_lock:
        for entry in _cache.values():
            for f in entry.finalizers:
                f.detach()
        _cache.clear()


def cache_stats() -> dict:
    return dict(_stats, size=len(_cache))


def _tensor_key(t: Optional[torch.Tensor]):
    if t is None:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            str(t.device))


def _drop(key) -> None:
    with _cache_lock:
        entry = _cache.pop(key, None)
    if entry is not None:
        for f in entry.finalizers:
            f.detach()


def get_plan(inp: AttentionInputs, key_tensors: tuple, block_m: int, block_n: int,
             split_tiles: Optional[int], kernels) -> BlockPlan:
    """Cached plan; ``key_tensors`` are the caller's own mask/position/document tensors (or None)."""
    b, s_q = inp.q_mask.shape
    s_k = inp.k_mask.shape[1]
    key = (tuple(_tensor_key(t) for t in key_tensors), b, s_q, s_k, block_m, block_n, split_tiles,
           str(inp.q_mask.device))
    tensors = [t for t in key_tensors if t is not None]
    versions = tuple(t._version for t in tensors)
    storages = tuple(t.untyped_storage() for t in tensors)
    with _cache_lock:
        hit = _cache.get(key)
        if (hit is not None and hit.versions == versions
                and all(ref() is st for ref, st in zip(hit.storages, storages))):
            _stats["hits"] += 1
            return hit.plan
    plan = build_plan(inp, block_m, block_n, split_tiles, kernels)
    unique = list({id(st): st for st in storages}.values())
    entry = _Entry(plan, versions, tuple(weakref.ref(st) for st in storages),
                   [weakref.finalize(st, _drop, key) for st in unique])
    with _cache_lock:
        _stats["misses"] += 1
        old = _cache.pop(key, None)  # an in-place update of a mask: its old plan is replaced
        _cache[key] = entry
    if old is not None:
        for f in old.finalizers:
            f.detach()
    return plan


def classify(inp: AttentionInputs, block_m: int, block_n: int, kernels) -> torch.Tensor:
    b, s_q = inp.q_mask.shape
    s_k = inp.k_mask.shape[1]
    n_qb, n_kb = -(-s_q // block_m), -(-s_k // block_n)
    status = torch.empty((b, n_qb, n_kb), dtype=torch.int8, device=inp.q_mask.device)
    if status.numel() == 0:
        return status
    has_doc = inp.q_document_ids is not None
    qd = inp.q_document_ids.contiguous() if has_doc else inp.q_mask
    kd = inp.k_document_ids.contiguous() if has_doc else inp.k_mask
    kernels.classify_kernel[(n_qb, n_kb, b)](
        inp.q_mask.contiguous(), inp.q_positions.contiguous(), qd,
        inp.k_mask.contiguous(), inp.k_positions.contiguous(), kd,
        status, s_q, s_k, n_qb, n_kb,
        HAS_DOC=has_doc, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return status


def _compact(status_rows: torch.Tensor) -> TileLists:
    nonzero = status_rows != EMPTY
    cnt = nonzero.sum(dim=1).to(torch.int32)
    npart = (status_rows == PARTIAL).sum(dim=1).to(torch.int32)
    # A stable sort on (partial 0, full 1, empty 2) lists the partial columns, then the full ones,
    # each in ascending order, then the empty ones (never read).
    rank = torch.where(status_rows == PARTIAL, 0, torch.where(status_rows == FULL, 1, 2)).to(torch.int32)
    order = torch.sort(rank, dim=1, stable=True).indices
    full = (torch.gather(status_rows, 1, order) == FULL).to(torch.int8)
    nonempty = torch.nonzero(cnt > 0).flatten().to(torch.int32)
    return TileLists(order.to(torch.int32).contiguous(), full.contiguous(), cnt, npart, nonempty)


def _forward_items(rows: TileLists, split_tiles: int) -> ForwardItems:
    dev = rows.cnt.device
    cnt = rows.cnt.to(torch.int64)
    if split_tiles > 0:
        chunks = (cnt + split_tiles - 1) // split_tiles
        step = split_tiles
    else:
        chunks = (cnt > 0).to(torch.int64)
        step = max(int(cnt.max()) if cnt.numel() else 1, 1)
    n_rows = cnt.numel()
    item_row = torch.repeat_interleave(torch.arange(n_rows, device=dev), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    local = torch.arange(item_row.numel(), device=dev) - first[item_row]
    start = local * step
    length = torch.clamp(cnt[item_row] - start, max=step)
    split_item = chunks[item_row] > 1
    slot = torch.where(split_item, torch.cumsum(split_item.to(torch.int64), 0) - 1, torch.full_like(start, -1))
    split_rows = torch.nonzero(chunks > 1).flatten()
    agg_slot = slot[first[split_rows]] if split_rows.numel() else split_rows
    # Longest items first, so that the longest programs do not start last.
    order = torch.sort(length, descending=True, stable=True).indices
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return ForwardItems(
        row=i32(item_row[order]), start=i32(start[order]), length=i32(length[order]), slot=i32(slot[order]),
        agg_row=i32(split_rows), agg_slot=i32(agg_slot), agg_len=i32(chunks[split_rows]),
        n_slots=int(split_item.sum()),
    )


def build_plan(inp: AttentionInputs, block_m: int, block_n: int, split_tiles: Optional[int], kernels) -> BlockPlan:
    for name, m in (("q_mask", inp.q_mask), ("k_mask", inp.k_mask)):
        if m.numel() and bool((m < 0).any()):
            raise ValueError(f"{name} has bit 63 set (negative values); valid bits are 0..62")
    status = classify(inp, block_m, block_n, kernels)
    b, n_qb, n_kb = status.shape
    rows = _compact(status.reshape(b * n_qb, n_kb))
    cols = _compact(status.transpose(1, 2).reshape(b * n_kb, n_qb))
    items = _forward_items(rows, split_tiles) if split_tiles is not None else None
    return BlockPlan(block_m, block_n, n_qb, n_kb, status, rows, cols, items)
