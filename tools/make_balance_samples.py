#!/usr/bin/env python
"""Write a skewed synthetic sample stream for tools/balance.py (JSONL of id/text_tokens/image_tokens).

    python tools/make_balance_samples.py --out FILE.jsonl [--samples N] [--seed S]

Text lengths are lognormal (median e^5.5 ~ 245 tokens, sigma 1.0) clipped to
[20, 3000]; every sample holds 0-4 images (uniform) of 576 tokens each.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

IMAGE_TOKENS = 576


def skewed(n: int, seed: int = 0):
    """(text tokens, image tokens) of n samples of the benchmark distribution."""
    rng = np.random.default_rng(seed)
    text = np.clip(rng.lognormal(5.5, 1.0, n), 20, 3000).astype(np.int64)
    return text, rng.integers(0, 5, n) * IMAGE_TOKENS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    text, image = skewed(args.samples, args.seed)
    with open(args.out, "w") as fh:
        for i, (t, im) in enumerate(zip(text.tolist(), image.tolist())):
            fh.write(json.dumps({"id": f"s{i}", "text_tokens": t, "image_tokens": im}) + "\n")


if __name__ == "__main__":
    main()
