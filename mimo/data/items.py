"""Dividing a batch's modality items (images, audio clips) over an encoder's DP ranks.

An encoder's batch is its items, not its samples: a step of 4 samples holding
48 images each can feed 32 encoder ranks. The division is a pure function of
the items' token counts, so every rank computes the same one without
communication. It is contiguous in batch item order (sample order, then item
order within a sample, the order the LLM consumes them in): rank i takes items
``[bounds[i], bounds[i + 1])``. Contiguity keeps the boundary routing simple
(each encoder rank's items meet each LLM shard in at most one run) and makes
the former sample-level division the special case where the bounds fall on
sample edges.
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Sequence


def divide_items(item_tokens: Sequence[int], parts: int) -> List[int]:
    """Bounds (``parts + 1`` item offsets) of a contiguous division balanced by tokens.

    Bound i is the item edge whose token prefix is closest to ``i / parts`` of
    the total (the lower edge on a tie), so every part holds its fair share of
    tokens up to one item; with equal-sized items the item counts differ by at
    most one. Parts may be empty (fewer items than parts).
    """
    if parts < 1:
        raise ValueError(f"parts must be positive (got {parts})")
    prefix = [0] + list(accumulate(int(t) for t in item_tokens))
    total, bounds, k = prefix[-1], [0], 0
    for i in range(1, parts):
        target = i * total  # compare parts * prefix[k] with i * total: integers only, no rounding
        while k + 1 < len(prefix) and abs(parts * prefix[k + 1] - target) < abs(parts * prefix[k] - target):
            k += 1
        # Equal prefixes (zero-token items) or a total of 0: spread the items by count instead.
        if total == 0:
            k = (i * (len(prefix) - 1)) // parts
        bounds.append(max(k, bounds[-1]))
    bounds.append(len(prefix) - 1)
    return bounds


def sample_item_bounds(items_per_sample: Sequence[int], sample_bounds: Sequence[int]) -> List[int]:
    """Item offsets of sample offsets: the items held by the samples ``[b[j], b[j + 1])``."""
    prefix = [0] + list(accumulate(int(n) for n in items_per_sample))
    return [prefix[b] for b in sample_bounds]


def imbalance(bounds: Sequence[int], item_tokens: Sequence[int]) -> float:
    """max / mean tokens per part of a division (1.0 is perfect; 0 items counts as 1.0)."""
    prefix = [0] + list(accumulate(int(t) for t in item_tokens))
    loads = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
