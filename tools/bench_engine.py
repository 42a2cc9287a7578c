#!/usr/bin/env python
"""Step time and peak step memory per rank of the training engine, on fixed small CPU-rank layouts.

    python tools/bench_engine.py [--steps 4] [--layouts a,b,c,d,e] [--json] [--tiny]
    python tools/bench_engine.py --table-of saved.json     # the table of an earlier --json run

Every layout trains the same FP32 model (LLM: 4 layers, hidden 128, sequence 192;
vision encoder: 2 layers, hidden 64, 64 tokens per image; Adam; global batch 8,
micro batch 2, so each step runs several microbatches) on gloo CPU ranks, each
rank single-threaded:

  a  tp2            LLM and encoder TP2 (2 ranks)
  b  text-pp2       text only, LLM PP2 (2 ranks)
  c  noncolocated   encoder on rank 0, LLM PP2 on ranks 1-2 (3 ranks)
  d  colocated      encoder TP1 x DP2 and LLM TP2 on the same 2 ranks (three-phase)
  e  pp2-colocated  LLM PP2 with the encoder DP2 on the same 2 ranks
  f  pp2-pipelined  LLM PP2 with the encoder PP2 on the same 2 ranks (not in the default set)

and, text only, the LLM made mixture-of-experts (8 experts of FFN 128, top 2, SwiGLU, RMSNorm,
no biases; not in the default set):

  g  moe-dp2              DP2, every rank holds all 8 experts (EP1)
  h  moe-dp2-ep2          DP2 with EP2 carved out of it: 4 experts per rank, tokens all-to-all
  i  moe-dp2-ep2-grouped  as h, the experts' GEMMs grouped (model.language.moe_grouped_gemm: true)

The trainer comes from `build_trainer`, so the same tool measures the engine of
whatever mimo is on the path. Each rank runs 1 warm-up step and `--steps` timed
steps and reports the median (and the minimum: on a shared machine, the least
disturbed) wall time of its timed `train_step` calls and its
peak resident memory above the resident memory just before the warm-up step
(ru_maxrss minus RSS then, in MiB; the warm-up step is included, so the
optimizer state it creates counts). Prints a markdown table, or one JSON object
per layout (lists indexed by rank) with --json. `--tiny` shrinks the model to
a smoke-test size (seconds per layout) for checking that the tool runs; its
figures say nothing about the engine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = {
    "language": dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=512,
                     max_sequence_length=256),
    "encoders": {
        "images": dict(kind="vision", num_layers=2, hidden_size=64, num_attention_heads=2, image_size=32,
                       patch_size=4, frozen=False, projector={"kind": "mlp"}),
    },
}
BASE = {
    "model": MODEL,
    "data": {"kind": "mock", "seq_length": 192, "seed": 3},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": 100, "optimizer": "adam",
                 "lr": 1.0e-3, "seed": 7, "precision": "fp32"},
}

# The LLM fields that make it mixture-of-experts (layouts g-i).
MOE = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, activation="swiglu",
           normalization="RMSNorm", add_bias_linear=False)

# name -> (description, parallelism[, LLM fields]); a parallelism without "images" is a text-only model.
LAYOUTS = {
    "a": ("tp2", {"language": dict(tp=2), "images": dict(tp=2)}),
    "b": ("text-pp2", {"language": dict(pp=2)}),
    "c": ("noncolocated", {"language": dict(pp=2, rank_offset=1), "images": dict(rank_offset=0)}),
    "d": ("colocated", {"language": dict(tp=2), "images": dict(dp=2)}),
    "e": ("pp2-colocated", {"language": dict(pp=2), "images": dict(dp=2)}),
    "f": ("pp2-pipelined", {"language": dict(pp=2), "images": dict(pp=2)}),
    "g": ("moe-dp2", {"language": dict(dp=2)}, MOE),
    "h": ("moe-dp2-ep2", {"language": dict(dp=2, ep=2)}, MOE),
    "i": ("moe-dp2-ep2-grouped", {"language": dict(dp=2, ep=2)}, dict(MOE, moe_grouped_gemm=True)),
}
DEFAULT_LAYOUTS = "a,b,c,d,e"
TINY_MODEL = {
    "language": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                     max_sequence_length=64),
    "encoders": {
        "images": dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2, image_size=8,
                       patch_size=4, frozen=False, projector={"kind": "mlp"}),
    },
}


def layout_config(key: str, tiny: bool = False) -> dict:
    """The raw config of one layout (validate it with mimo.config.load_config)."""
    raw = copy.deepcopy(BASE)
    if tiny:
        raw["model"] = copy.deepcopy(TINY_MODEL)
        raw["data"]["seq_length"] = 48
    par = copy.deepcopy(LAYOUTS[key][1])
    if "images" not in par:
        raw["model"]["encoders"] = {}
    raw["model"]["language"].update(LAYOUTS[key][2] if len(LAYOUTS[key]) > 2 else {})
    raw["parallelism"] = par
    return raw


def build_trainer(cfg, runtime):
    """The engine to measure. (The figures of the engines before the plan executor, in
    docs/benchmarks.md, were taken with this tool on commit c184960, where it built them.)"""
    from mimo.training import Trainer

    return Trainer(cfg, runtime)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark, so ru_maxrss covers the steps only, not a higher
    peak while the trainer was built. Linux >= 4.0; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(raw, steps: int):
    from mimo.config import load_config
    from mimo.runtime import select_runtime

    runtime = select_runtime("cpu")
    trainer = build_trainer(load_config(raw), runtime)
    before = _rss_mib()
    reset = _reset_peak_rss()
    times, losses = [], []
    for step in range(steps + 1):
        start = time.perf_counter()
        result = trainer.train_step(step)
        seconds = time.perf_counter() - start
        losses.append(result.loss)
        if step > 0:  # step 0 is the warm-up
            times.append(seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"step_ms": [1000 * t for t in times], "peak_mib": peak - before, "rss_before_mib": before,
            "peak_reset": reset, "losses": losses, "engine": type(trainer).__qualname__}


def run_layout(key: str, steps: int, tiny: bool = False, timeout_s: float = 900.0) -> dict:
    from mimo.config import load_config
    from mimo.runtime import run_on_ranks

    raw = layout_config(key, tiny)
    world = load_config(raw).world_size
    results = run_on_ranks(_measure, world, raw, steps, timeout_s=timeout_s)
    return {
        "layout": key, "name": LAYOUTS[key][0], "ranks": world, "steps": steps, "tiny": tiny,
        "parallelism": raw["parallelism"],
        "engine": [r["engine"] for r in results],
        "median_step_ms": [round(statistics.median(r["step_ms"]), 1) for r in results],
        "min_step_ms": [round(min(r["step_ms"]), 1) for r in results],
        "step_ms": [[round(t, 1) for t in r["step_ms"]] for r in results],
        "peak_mib": [round(r["peak_mib"], 1) for r in results],
        "rss_before_mib": [round(r["rss_before_mib"], 1) for r in results],
        "peak_reset": all(r["peak_reset"] for r in results),
        "loss": results[0]["losses"][-1],
    }


def _cells(xs) -> str:
    return " / ".join(f"{x:g}" for x in xs)


def markdown(rows) -> str:
    lines = ["| layout | ranks | engine (rank 0) | median step ms per rank | min step ms per rank "
             "| peak step MiB per rank | last loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} {r['name']} | {r['ranks']} | {r['engine'][0]} | {_cells(r['median_step_ms'])} "
                     f"| {_cells(r['min_step_ms'])} | {_cells(r['peak_mib'])} | {r['loss']:.6f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="timed steps after 1 warm-up step (default 4)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help=f"comma-separated layout keys from {','.join(LAYOUTS)} (default {DEFAULT_LAYOUTS})")
    p.add_argument("--json", action="store_true", help="one JSON object per layout instead of the table")
    p.add_argument("--tiny", action="store_true", help="a smoke-test model size: checks the tool, not the engine")
    p.add_argument("--table-of", metavar="FILE", help="print the table of a saved --json output and exit")
    args = p.parse_args(argv)
    if args.table_of:
        with open(args.table_of) as f:
            print(markdown([json.loads(line) for line in f if line.strip()]))
        return 0
    keys = [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = [k for k in keys if k not in LAYOUTS]
    if unknown or not keys:
        p.error(f"--layouts: unknown layout(s) {unknown or keys}; choose from {','.join(LAYOUTS)}")
    if args.steps < 1:
        p.error("--steps: must be at least 1")
    rows = []
    for key in keys:
        row = run_layout(key, args.steps, args.tiny)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
