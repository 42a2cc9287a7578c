"""Native-resolution images (Qwen2-VL / Qwen2.5-VL): each image keeps (about) its own size.

Host-side only (Pillow and numpy, no torch ops, no device): the same numbers transformers'
Qwen2-VL image processor computes, so mimo's ViT sees exactly the pixels the HF model was
trained on.

- `smart_resize` picks the resized height and width: each a multiple of
  factor = patch_size * spatial_merge_size, the pixel count within [min_pixels, max_pixels],
  the aspect ratio kept as closely as that allows.
- `native_grid` is the image's patch grid (t, h, w) from its width and height alone, so every
  rank can count an image's LLM tokens from the file header without decoding the pixels.
- `placeholder_count` is the LLM tokens one image becomes: the patch merger joins
  spatial_merge_size^2 neighbouring patches into one token.
- `image_patches` decodes, resizes, normalises and cuts the image into flattened patches in
  the processor's order (merge blocks contiguous), the layout the ViT's patch embedding reads.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np

from mimo.config.schema import max_placeholder_count  # noqa: F401 (a pure function of the config, used there too)

# OpenAI CLIP statistics: the Qwen2-VL processor's default image_mean / image_std.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The processor refuses images more elongated than this (their short side would vanish).
MAX_ASPECT_RATIO = 200

Grid = Tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Tuple[int, int]:
    """(height, width) after the Qwen2-VL processor's resize; the formula of transformers'
    `smart_resize`: round each side to a multiple of `factor`; if that leaves more than
    `max_pixels`, scale both sides down by sqrt(pixels / max_pixels) and round down; if fewer
    than `min_pixels`, scale up by sqrt(min_pixels / pixels) and round up. Python's `round`
    (halves to even), as transformers uses it."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {width} x {height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def native_grid(width: int, height: int, enc) -> Grid:
    """(t, h, w) in patches of an image of `width` x `height` pixels (PIL's `Image.size` order)
    for the native-resolution encoder config `enc`; t = 1 for a still image (its frame is
    repeated temporal_patch_size times inside one temporal patch)."""
    h, w = smart_resize(height, width, enc.patch_size * enc.spatial_merge_size, enc.min_pixels, enc.max_pixels)
    return 1, h // enc.patch_size, w // enc.patch_size


def placeholder_count(grid: Sequence[int], merge: int) -> int:
    """LLM tokens (placeholders in input_ids) for an image of patch grid (t, h, w)."""
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {tuple(grid)} is not a whole number of {merge} x {merge} merge blocks")
    return t * h * w // (merge * merge)


def to_rgb(image):
    """RGB as the HF processors convert: transparency composited onto white, then RGB."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def image_patches(image, enc, mean: Sequence[float] = CLIP_MEAN,
                  std: Sequence[float] = CLIP_STD) -> Tuple[np.ndarray, Grid]:
    """(patches float32 [t*h*w, C*T*P*P], grid (t, h, w)) of a PIL image: transformers'
    `pixel_values` / `image_grid_thw` for it, one image.

    Steps as the processor: RGB; bicubic resize (Pillow) to smart_resize's size; x / 255 in
    float64, then float32; (x - mean) / std per channel; cut into P x P patches, ordered by
    merge block (row of blocks, column of blocks, row in block, column in block) so that the
    spatial_merge_size^2 patches one LLM token merges are adjacent; the still frame repeated
    over the T = temporal_patch_size frames of the temporal patch. Each row is one patch
    flattened as (channel, frame, pixel row, pixel column), the Conv3d's weight layout."""
    from PIL import Image

    c, p, m, tp = enc.num_channels, enc.patch_size, enc.spatial_merge_size, enc.temporal_patch_size
    if c != 3:
        raise ValueError(f"num_channels must be 3 for RGB images, got {c}")
    rgb = to_rgb(image)
    grid = native_grid(rgb.width, rgb.height, enc)
    _, gh, gw = grid
    resized = rgb.resize((gw * p, gh * p), Image.BICUBIC)
    x = (np.asarray(resized).astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (tp,) + x.shape[5:])
    return np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p), dtype=np.float32), grid
