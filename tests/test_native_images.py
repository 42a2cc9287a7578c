"""Native-resolution image preprocessing (mimo.data.native_images) against transformers' Qwen2-VL
image processor (the Pillow one: no torchvision): pixel_values and image_grid_thw for images of
many sizes, the grid from the file header alone, smart_resize's bounds, placeholder counts."""

import math
import random

import numpy as np
import pytest
from PIL import Image

from mimo.config.schema import EncoderConfig
from mimo.data.native_images import (
    image_patches,
    max_placeholder_count,
    native_grid,
    placeholder_count,
    smart_resize,
)

TOL = 1e-5
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)   # not CLIP's: the statistics must come through


def encoder(**kw):
    base = dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2, patch_size=14,
                resolution="native", position_embedding="rope2d")
    return EncoderConfig(**{**base, **kw})


def processor(enc, mean=MEAN, std=STD):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=enc.min_pixels, max_pixels=enc.max_pixels, patch_size=enc.patch_size,
                                    temporal_patch_size=enc.temporal_patch_size, merge_size=enc.spatial_merge_size,
                                    image_mean=list(mean), image_std=list(std))


def noise(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


# (width, height): tiny (scaled up to min_pixels), odd sizes, elongated (up to the 200:1 limit),
# larger than max_pixels (scaled down).
SIZES = [(1, 1), (5, 9), (40, 30), (57, 113), (640, 480), (199 * 3, 3), (20, 3000), (1999, 1501)]


@pytest.mark.parametrize("width,height", SIZES)
def test_patches_match_the_hf_processor(width, height):
    enc = encoder(min_pixels=56 * 56, max_pixels=28 * 28 * 300)
    img = noise(width, height, seed=width * height)
    ref = processor(enc)(images=img)
    patches, grid = image_patches(img, enc, MEAN, STD)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert patches.dtype == np.float32 and patches.shape == ref["pixel_values"].shape
    assert np.abs(patches - ref["pixel_values"]).max() <= TOL


@pytest.mark.parametrize("enc_kw", [
    dict(),                                                   # the processor's defaults (28 * 28 * 1280 max)
    dict(patch_size=16, spatial_merge_size=1, temporal_patch_size=1, min_pixels=1000, max_pixels=50000),
    dict(patch_size=8, spatial_merge_size=3, max_pixels=24 * 24 * 40),
])
def test_other_patch_and_merge_sizes_match(enc_kw):
    enc = encoder(**enc_kw)
    for width, height in ((333, 517), (2500, 1800)):
        img = noise(width, height, seed=7)
        ref = processor(enc)(images=img)
        patches, grid = image_patches(img, enc, MEAN, STD)
        assert [list(grid)] == ref["image_grid_thw"].tolist()
        assert np.abs(patches - ref["pixel_values"]).max() <= TOL


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_non_rgb_images_convert_as_the_processor(mode):
    """Transparency is composited onto white (the processors' convert_to_rgb), grey becomes RGB."""
    enc = encoder(max_pixels=28 * 28 * 64)
    img = noise(90, 70, mode, seed=3)
    patches, _ = image_patches(img, enc, MEAN, STD)
    assert np.abs(patches - processor(enc)(images=img)["pixel_values"]).max() <= TOL


def test_negative_control_row_major_patches_differ():
    """The comparison sees the patch order: plain row-major patches (no merge blocks) differ."""
    enc = encoder(max_pixels=28 * 28 * 64)
    img = noise(120, 90, seed=5)
    patches, (_, gh, gw) = image_patches(img, enc, MEAN, STD)
    c, t, p = 3, enc.temporal_patch_size, enc.patch_size
    row_major = patches.reshape(gh // 2, gw // 2, 2, 2, c * t * p * p).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
    ref = processor(enc)(images=img)["pixel_values"]
    assert np.abs(patches - ref).max() <= TOL
    assert np.abs(row_major - ref).max() > 0.1


def test_grid_from_the_header_equals_the_processors(tmp_path):
    """Every rank counts an image's tokens from its header: Image.open reads the size without
    decoding the pixels."""
    enc = encoder(max_pixels=28 * 28 * 500)
    proc = processor(enc)
    for i, (width, height, fmt) in enumerate([(640, 480, "JPEG"), (33, 2001, "PNG"), (3, 3, "PNG"),
                                              (2600, 1900, "JPEG")]):
        path = tmp_path / f"img{i}.{fmt.lower()}"
        noise(width, height, seed=i).save(path, fmt)
        with Image.open(path) as img:
            size = img.size
            grid = native_grid(*size, enc)
            assert img._im is None          # nothing decoded yet
            ref = proc(images=img.convert("RGB"))
        assert [list(grid)] == ref["image_grid_thw"].tolist()
        assert placeholder_count(grid, enc.spatial_merge_size) == ref["pixel_values"].shape[0] // 4
        assert proc.get_number_of_image_patches(height, width) == grid[1] * grid[2]


def test_smart_resize_is_transformers_and_stays_in_bounds():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = random.Random(0)
    for _ in range(2000):
        factor = rng.choice([28, 32, 14])
        lo = rng.choice([factor * factor, 56 * 56, 4 * 28 * 28])
        hi = rng.choice([lo, 28 * 28 * 16, 28 * 28 * 1280])
        h = rng.randint(1, 5000)
        w = min(max(1, int(h * rng.uniform(1 / 150, 150))), 20000)
        got = smart_resize(h, w, factor, lo, hi)
        assert got == hf_smart_resize(h, w, factor, lo, hi), (h, w, factor, lo, hi)
        assert got[0] % factor == 0 and got[1] % factor == 0
        # Within max_pixels unless the short side is clamped up to one factor (very elongated
        # images) or the round-up to min_pixels overshoots (min_pixels close to max_pixels).
        if min(h, w) * math.sqrt(hi / (h * w)) >= factor and 4 * lo <= hi:
            assert got[0] * got[1] <= hi, (h, w, factor, lo, hi)
        assert got[0] * got[1] >= min(lo, factor * factor)


def test_too_small_and_too_large_images_are_resized_into_bounds():
    enc = encoder(min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 64)
    small, large = native_grid(10, 12, enc), native_grid(4000, 3000, enc)
    for t, h, w in (small, large):
        assert t == 1 and 16 <= (h // 2) * (w // 2) <= 64
    assert small == (1, 10, 8)                  # 10 wide, 12 high: scaled up to 5 x 4 >= 16 merge blocks
    assert large == (1, 12, 18)                 # 4000 x 3000: scaled down to 6 x 9 <= 64 blocks
    assert placeholder_count(large, 2) == 54 <= max_placeholder_count(enc) == 64


def test_placeholder_count_and_aspect_limit():
    assert placeholder_count((1, 6, 10), 2) == 15
    assert placeholder_count((2, 4, 4), 2) == 8
    with pytest.raises(ValueError, match="merge blocks"):
        placeholder_count((1, 5, 4), 2)
    with pytest.raises(ValueError, match="aspect ratio"):
        native_grid(201 * 5, 5, encoder())
