"""From samples to model inputs, and from the global batch to a DP shard's microbatches."""

from __future__ import annotations

from typing import Dict, List

import torch

from .mock import PAD_ID, Sample


def collate(samples: List[Sample], placeholder_ids: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """Stack samples into one microbatch.

    labels[t] = input_ids[t + 1]; loss_mask marks labels that are text (not
    padding, not a modality placeholder). Modality items are concatenated in
    sample order, matching the row-major placeholder order assembly expects.
    """
    ids = torch.stack([s.input_ids for s in samples])
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), PAD_ID, dtype=ids.dtype)], dim=1)
    loss_mask = labels != PAD_ID
    for token in placeholder_ids.values():
        loss_mask &= labels != token
    batch = {
        "input_ids": ids,
        "labels": labels,
        "loss_mask": loss_mask.float(),
        "position_ids": torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous(),
    }
    for name in placeholder_ids:
        batch[name] = torch.cat([s.items[name] for s in samples])
        batch[f"{name}_counts"] = torch.tensor([s.items[name].shape[0] for s in samples])
    return batch


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
