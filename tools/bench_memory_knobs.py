#!/usr/bin/env python
"""Peak memory of a training step with and without the memory knobs (`sp`, `recompute`).

    python tools/bench_memory_knobs.py [--seq-length 512] [--hidden 256] [--layers 4] [--micro-batch 4]
                                       [--device cpu|cuda] [--json]

Runs a multimodal model whose LLM activations dominate (long sequence, narrow
model) for two FP32 training steps, each setting in fresh processes:

* 1 rank: `recompute: none | selective | full` for every module;
* TP2 (2 ranks): `sp: false | true` (recompute none).

CPU: the figure is the step's peak resident memory above the resident memory
just before the first step (ru_maxrss minus RSS then), max over ranks, in MiB:
what the step itself added (activations, gradients, temporaries). CUDA: peak
allocated CUDA memory (torch.cuda.max_memory_allocated) during the steps.
Prints a markdown table (or one JSON object per setting with --json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BASE = {
    "model": {
        "language": dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=512,
                         max_sequence_length=1024),
        "encoders": {
            "images": dict(kind="vision", num_layers=2, hidden_size=64, num_attention_heads=2, image_size=32,
                           patch_size=4, frozen=False, projector={"kind": "mlp"}),
        },
    },
    "parallelism": {"language": {}, "images": {}},
    "data": {"seq_length": 1024, "seed": 3},
    "training": {"global_batch_size": 4, "micro_batch_size": 4, "train_iters": 2, "optimizer": "sgd", "lr": 0.01,
                 "seed": 7, "precision": "fp32"},
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _measure(raw, device: str):
    import torch

    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    runtime = select_runtime(device)
    trainer = Trainer(load_config(raw), runtime)
    before = _rss_mib()
    if runtime.is_cuda:
        torch.cuda.reset_peak_memory_stats(runtime.device)
        base = torch.cuda.memory_allocated(runtime.device)
    start = time.perf_counter()
    for step in range(raw["training"]["train_iters"]):
        loss = trainer.train_step(step).loss
    seconds = (time.perf_counter() - start) / raw["training"]["train_iters"]
    if runtime.is_cuda:
        return {"peak_mib": (torch.cuda.max_memory_allocated(runtime.device) - base) / 2 ** 20,
                "step_s": seconds, "loss": loss}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_mib": peak - before, "step_s": seconds, "loss": loss}


def config(args, tp: int, sp: bool, recompute: str):
    raw = copy.deepcopy(BASE)
    lang = raw["model"]["language"]
    lang.update(num_layers=args.layers, hidden_size=args.hidden, max_sequence_length=args.seq_length)
    raw["data"]["seq_length"] = args.seq_length
    raw["training"].update(global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch)
    for p in raw["parallelism"].values():
        p.update(tp=tp, sp=sp, recompute=recompute)
    return raw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from mimo.runtime import run_on_ranks

    settings = [(1, False, "none"), (1, False, "selective"), (1, False, "full"), (2, False, "none"), (2, True, "none")]
    rows = []
    for tp, sp, recompute in settings:
        results = run_on_ranks(_measure, tp, config(args, tp, sp, recompute), args.device, timeout_s=900)
        row = {"tp": tp, "sp": sp, "recompute": recompute, "device": args.device,
               "peak_mib": round(max(r["peak_mib"] for r in results), 1),
               "step_s": round(max(r["step_s"] for r in results), 3), "loss": results[0]["loss"]}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        what = "step peak RSS above pre-step RSS" if args.device == "cpu" else "peak CUDA allocated"
        print(f"| tp | sp | recompute | {what} (MiB) | vs. same tp, no knob | step (s) | loss |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            base = next(r for r in rows if r["tp"] == row["tp"] and not r["sp"] and r["recompute"] == "none")
            print(f"| {row['tp']} | {str(row['sp']).lower()} | {row['recompute']} | {row['peak_mib']} | "
                  f"{row['peak_mib'] / base['peak_mib']:.2f}x | {row['step_s']} | {row['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
