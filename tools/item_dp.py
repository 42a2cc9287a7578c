"""Encoder data parallelism over items: division imbalance, and boundary bytes / step time per layout.

    python tools/item_dp.py imbalance [--samples 8] [--dp 2 4 8 16 32] [--seed 0]
    python tools/item_dp.py bench [--encoder-dp 2 8] [--steps 4]

`imbalance` draws skewed image counts (most samples hold few images, a few hold
many), then prints, per encoder DP size, max / mean image tokens per encoder
rank for the item-level division (`mimo.data.items.divide_items`) and for the
former sample-level one (contiguous equal sample slices, where dp divides the
sample count). `bench` trains a tiny colocated model on 8 CPU ranks (gloo) with
the image encoder at each DP size and prints one JSON line per layout: bytes
each rank sent through the image boundary per step (forward + backward) and
the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.data.items import divide_items, imbalance, sample_item_bounds  # noqa: E402

TOKENS_PER_IMAGE = 64


def skewed_counts(samples: int, rng: random.Random):
    """Images per sample: Pareto-like, 8..96 (a few long documents hold most of the images)."""
    return [min(96, int(8 * rng.paretovariate(1.0))) for _ in range(samples)]


def cmd_imbalance(args):
    rng = random.Random(args.seed)
    counts = skewed_counts(args.samples, rng)
    tokens = [TOKENS_PER_IMAGE] * sum(counts)
    rows = []
    for dp in args.dp:
        item = imbalance(divide_items(tokens, dp), tokens)
        sample = None
        if args.samples % dp == 0:
            n = args.samples // dp
            sample = imbalance(sample_item_bounds(counts, [k * n for k in range(dp + 1)]), tokens)
        rows.append({"encoder_dp": dp, "item_level": round(item, 3),
                     "sample_level": None if sample is None else round(sample, 3)})
    print(json.dumps({"images_per_sample": counts, "tokens_per_image": TOKENS_PER_IMAGE, "rows": rows}))


def bench_config(encoder_dp: int):
    tp = 8 // encoder_dp
    return {
        "model": {
            "language": dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256,
                             max_sequence_length=256),
            "encoders": {"images": dict(kind="vision", num_layers=2, hidden_size=64, num_attention_heads=8,
                                        image_size=32, patch_size=8, frozen=False, projector={"kind": "mlp"})},
        },
        "parallelism": {"language": dict(tp=2, dp=4), "images": dict(tp=tp, dp=encoder_dp)},
        "data": {"kind": "mock", "seq_length": 256, "seed": 0, "max_images_per_sample": 4},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, "optimizer": "sgd", "lr": 0.01, "seed": 1},
    }


def _bench_rank(raw, steps):
    import torch.distributed as dist

    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    comm = trainer.comms["images"]
    times = []
    for step in range(steps + 1):  # step 0 warms up
        if step == 1:
            comm.traffic.reset()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(step)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"bytes_per_step": comm.traffic.total() / steps, "step_s": statistics.median(times[1:])}


def cmd_bench(args):
    from mimo.runtime import run_on_ranks

    for dp in args.encoder_dp:
        res = run_on_ranks(_bench_rank, 8, bench_config(dp), args.steps, timeout_s=900)
        per_rank = [int(r["bytes_per_step"]) for r in res]
        print(json.dumps({"layout": f"images tp{8 // dp} dp{dp}, language tp2 dp4, colocated on 8 ranks",
                          "encoder_dp": dp, "bytes_sent_per_rank_per_step": per_rank,
                          "max_bytes": max(per_rank), "step_time_ms": round(1000 * res[0]["step_s"], 1)}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("imbalance")
    a.add_argument("--samples", type=int, default=16)
    a.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bench")
    b.add_argument("--encoder-dp", type=int, nargs="+", default=[2, 8])
    b.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    (cmd_imbalance if args.cmd == "imbalance" else cmd_bench)(args)


if __name__ == "__main__":
    main()
