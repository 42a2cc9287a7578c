"""The data of one training step on one rank, as the step's actions consume it.

Two ways to load a step, one per plan family:

* `shard` (homogeneous plans: every module on the language's layout): a rank
  loads only its LLM DP shard's microbatches, with the items of every encoder
  (it runs them all); the loss-token count is summed over the DP group by
  the plan's `loss tokens` collective.
* `whole` (heterogeneous plans): every rank plans the whole step from its
  metadata (each sample's token, loss-token and item counts, from the record
  index), so the boundary windows and the loss-token count need no
  communication. What a rank loads is its own share only: an encoder's first
  stage decodes just the items it encodes this step (`encoded_item_ids`), an
  LLM rank collates just its own microbatches, and a rank with neither loads
  nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Optional, Tuple

import torch

from mimo.attention import BitfieldMask, plan_context_parallel
from mimo.attention.context_parallel import check_slots
from mimo.config import LANGUAGE, MimoConfig
from mimo.data import PAD_ID, collate, loss_tokens, move
from mimo.data.items import PackedItems, grid_patches, is_native, patch_width, sample_grids, step_item_tokens
from mimo.data.mrope import microbatch_mrope_position_ids
from mimo.model import attention_mask

from .flops import count_later
from .windows import DEFERRED, KEPT, StepWindows


@dataclass
class StepData:
    n_tokens: torch.Tensor                                 # loss-carrying positions (float64; see the family)
    llm_batches: List[Dict]                                # this rank's LLM microbatches (`llm_microbatch`)
    step_batch: Dict[str, "EncoderItems"] = field(default_factory=dict)  # whole step: items this rank encodes
    windows: Optional[StepWindows] = None                  # whole step: boundary windows
    bad_media: int = 0  # items replaced by zeros while loading this step, counted on one rank per item
    # Under on_bad_record: error, this rank's items that failed to decode while loading this step (one
    # `error: ...` line each, zeros in their place): the step's loss sum tells every rank.
    media_errors: List[str] = field(default_factory=list)
    # Whole step: each native-resolution encoder's item grids (t, h, w) by step item id, host metadata
    # every rank holds, from which each pipeline stage derives its activation shape, masks and rotary table.
    item_grids: Dict[str, List[Tuple[int, int, int]]] = field(default_factory=dict)


def llm_microbatch(cfg: MimoConfig, host: Dict[str, torch.Tensor], device, dtype) -> Dict:
    """An LLM microbatch on the device, with what its forward needs derived on the host first, so
    the step never waits for the device to learn it: the attention mask, under CP the balanced
    slots (checked here), and the number of placeholder tokens of each modality."""
    mask = attention_mask(cfg, host["input_ids"], host.get("document_ids"))
    if cfg.model.language.position_embedding == "mrope" and host["position_ids"].dim() == 2:
        # Samples with 1-D positions: M-RoPE's (time, height, width) ones, from the images' grids.
        host = {**host, "position_ids": microbatch_mrope_position_ids(cfg, host)}
    batch = move(host, device, dtype)
    batch["placeholder_counts"] = {i: int((host["input_ids"] == i).sum()) for i in cfg.placeholder_ids.values()}
    batch["attention_mask"] = None if mask is None else BitfieldMask(
        mask.bits.to(device), None if mask.document_ids is None else mask.document_ids.to(device))
    lang, cp = cfg.model.language, cfg.parallelism[LANGUAGE].cp
    if cp > 1:
        slots = plan_context_parallel(mask.bits, cp, lang.cp_block_size, lang.cp_policy, mask.document_ids)
        check_slots(slots, mask.bits.shape[1])
        batch["cp_slots"] = slots.to(device)
    # This microbatch's share of the step's FLOP count: counted on the host, and only by the rank
    # that reports it (flops.rank_work), from the host ids, item counts and mask already here.
    batch["work"] = count_later(cfg, host, mask)
    return batch


def shard_step(cfg: MimoConfig, dataset, shard: List[List[int]], step: int, device, dtype) -> StepData:
    """A homogeneous-plan rank's microbatches (every encoder's items included): `shard` holds the step
    sample indices of each (the trainer's slicing or the balancer's assignment); only those samples
    are read."""
    G = cfg.training.global_batch_size
    batches = []
    for idx in shard:
        samples = [dataset.sample(step * G + i) for i in idx]
        batches.append(llm_microbatch(cfg, collate(samples, cfg.placeholder_ids), device, dtype))
    local = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
    return StepData(local, batches)


@dataclass
class EncoderItems:
    """The items (pixels, features) an encoder rank encodes this step, on the device, by step item id.

    Fixed-size items are rows of `rows` [n, ...]. Native-resolution items (`grids` set) are packed:
    item r's patches are rows [starts[r], starts[r] + patches of grids[r]) of `rows`."""
    rows: torch.Tensor
    row_of: Dict[int, int]
    grids: Optional[List[Tuple[int, int, int]]] = None

    def take(self, ids: List[int]):
        rows = [self.row_of[i] for i in ids]
        # A window's items are usually consecutive rows: then a slice (a view), with no index tensor
        # copied from pageable host memory, which can make the host wait for the device's stream.
        run = not rows or all(b == a + 1 for a, b in zip(rows, rows[1:]))
        if self.grids is None:
            if run:
                return self.rows[rows[0]:rows[-1] + 1] if rows else self.rows[:0]
            index = torch.tensor(rows, dtype=torch.long)
            return self.rows[index.to(self.rows.device, non_blocking=True)]
        # The index is built on the host from the grids: no device sync.
        starts = [0] + list(accumulate(grid_patches(g) for g in self.grids))
        grids = [self.grids[r] for r in rows]
        if run:
            return PackedItems(self.rows[starts[rows[0]]:starts[rows[-1] + 1]] if rows else self.rows[:0], grids)
        index = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])
        return PackedItems(self.rows[index.to(self.rows.device, non_blocking=True)], grids)


def step_windows(cfg: MimoConfig, samples: List, balancer, comms: Dict, colocated: List[str]) -> StepWindows:
    """The step's boundary windows from its samples' metadata (item counts and sizes; nothing decoded)."""
    counts = {n: [s.count(n) for s in samples] for n in cfg.model.encoders}
    return StepWindows(cfg, comms, counts, colocated, balancer.assignment(samples, PAD_ID),
                       step_item_tokens(cfg, samples))


def encoded_item_ids(windows: StepWindows, name: str, dp_rank: int, colocated: List[str],
                     num_microbatches: int) -> List[int]:
    """Step item ids encoder DP rank `dp_rank` of `name` encodes this step, over all its windows."""
    if name in colocated:
        return windows.encoder_item_ids(name, dp_rank)
    ids = []
    for mb in range(num_microbatches):
        ids += windows.encoder_item_ids(name, dp_rank, mb, KEPT)
        if windows.has_deferred(name, mb):
            ids += windows.encoder_item_ids(name, dp_rank, mb, DEFERRED)
    return ids


def item_sources(samples: List, name: str, ids: List[int]) -> List[Tuple[int, int]]:
    """(sample, item within it) of each step item id of encoder `name` (ids number items in sample order)."""
    first = list(accumulate(s.count(name) for s in samples))
    out = []
    for i in ids:
        j = bisect_right(first, i)
        out.append((j, i - (first[j - 1] if j else 0)))
    return out


def item_shape(cfg: MimoConfig, name: str) -> Tuple[int, ...]:
    enc = cfg.model.encoders[name]
    return (enc.num_channels, enc.image_size, enc.image_size) if enc.kind == "vision" else (enc.clip_frames,
                                                                                            enc.num_mel_bins)


def whole_step(cfg: MimoConfig, step: int, samples: List, windows: StepWindows, encoded: Dict[str, List[int]],
               llm_dp_rank: Optional[int], device, dtype) -> StepData:
    """A heterogeneous-plan rank's share of the step. `samples`: the step's (planned) samples;
    `encoded`: per encoder whose first stage this rank holds, the step item ids it encodes
    (`encoded_item_ids`); `llm_dp_rank` None: the rank holds no LLM stage."""
    # Every rank holds the same count (per-sample metadata): the loss needs no collective for it.
    total = loss_tokens(samples, cfg.placeholder_ids)
    if total == 0:
        raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")
    llm_batches = []
    if llm_dp_rank is not None:
        for idx in windows.llm_indices(llm_dp_rank):
            llm_batches.append(llm_microbatch(cfg, collate([samples[i] for i in idx], cfg.placeholder_ids, False),
                                              device, dtype))
    step_batch = {}
    for name, ids in encoded.items():
        order = sorted(set(ids))
        sources = item_sources(samples, name, order)
        rows = [samples[j].item(name, k) for j, k in sources]
        row_of = {i: r for r, i in enumerate(order)}
        enc = cfg.model.encoders[name]
        if is_native(enc):  # packed patches [Σ patches, C*T*P*P] and their grids
            grids = [sample_grids(samples[j], name)[k] for j, k in sources]
            host = torch.cat(rows) if rows else torch.zeros(0, patch_width(enc))
            step_batch[name] = EncoderItems(host.to(device, dtype, non_blocking=True), row_of, grids)
            continue
        host = torch.stack(rows) if rows else torch.zeros((0,) + item_shape(cfg, name))
        step_batch[name] = EncoderItems(host.to(device, dtype, non_blocking=True), row_of)
    n_tokens = torch.tensor(float(total), dtype=torch.float64, device=device)
    grids = {n: [g for s in samples for g in sample_grids(s, n)] for n, e in cfg.model.encoders.items()
             if is_native(e)}
    return StepData(n_tokens, llm_batches, step_batch, windows, item_grids=grids)
