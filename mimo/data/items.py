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

A sample's items are made on demand (`LazyItems`): every rank knows each
item's count and size from the plan, but only the rank that encodes an item
decodes (real data) or generates (mock data) its pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


def divide_items(item_tokens: Sequence[int], parts: int) -> List[int]:
    """Bounds (``parts + 1`` item offsets) of a contiguous division balanced by tokens.

    Bound i is the item edge whose token prefix is closest to ``i / parts`` of
    the total (the lowest such edge on a tie), so every part holds its fair share
    of tokens up to one item; with equal-sized items the item counts differ by at
    most one. Parts may be empty (fewer items than parts). Every rank divides
    every window of the step this way, so it runs in numpy.
    """
    if parts < 1:
        raise ValueError(f"parts must be positive (got {parts})")
    prefix = np.zeros(len(item_tokens) + 1, dtype=np.int64)
    np.cumsum(np.asarray(item_tokens, dtype=np.int64), out=prefix[1:])
    n, total = len(prefix) - 1, int(prefix[-1])
    if total == 0:  # no tokens to balance: spread the items by count
        return [(i * n) // parts for i in range(parts)] + [n]
    # Compare parts * prefix[k] with i * total: integers only, no rounding.
    scaled, targets = parts * prefix, np.arange(1, parts, dtype=np.int64) * total
    above = np.searchsorted(scaled, targets, "left")  # the first edge at or past each target
    below = np.searchsorted(scaled, scaled[above - 1], "left")  # the first edge of the one before
    take_below = targets - scaled[below] <= scaled[above] - targets
    return [0] + np.where(take_below, below, above).tolist() + [n]


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


# -- item sizes: one source of truth ----------------------------------------------------------------
#
# An item's LLM token count (the length of its placeholder run, the rows the boundary moves for it)
# is known on the host from metadata every rank holds without decoding: a fixed-resolution encoder's
# `tokens_per_item`, or a native-resolution image's patch grid (t, h, w), which the data layer reads
# from the image header (`mimo.data.native_images.native_grid`) and the sample carries in `grids`.

Grid = Tuple[int, int, int]


def is_native(enc) -> bool:
    """Whether encoder config `enc` takes native-resolution items (each image its own patch grid)."""
    return enc.kind == "vision" and getattr(enc, "resolution", "fixed") == "native"


def grid_tokens(grid: Sequence[int], merge: int) -> int:
    """LLM tokens of an image of patch grid (t, h, w): the patch merger joins merge x merge patches."""
    t, h, w = (int(x) for x in grid)
    if h % merge or w % merge:
        raise ValueError(f"grids: {(t, h, w)} is not a whole number of {merge} x {merge} merge blocks")
    return t * h * w // (merge * merge)


def grid_patches(grid: Sequence[int]) -> int:
    """Patches (the encoder's own tokens) of an image of patch grid (t, h, w)."""
    t, h, w = (int(x) for x in grid)
    return t * h * w


def sample_grids(sample, name: str) -> List[Grid]:
    """The patch grids of a sample's native-resolution items of encoder `name` (host list)."""
    grids = (getattr(sample, "grids", None) or {}).get(name)
    n = sample.count(name)
    if grids is None:
        if n == 0:
            return []
        raise ValueError(f"Sample.grids[{name!r}]: a native-resolution encoder's sample must carry its "
                         f"items' patch grids (t, h, w); this one has {n} items and no grids")
    if len(grids) != n:
        raise ValueError(f"Sample.grids[{name!r}]: {len(grids)} grids for {n} items")
    return [tuple(int(x) for x in g) for g in grids]


def sample_item_tokens(enc, sample, name: str) -> List[int]:
    """LLM tokens of each of a sample's items of encoder `name` (config `enc`), from host metadata."""
    if is_native(enc):
        return [grid_tokens(g, enc.spatial_merge_size) for g in sample_grids(sample, name)]
    return [enc.tokens_per_item] * sample.count(name)


def step_item_tokens(cfg, samples: Sequence) -> Dict[str, List[int]]:
    """encoder -> LLM tokens of each step item, in step item order (sample order, then item order)."""
    return {n: [t for s in samples for t in sample_item_tokens(enc, s, n)] for n, enc in cfg.model.encoders.items()}


class PackedItems:
    """A native-resolution encoder's items as one packed tensor: `patches` [Σ patches, C·T·P·P]
    (each image's patches consecutive, in item order) and their `grids` (host list of (t, h, w)).

    It moves like a tensor (`to`, `is_floating_point`), so collated batches holding it go to the
    device with `mimo.data.move`; `len` is the number of items."""

    def __init__(self, patches: torch.Tensor, grids: Sequence[Sequence[int]]):
        self.patches, self.grids = patches, [tuple(int(x) for x in g) for g in grids]
        if patches.dim() != 2 or patches.shape[0] != sum(grid_patches(g) for g in self.grids):
            raise ValueError(f"patches {list(patches.shape)} do not match grids {self.grids} "
                             f"({sum(grid_patches(g) for g in self.grids)} patches)")

    def __len__(self) -> int:
        return len(self.grids)

    def is_floating_point(self) -> bool:
        return self.patches.is_floating_point()

    def to(self, *args, **kwargs) -> "PackedItems":
        return PackedItems(self.patches.to(*args, **kwargs), self.grids)

    def item(self, k: int) -> torch.Tensor:
        """Patches of item k."""
        start = sum(grid_patches(g) for g in self.grids[:k])
        return self.patches[start:start + grid_patches(self.grids[k])]

    @staticmethod
    def cat(parts: Sequence["PackedItems"], width: int) -> "PackedItems":
        """Items of several packs, in order (`width`: patch width, for an empty result)."""
        parts = list(parts)
        patches = torch.cat([p.patches for p in parts]) if parts else torch.zeros(0, width)
        return PackedItems(patches, [g for p in parts for g in p.grids])


def patch_width(enc) -> int:
    """Floats per patch of a native-resolution encoder: C * T * P * P (HF's pixel_values width)."""
    return enc.num_channels * enc.temporal_patch_size * enc.patch_size * enc.patch_size


class LazyItems(Mapping):
    """encoder name -> [n, ...] items, decoded on first access; counts known without decoding.
    `decode(name, path, record)` decodes one item of encoder `name` (`record`: the id of the record
    it belongs to, for the bad-media message)."""

    def __init__(self, paths: Dict[str, List], records: Dict[str, List[str]],
                 decode: Callable[..., torch.Tensor], empty: Dict[str, tuple],
                 grids: Optional[Dict[str, List]] = None):
        self.paths, self.records, self.decode, self.empty = paths, records, decode, empty
        self.grids = grids or {}  # native-resolution encoders: each item's patch grid (t, h, w)
        self.counts = {n: len(p) for n, p in paths.items()}
        self._cache: Dict[str, torch.Tensor] = {}

    def item(self, name: str, k: int) -> torch.Tensor:
        """Item k of encoder `name` alone (an encoder rank decodes only the items it encodes)."""
        if name in self.grids:  # its size comes from the header: a bad item's zeros need it
            return self.decode(name, self.paths[name][k], self.records[name][k], self.grids[name][k])
        return self.decode(name, self.paths[name][k], self.records[name][k])

    def __getitem__(self, name: str) -> torch.Tensor:
        """All items of `name`: stacked [n, ...], or for native-resolution items their patches packed."""
        if name not in self._cache:
            n = self.counts[name]
            join = torch.cat if name in self.grids else torch.stack
            self._cache[name] = (join([self.item(name, k) for k in range(n)]) if n
                                 else torch.zeros((0,) + self.empty[name]))
        return self._cache[name]

    def __contains__(self, name) -> bool:  # Mapping's default would decode the items to find out
        return name in self.paths

    def __iter__(self):
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)
