"""Tile classification and work lists, computed on device once per mask, with one wait for it.

Every (query block, key block) tile is EMPTY (never launched), FULL (no
per-element mask) or PARTIAL (mask materialised from the bits). From the
classification we build, per query block, the ordered list of non-empty key
blocks (forward and dQ), per key block the list of non-empty query blocks
(dK/dV) — each list holds its partial tiles first, then its full ones, each in
ascending order, so the kernels run them as two loops specialised at compile
time — and the forward work items: rows longer than ``split_tiles`` are cut
into several items whose partial results are merged (intra-GPU balancing).
Work is launched longest first: the forward's items, and the backward's rows
and columns with any non-empty tile.

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
from typing import List, Optional, Sequence, Tuple

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
    nonempty: torch.Tensor  # int32 [k]; rows with cnt > 0 (the only ones launched), longest first


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
    return get_plans(inp, key_tensors, [(block_m, block_n, split_tiles)], kernels)[0]


def get_plans(inp: AttentionInputs, key_tensors: tuple, tiles: Sequence[Tuple[int, int, Optional[int]]],
              kernels) -> List[BlockPlan]:
    """Cached plans of one mask, one per ``(block_m, block_n, split_tiles)``; the missing ones are built
    together (`build_plans`: one wait for the device, however many)."""
    b, s_q = inp.q_mask.shape
    s_k = inp.k_mask.shape[1]
    mask_key = (tuple(_tensor_key(t) for t in key_tensors), b, s_q, s_k, str(inp.q_mask.device))
    tensors = [t for t in key_tensors if t is not None]
    versions = tuple(t._version for t in tensors)
    storages = tuple(t.untyped_storage() for t in tensors)
    keys = [mask_key + tuple(t) for t in tiles]
    plans: "dict[tuple, BlockPlan]" = {}
    with _cache_lock:
        for key in keys:
            hit = _cache.get(key)
            if (hit is not None and hit.versions == versions
                    and all(ref() is st for ref, st in zip(hit.storages, storages))):
                _stats["hits"] += 1
                plans[key] = hit.plan
    missing = list(dict.fromkeys(k for k in keys if k not in plans))
    if missing:
        built = build_plans(inp, [k[len(mask_key):] for k in missing], kernels)
        unique = list({id(st): st for st in storages}.values())
        for key, plan in zip(missing, built):
            plans[key] = plan
            entry = _Entry(plan, versions, tuple(weakref.ref(st) for st in storages),
                           [weakref.finalize(st, _drop, key) for st in unique])
            with _cache_lock:
                _stats["misses"] += 1
                old = _cache.pop(key, None)  # an in-place update of a mask: its old plan is replaced
                _cache[key] = entry
            if old is not None:
                for f in old.finalizers:
                    f.detach()
    return [plans[k] for k in keys]


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
    kernels.classify_kernel[(n_qb * n_kb, b)](
        inp.q_mask.contiguous(), inp.q_positions.contiguous(), qd,
        inp.k_mask.contiguous(), inp.k_positions.contiguous(), kd,
        status, s_q, s_k, n_qb, n_kb,
        HAS_DOC=has_doc, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return status


# Building a plan is two halves around one read of a few sizes from the device: the first half queues
# the device work whose result sizes depend on the mask (how many rows are non-empty, how many forward
# items), the read learns those sizes, the second half makes the tensors of those sizes. The read waits
# for everything queued before it, so a plan's builder reads once, for all the plans it builds.

def _compact(status_rows: torch.Tensor) -> Tuple[tuple, torch.Tensor]:
    """The lists' tensors but `nonempty` (`_lists` adds it) and, on the device, how many rows are non-empty."""
    nonzero = status_rows != EMPTY
    cnt = nonzero.sum(dim=1).to(torch.int32)
    npart = (status_rows == PARTIAL).sum(dim=1).to(torch.int32)
    # A stable sort on (partial 0, full 1, empty 2) lists the partial columns, then the full ones,
    # each in ascending order, then the empty ones (never read).
    rank = torch.where(status_rows == PARTIAL, 0, torch.where(status_rows == FULL, 1, 2)).to(torch.int32)
    order = torch.sort(rank, dim=1, stable=True).indices
    full = (torch.gather(status_rows, 1, order) == FULL).to(torch.int8)
    return (order.to(torch.int32).contiguous(), full.contiguous(), cnt, npart), nonzero.any(dim=1).sum().view(1)


def _lists(parts: tuple, n_nonempty: int) -> TileLists:
    cnt = parts[2]
    nonempty = torch.nonzero_static(cnt > 0, size=n_nonempty).flatten()
    # Launched longest first (LPT), as the forward's items: a causal mask's longest dQ rows would
    # otherwise start last and run on alone at the end of the launch.
    order = torch.sort(cnt[nonempty], descending=True, stable=True).indices
    return TileLists(*parts, nonempty[order].to(torch.int32).contiguous())


def _item_chunks(cnt: torch.Tensor, split_tiles: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's number of forward items and, on the device, how many items, split rows and items of
    split rows there are."""
    cnt = cnt.to(torch.int64)
    chunks = (cnt + split_tiles - 1) // split_tiles if split_tiles > 0 else (cnt > 0).to(torch.int64)
    split = chunks > 1
    return chunks, torch.stack([chunks.sum(), split.sum(), (chunks * split).sum()])


def _forward_items(rows: TileLists, chunks: torch.Tensor, split_tiles: int, n_items: int, n_split_rows: int,
                   n_slots: int) -> ForwardItems:
    dev = rows.cnt.device
    cnt = rows.cnt.to(torch.int64)
    # Unsplit, a row is one item of all its tiles (a row has at most as many tiles as idx has columns).
    step = split_tiles if split_tiles > 0 else max(rows.idx.shape[1], 1)
    n_rows = cnt.numel()
    item_row = torch.repeat_interleave(torch.arange(n_rows, device=dev), chunks, output_size=n_items)
    first = torch.cumsum(chunks, 0) - chunks
    local = torch.arange(n_items, device=dev) - first[item_row]
    start = local * step
    length = torch.clamp(cnt[item_row] - start, max=step)
    split_item = chunks[item_row] > 1
    slot = torch.where(split_item, torch.cumsum(split_item.to(torch.int64), 0) - 1, torch.full_like(start, -1))
    split_rows = torch.nonzero_static(chunks > 1, size=n_split_rows).flatten()
    agg_slot = slot[first[split_rows]]
    # Longest items first, so that the longest programs do not start last.
    order = torch.sort(length, descending=True, stable=True).indices
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return ForwardItems(
        row=i32(item_row[order]), start=i32(start[order]), length=i32(length[order]), slot=i32(slot[order]),
        agg_row=i32(split_rows), agg_slot=i32(agg_slot), agg_len=i32(chunks[split_rows]),
        n_slots=n_slots,
    )


def build_plan(inp: AttentionInputs, block_m: int, block_n: int, split_tiles: Optional[int], kernels) -> BlockPlan:
    return build_plans(inp, [(block_m, block_n, split_tiles)], kernels)[0]


def build_plans(inp: AttentionInputs, tiles: Sequence[Tuple[int, int, Optional[int]]], kernels) -> List[BlockPlan]:
    """One plan per ``(block_m, block_n, split_tiles)`` of one mask (``split_tiles`` None: no forward
    items, a backward plan), with a single read from the device for all of them."""
    sizes = [torch.stack([(m < 0).any() for m in (inp.q_mask, inp.k_mask)]).to(torch.int64)]
    started = []
    for block_m, block_n, split_tiles in tiles:
        status = classify(inp, block_m, block_n, kernels)
        b, n_qb, n_kb = status.shape
        rows, n_rows = _compact(status.reshape(b * n_qb, n_kb))
        cols, n_cols = _compact(status.transpose(1, 2).reshape(b * n_kb, n_qb))
        chunks, n_items = _item_chunks(rows[2], split_tiles) if split_tiles is not None else (None, None)
        sizes += [n_rows, n_cols] + ([n_items] if chunks is not None else [])
        started.append((block_m, block_n, split_tiles, status, rows, cols, chunks))
    read = torch.cat([s.to(torch.int64) for s in sizes]).tolist()  # the one wait for the device
    for name, negative in zip(("q_mask", "k_mask"), read[:2]):
        if negative:
            raise ValueError(f"{name} has bit 63 set (negative values); valid bits are 0..62")
    at = 2
    plans = []
    for block_m, block_n, split_tiles, status, rows, cols, chunks in started:
        rows, cols = _lists(rows, read[at]), _lists(cols, read[at + 1])
        at += 2
        items = None
        if chunks is not None:
            items = _forward_items(rows, chunks, split_tiles, *read[at:at + 3])
            at += 3
        b, n_qb, n_kb = status.shape
        plans.append(BlockPlan(block_m, block_n, n_qb, n_kb, status, rows, cols, items))
    return plans
