#!/usr/bin/env python
"""Step-time cost of saving a checkpoint, synchronous vs asynchronous, on gloo ranks.

    python tools/bench_checkpoint.py --config examples/configs/cpu_noncolocated.yaml --steps 6 --dir /tmp/bench_ckpt

Trains the config on as many gloo ranks as its layout needs: without saving, saving
after every step (`training.async_save: false`), and saving after every step
asynchronously (megatron-core's writer process; on CPU ranks through
`mimo.runtime.checkpoint_scope`). Prints one JSON line per mode: the median step time
(train step + save hook, the slowest rank; the first step is left out as warm-up),
the difference to the run without saves, the checkpoint size and the time the
end-of-run `finish` waited for the last async save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _run(raw, steps):
    import torch.distributed as dist

    from mimo.checkpoint import checkpointer
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    ckpt = checkpointer(cfg, trainer, None)
    times = []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(step)
        if ckpt:
            ckpt.after_step(step)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    if ckpt:
        ckpt.finish()
    return {"times": times, "finish_s": time.perf_counter() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dir", default="/tmp/mimo_bench_ckpt", help="scratch directory for the checkpoints")
    args = p.parse_args(argv)
    from mimo.config import load_config
    from mimo.config.load import read_yaml
    from mimo.runtime import run_on_ranks

    base_raw = read_yaml(args.config)
    base_raw.setdefault("training", {}).update(train_iters=args.steps)
    world = load_config(base_raw).world_size
    baseline = None
    for mode in ("none", "sync", "async"):
        raw = json.loads(json.dumps(base_raw))
        d = os.path.join(args.dir, mode)
        shutil.rmtree(d, ignore_errors=True)
        if mode != "none":
            raw["training"].update(save=d, save_interval=1, async_save=mode == "async")
        results = run_on_ranks(_run, world, raw, args.steps, timeout_s=1200, daemon=False)
        per_step = [max(r["times"][s] for r in results) for s in range(1, args.steps)]
        median = statistics.median(per_step)
        if baseline is None:
            baseline = median
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d) for f in fs) if mode != "none" else 0
        print(json.dumps({"mode": mode, "ranks": world, "median_step_s": round(median, 4),
                          "save_cost_s": round(median - baseline, 4), "checkpoint_mb_all_kept": round(size / 2**20, 2),
                          "final_finish_s": round(max(r["finish_s"] for r in results), 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
