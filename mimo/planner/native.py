"""Cost arithmetic of a native-resolution ViT (Qwen2-VL / Qwen2.5-VL): pure Python, no torch.

An image of patch grid (t, h, w) is t * h * w patches through every ViT layer;
attention is what varies with its shape: a full-attention layer sees each
frame whole (t (h w)^2 query-key pairs), a window layer each window of
``window_size`` pixels on its own (the last row and column of windows may be
smaller). The FLOP count (`mimo.training.flops`), the balancers' per-item cost
(`mimo.balance.workload`) and the planner's reference image all use these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

Grid = Tuple[int, int, int]


def native_attention_pairs(enc, grid: Sequence[int]) -> int:
    """(query, key) pairs of one image of patch grid (t, h, w), summed over the encoder's layers.

    ``enc``: anything with num_layers, patch_size, spatial_merge_size, window_size and
    full_attention_layers (the encoder's config, or the planner's `ModuleSpec.native`)."""
    t, h, w = (int(x) for x in grid)
    full = t * (h * w) ** 2
    m = enc.spatial_merge_size
    units = enc.window_size // enc.patch_size // m if enc.window_size else 0
    if not units:
        return enc.num_layers * full

    def sides(n: int) -> List[int]:  # window sides in merge units along one axis
        return [min(units, n - i) for i in range(0, n, units)]
    window = t * m ** 4 * sum(r * r for r in sides(h // m)) * sum(c * c for c in sides(w // m))
    n_full = len(set(enc.full_attention_layers or ()))
    return n_full * full + (enc.num_layers - n_full) * window


def reference_grid(patch_size: int, temporal_patch_size: int, spatial_merge_size: int,
                   min_pixels: int, max_pixels: int) -> Grid:
    """Patch grid of the planner's reference image: a square still image as large as the
    processor lets it be (max_pixels), i.e. what smart_resize makes of a large square picture
    (each side the largest multiple of patch_size * spatial_merge_size within max_pixels, and at
    least enough for min_pixels). One frame: a still image is its frame repeated
    temporal_patch_size times, which the Conv3d patch embedding folds into t = 1."""
    factor = patch_size * spatial_merge_size
    side = max(factor, factor * math.floor(math.sqrt(max_pixels) / factor))
    if side * side < min_pixels:
        side = factor * math.ceil(math.sqrt(min_pixels) / factor)
    return (1, side // patch_size, side // patch_size)


@dataclass(frozen=True)
class NativeViT:
    """What the costs need of a native-resolution ViT's config (field names as in the config)."""
    num_layers: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_channels: int
    min_pixels: int
    max_pixels: int
    window_size: int = 0
    full_attention_layers: Tuple[int, ...] = ()

    @classmethod
    def from_config(cls, enc) -> "NativeViT":
        """From an encoder config (mimo.config's EncoderConfig)."""
        return cls(enc.num_layers, enc.patch_size, enc.temporal_patch_size, enc.spatial_merge_size,
                   enc.num_channels, enc.min_pixels, enc.max_pixels, enc.window_size or 0,
                   tuple(enc.full_attention_layers or ()))

    @property
    def merge_tokens(self) -> int:
        """Patches per LLM token (the patch merger joins spatial_merge_size^2 of them)."""
        return self.spatial_merge_size ** 2

    @property
    def patch_features(self) -> int:
        """Floats per patch entering the Conv3d patch embedding (C * T * P * P)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    def pairs(self, grid: Sequence[int]) -> int:
        return native_attention_pairs(self, grid)

    def reference_grid(self) -> Grid:
        return reference_grid(self.patch_size, self.temporal_patch_size, self.spatial_merge_size,
                              self.min_pixels, self.max_pixels)
