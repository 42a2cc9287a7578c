#!/usr/bin/env python
"""Native-resolution images (Qwen2-VL / Qwen2.5-VL) on the host: data pipeline throughput and encoder DP balance.

    python tools/bench_native_data.py [--images 48] [--median-side 448] [--sigma 0.8] [--max-pixels 1003520]
                                      [--dp 2 4 8] [--samples 32] [--steps 20] [--seed 0] [--skip-pipeline]

`pipeline` (CPU, one process): writes --images JPEG pictures whose areas are log-normal (median
--median-side squared pixels, log-sd --sigma; aspect ratios log-uniform in [1/3, 3]) and one
LLaVA-format record per picture, with a Qwen2-VL-style tokenizer, in a temporary directory; then
times each stage of an image's way into a sample, per image: reading the header (the size, no pixel
decoded), the grid (`native_grid`: smart_resize into [min_pixels, max_pixels]), decoding (Pillow,
RGB), cutting into patches (`image_patches`: resize, normalise, merge-block order, as the HF
processor); and the whole pipeline: `LlavaDataset.sample` plans the sample (chat template,
tokenising, placeholder runs from the header: `pipeline_plan`), then its items decode into patches
on first access (`pipeline_sample`: both). One JSON line: items/s and ms per image for each.

`imbalance` (pure Python): --steps steps of --samples samples, each with 1-4 images drawn from the same
log-normal areas, resized into the processor's bounds; per encoder DP size, max / mean image tokens per
encoder rank for the item-level division (`mimo.data.items.divide_items` by each image's LLM tokens)
and for sample-level division (equal contiguous slices of the step's samples, the former rule), mean
and worst over the steps; and the same for the ViT's work (the balancers' per-image cost of the
Qwen2.5-VL-7B-shaped example: patches plus attention pairs, full and window layers) under the same
token-balanced division. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

EXAMPLE = os.path.join(ROOT, "examples", "configs", "qwen2_5_vl_7b_8gpu.yaml")
WORDS = "what is the shape in picture colour of background".split()


def vision(max_pixels: int):
    """The Qwen2.5-VL ViT's preprocessing sizes (patch 14, 2 frames, 2 x 2 merge)."""
    return dict(kind="vision", resolution="native", num_layers=1, hidden_size=16, num_attention_heads=2,
                patch_size=14, temporal_patch_size=2, spatial_merge_size=2, min_pixels=3136, max_pixels=max_pixels,
                position_embedding="rope2d", placeholder_id=120, projector={"kind": "patch_merger"})


def draw_size(rng: random.Random, median_side: float, sigma: float):
    """(width, height): log-normal area, log-uniform aspect ratio in [1/3, 3]."""
    area = median_side ** 2 * math.exp(rng.gauss(0.0, 2 * sigma))
    aspect = math.exp(rng.uniform(-math.log(3), math.log(3)))
    return max(8, round(math.sqrt(area * aspect))), max(8, round(math.sqrt(area / aspect)))


def write_pictures(out: str, n: int, rng: random.Random, median_side: float, sigma: float):
    """n JPEGs of log-normal sizes (a smooth colour field with a shape: compresses like a photo)."""
    import numpy as np
    from PIL import Image, ImageDraw

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    sizes = []
    for i in range(n):
        w, h = draw_size(rng, median_side, sigma)
        w, h = min(w, 4096), min(h, 4096)
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        rgb = np.stack([x / w * 255, y / h * 255, np.full_like(x, rng.randrange(256))], axis=-1).astype(np.uint8)
        image = Image.fromarray(rgb)
        ImageDraw.Draw(image).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=(200, 40, 40))
        image.save(os.path.join(out, "images", f"img{i:04d}.jpg"), quality=90)
        sizes.append((w, h))
    return sizes


def _per_image(fn, paths):
    start = time.perf_counter()
    out = [fn(p) for p in paths]
    return (time.perf_counter() - start) / len(paths), out


def bench_pipeline(args) -> dict:
    import make_sample_data
    from PIL import Image

    from mimo.config import load_config
    from mimo.data import build_dataset
    from mimo.data.native_images import image_patches, native_grid

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_pictures(tmp, args.images, rng, args.median_side, args.sigma)
        make_sample_data.make_qwen_vl_tokenizer(os.path.join(tmp, "tokenizer"))
        records = [{"id": f"r{i}", "image": f"images/img{i:04d}.jpg", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(rng.choice(WORDS) for _ in range(8)) + " ?"},
            {"from": "gpt", "value": "a red circle ."}]} for i in range(args.images)]
        with open(os.path.join(tmp, "train.json"), "w") as f:
            json.dump(records, f)
        raw = {"model": {"language": dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                          max_sequence_length=2048, attention="bitfield"),
                         "encoders": {"images": vision(args.max_pixels)}},
               "parallelism": {"language": {}, "images": {}},
               "data": {"kind": "llava", "path": os.path.join(tmp, "train.json"), "image_root": tmp,
                        "tokenizer": os.path.join(tmp, "tokenizer"), "seq_length": 2048, "packing": False,
                        "shuffle": False, "max_images_per_sample": 1},
               "training": {"global_batch_size": 1, "micro_batch_size": 1}}
        cfg = load_config(raw)
        enc = cfg.model.encoders["images"]
        paths = [os.path.join(tmp, "images", f"img{i:04d}.jpg") for i in range(args.images)]

        def header(p):
            with Image.open(p) as im:
                return im.size

        def decode(p):
            with Image.open(p) as im:
                return im.convert("RGB")

        t_header, dims = _per_image(header, paths)
        t_grid, grids = _per_image(lambda wh: native_grid(wh[0], wh[1], enc), dims)
        t_decode, images = _per_image(decode, paths)
        t_patches, cut = _per_image(lambda im: image_patches(im, enc), images)
        assert [g for _, g in cut] == grids  # the header's grid is the decoded image's
        ds = build_dataset(cfg)
        start = time.perf_counter()
        samples = [ds.sample(i) for i in range(args.images)]
        t_plan = (time.perf_counter() - start) / args.images
        packed = [s.items["images"] for s in samples]  # items decode on first access
        t_sample = (time.perf_counter() - start) / args.images
        items = sum(s.count("images") for s in samples)
        if items != args.images or sum(x.shape[0] for x in packed) != sum(t * h * w for t, h, w in grids):
            print(f"error: the pipeline kept {items} of {args.images} images", file=sys.stderr)
            raise SystemExit(2)
    patches = [t * h * w for t, h, w in grids]
    rate = lambda s: round(1.0 / s, 1)  # noqa: E731
    ms = lambda s: round(1e3 * s, 3)  # noqa: E731
    return {"images": args.images, "median_side": args.median_side, "sigma": args.sigma,
            "max_pixels": args.max_pixels,
            "source_pixels_median": int(statistics.median(w * h for w, h in sizes)),
            "patches_median": int(statistics.median(patches)), "patches_max": max(patches),
            "llm_tokens_mean": round(statistics.mean(p // 4 for p in patches), 1),
            "items_per_s": {"header": rate(t_header), "grid": rate(t_grid), "decode": rate(t_decode),
                            "image_patches": rate(t_patches), "decode+image_patches": rate(t_decode + t_patches),
                            "pipeline_plan": rate(t_plan), "pipeline_sample": rate(t_sample)},
            "ms_per_image": {"header": ms(t_header), "grid": ms(t_grid), "decode": ms(t_decode),
                             "image_patches": ms(t_patches), "pipeline_plan": ms(t_plan),
                             "pipeline_sample": ms(t_sample)}}


def bench_imbalance(args) -> dict:
    from mimo.balance.workload import WorkloadModel
    from mimo.config import load_config
    from mimo.data.items import divide_items, grid_tokens, imbalance, sample_item_bounds
    from mimo.data.native_images import native_grid

    cfg = load_config(EXAMPLE)
    enc = cfg.model.encoders["images"]
    enc.max_pixels = args.max_pixels
    work = WorkloadModel.from_model(cfg.model)
    rng = random.Random(args.seed + 1)
    rows = {dp: {"item_tokens": [], "sample_tokens": [], "item_vit_work": []} for dp in args.dp}
    all_tokens = []
    for _ in range(args.steps):
        counts = [rng.randint(1, 4) for _ in range(args.samples)]
        grids = [native_grid(*draw_size(rng, args.median_side, args.sigma), enc) for _ in range(sum(counts))]
        tokens = [grid_tokens(g, enc.spatial_merge_size) for g in grids]
        cost = [work.item_cost("images", g) for g in grids]
        all_tokens += tokens
        for dp in args.dp:
            bounds = divide_items(tokens, dp)
            r = rows[dp]
            r["item_tokens"].append(imbalance(bounds, tokens))
            # imbalance() on costs: integers only, so costs in nanoseconds.
            r["item_vit_work"].append(imbalance(bounds, [round(c * 1e9) for c in cost]))
            if args.samples % dp == 0:
                n = args.samples // dp
                r["sample_tokens"].append(imbalance(sample_item_bounds(counts, [k * n for k in range(dp + 1)]),
                                                    tokens))
    out = []
    for dp, r in rows.items():
        row = {"encoder_dp": dp}
        for key, vals in r.items():
            row[key] = {"mean": round(statistics.mean(vals), 3), "worst": round(max(vals), 3)} if vals else None
        out.append(row)
    return {"steps": args.steps, "samples_per_step": args.samples, "images_per_sample": "1-4",
            "median_side": args.median_side, "sigma": args.sigma, "max_pixels": args.max_pixels,
            "image_tokens": {"min": min(all_tokens), "median": int(statistics.median(all_tokens)),
                             "max": max(all_tokens)}, "rows": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--median-side", type=float, default=448.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--max-pixels", type=int, default=1003520)
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-pipeline", action="store_true")
    args = p.parse_args(argv)
    if min(args.images, args.samples, args.steps, *args.dp) < 1:
        print("error: --images, --samples, --steps and --dp must be positive", file=sys.stderr)
        return 2
    if not args.skip_pipeline:
        print(json.dumps({"pipeline": bench_pipeline(args)}), flush=True)
    print(json.dumps({"imbalance": bench_imbalance(args)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
