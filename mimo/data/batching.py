"""From samples to model inputs, and from the global batch to a DP shard's microbatches."""

from __future__ import annotations

from typing import Collection, Dict, List, Union

import torch

from .items import PackedItems, sample_grids
from .mock import PAD_ID, Sample


def collate(samples: List[Sample], placeholder_ids: Dict[str, int],
            items: Union[bool, Collection[str]] = True) -> Dict[str, torch.Tensor]:
    """Stack samples into one microbatch.

    labels[t] = input_ids[t + 1]. Mock samples: loss_mask marks labels that are
    text (not padding, not a modality placeholder). Real samples carry `targets`
    (tokens of answers) and `document_ids`: loss_mask[t] is set when token t + 1
    is a target of the same document, so a packed sample never predicts its
    neighbour. Modality items are concatenated in sample order, matching the
    row-major placeholder order assembly expects. `items=False` leaves them out
    (only their counts): ranks that hold no encoder never decode an image; a
    collection of encoder names keeps only those encoders' items.
    """
    ids = torch.stack([s.input_ids for s in samples])
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), PAD_ID, dtype=ids.dtype)], dim=1)
    batch = {"input_ids": ids, "labels": labels}
    if samples[0].targets is None:
        loss_mask = labels != PAD_ID
        for token in placeholder_ids.values():
            loss_mask &= labels != token
    else:
        targets = torch.stack([s.targets for s in samples])
        docs = torch.stack([s.document_ids for s in samples])
        loss_mask = torch.zeros_like(targets)
        loss_mask[:, :-1] = targets[:, 1:] & (docs[:, 1:] == docs[:, :-1])
        batch["document_ids"] = docs
    batch["position_ids"] = stack_positions(samples, ids)
    batch["loss_mask"] = loss_mask.float()
    for name in placeholder_ids:
        native = any(s.grids is not None and name in s.grids for s in samples)
        if items is True or (items is not False and name in items):
            batch[name] = torch.cat([s.items[name] for s in samples])
            if native:  # native-resolution items: packed patches with their grids (mimo.data.items)
                batch[name] = PackedItems(batch[name], [g for s in samples for g in sample_grids(s, name)])
        batch[f"{name}_counts"] = torch.tensor([s.count(name) for s in samples])
        if native:  # every item's (t, h, w), for host-side sizes (FLOPs) where the patches are not loaded
            batch[f"{name}_grids"] = torch.tensor([g for s in samples for g in sample_grids(s, name)],
                                                  dtype=torch.int64).reshape(-1, 3)
    return batch


def stack_positions(samples: List[Sample], ids: torch.Tensor) -> torch.Tensor:
    """The microbatch's position ids: [b, s] (1-D RoPE), or [3, b, s] when the samples carry M-RoPE
    positions [3, s] (time, height, width; the layout megatron's M-RoPE takes). Samples without
    positions (mock data) count 0..s-1."""
    if samples[0].position_ids is None:
        return torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous()
    dims = {s.position_ids.dim() for s in samples}
    if len(dims) != 1 or dims.pop() not in (1, 2):
        raise ValueError("Sample.position_ids: every sample of a microbatch needs [s] or every one [3, s]")
    return torch.stack([s.position_ids for s in samples], dim=samples[0].position_ids.dim() - 1)


def loss_tokens(samples: List[Sample], placeholder_ids: Dict[str, int]) -> int:
    """Positions of `samples` that carry a loss (the `loss_mask` sum `collate` would give), from their
    tokens alone: no labels, no items. Counted sample by sample: every rank counts the whole step,
    and stacking it would copy [G, S] tensors each step (a planned real-data sample knows its count
    without its tokens)."""
    return sum(s.loss_count(placeholder_ids) for s in samples)


def shard_indices(global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> List[List[int]]:
    """Sample indices (within the global batch) of each microbatch of one DP shard.

    The global batch is cut into windows of micro_batch_size * dp_size
    samples (one LLM microbatch across all DP shards); shard j owns the j-th
    contiguous slice of every window. Boundary communicators rely on this
    contiguity when they re-shard between layouts.
    """
    window = micro_batch_size * dp_size
    if global_batch_size % window:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of micro_batch_size * dp ({window})")
    return [list(range(k * window + dp_rank * micro_batch_size, k * window + (dp_rank + 1) * micro_batch_size))
            for k in range(global_batch_size // window)]


def move(batch: Dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """To the compute device; floating inputs (pixels, mel) in the compute dtype."""
    return {k: (v.to(device, dtype) if v.is_floating_point() and k != "loss_mask" else v.to(device))
            for k, v in batch.items()}
