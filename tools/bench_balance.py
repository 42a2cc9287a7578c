#!/usr/bin/env python
"""Benchmark data-aware microbatching (`data.balance`) on a skewed synthetic distribution.

    python tools/bench_balance.py [--steps 5] [--img-dir docs/img]

Samples come from tools/make_balance_samples.py (lognormal text, 0-4 images of
576 tokens); work per sample from the LLaVA-1.5-like 7B workload estimate.
Prints markdown tables: per-microbatch LLM / encoder workload CV per policy and
micro-batch size (4,096 samples per step, 16 DP ranks), planning time per step
for 4,096 samples, and the simulated step time of the 64-GPU layout in
examples/configs/balance_llava7b_64gpu.yaml. With --img-dir, also draws
balance_workloads.png and balance_timeline.png there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from make_balance_samples import skewed  # noqa: E402
from mimo.balance import POLICIES, Pipeline, WorkloadModel, assign, cv, microbatch_loads  # noqa: E402
from mimo.planner.api import load_raw  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "configs", "balance_llava7b_64gpu.yaml")
STEP, DP = 4096, 16


def cv_table(work, steps):
    print("| micro-batch size | microbatches per rank | LLM CV none | mmscale | entrain | "
          "reduction mmscale | reduction entrain | encoder CV none | mmscale | entrain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in (1, 2, 4, 8, 16, 32):
        M = STEP // (DP * m)
        llm_cv = {p: [] for p in POLICIES}
        enc_cv = {p: [] for p in POLICIES}
        for s in range(steps):
            enc, llm = work.from_tokens(*skewed(STEP, seed=s))
            for p in POLICIES:
                a = assign(p, enc, llm, DP, M)
                llm_cv[p].append(cv(microbatch_loads(llm, a.llm)))
                enc_cv[p].append(cv(microbatch_loads(enc, a.encoder)))
        L = {p: float(np.mean(v)) for p, v in llm_cv.items()}
        E = {p: float(np.mean(v)) for p, v in enc_cv.items()}
        print(f"| {m} | {M} | {L['none']:.4f} | {L['mmscale']:.4f} | {L['entrain']:.4f} | "
              f"{L['none'] / L['mmscale']:.1f}x | {L['none'] / L['entrain']:.1f}x | "
              f"{E['none']:.4f} | {E['mmscale']:.4f} | {E['entrain']:.4f} |")


def timing_table(work, pipeline, repeats=20):
    text, image = skewed(STEP, seed=0)
    m = 8
    M = STEP // (DP * m)
    print("| policy | planning time per step, median wall (ms) | median CPU time of the process (ms) | "
          "least CPU time (ms) | of which workload estimate, wall (ms) |")
    print("|---|---|---|---|---|")
    rows = [("none", None), ("mmscale", None), ("mmscale + simulator check", pipeline), ("entrain", None)]
    for name, pipe in rows:
        policy = name.split()[0]
        total, cpu, est = [], [], []
        for r in range(repeats + 2):
            c0, t0 = time.process_time(), time.perf_counter()
            enc, llm = work.from_tokens(text, image)
            t1 = time.perf_counter()
            assign(policy, enc, llm, DP, M, pipe)
            t2, c2 = time.perf_counter(), time.process_time()
            if r >= 2:  # warm-up
                total.append(t2 - t0)
                cpu.append(c2 - c0)
                est.append(t1 - t0)
        print(f"| {name} | {1e3 * statistics.median(total):.2f} | {1e3 * statistics.median(cpu):.2f} | "
              f"{1e3 * min(cpu):.2f} | {1e3 * statistics.median(est):.3f} |")


def step_table(work, pipeline, raw, steps):
    tr = raw["training"]
    D = raw["parallelism"]["language"]["dp"]
    m = tr["micro_batch_size"]
    M = tr["global_batch_size"] // (D * m)
    times = {p: [] for p in POLICIES}
    for s in range(steps):
        enc, llm = work.from_tokens(*skewed(D * M * m, seed=100 + s))
        for p in POLICIES:
            times[p].append(pipeline.step_time(enc, llm, assign(p, enc, llm, D, M, pipeline)))
    base = float(np.mean(times["none"]))
    print(f"| policy | simulated step time (s) | gain vs none |")
    print("|---|---|---|")
    for p in POLICIES:
        t = float(np.mean(times[p]))
        print(f"| {p} | {t:.3f} | {base / t:.3f}x |")
    return D, M, m


def pictures(work, pipeline, D, M, m, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    enc, llm = work.from_tokens(*skewed(D * M * m, seed=100))
    got = {p: assign(p, enc, llm, D, M, pipeline) for p in POLICIES}
    fig, axes = plt.subplots(len(POLICIES), 2, figsize=(11, 7), sharex=True, sharey="col")
    for row, p in enumerate(POLICIES):
        a = got[p]
        for col, (name, work_of, lists) in enumerate((("encoder", enc, a.encoder[0]), ("LLM", llm, a.llm[0]))):
            loads = [work_of[mb].sum() for mb in lists]
            ax = axes[row, col]
            ax.bar(range(M), loads, color="tab:green" if col == 0 else "tab:orange")
            ax.axhline(np.mean(loads), color="k", lw=0.8, ls="--")
            ax.set_title(f"{p}: {name} work per microbatch (CV {cv(loads):.3f})", fontsize=9)
            ax.set_ylabel("seconds (1 GPU)")
    for ax in axes[-1]:
        ax.set_xlabel("microbatch (execution order), DP rank 0")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "balance_workloads.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(POLICIES), 1, figsize=(12, 7), sharex=True)
    for ax, p in zip(axes, POLICIES):
        a = got[p]
        res = pipeline.replica_time(enc, llm, a.encoder[0], a.llm[0], record=True)
        names = sorted({e[0] for e in res.events}, key=lambda n: (not n.startswith("enc"), n))
        for stage, kind, k, start, end in res.events:
            y = names.index(stage)
            ax.barh(y, end - start, left=start, color="tab:blue" if kind == "F" else "tab:red",
                    edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_title(f"{p}: simulated step of DP rank 0, {res.iteration_time:.2f} s "
                     f"(forward blue, backward red)", fontsize=9)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "balance_timeline.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--img-dir")
    args = ap.parse_args()
    raw = load_raw(CONFIG)
    work = WorkloadModel.from_model(raw["model"])
    pipeline = Pipeline.from_parallelism(raw["parallelism"], work)
    print(f"## Per-microbatch workload CV ({STEP} samples per step, dp {DP}, mean of {args.steps} steps)\n")
    cv_table(work, args.steps)
    print(f"\n## Planning time per step ({STEP} samples, dp {DP}, micro-batch size 8)\n")
    timing_table(work, pipeline)
    print(f"\n## Simulated step time, 64-GPU layout ({os.path.basename(CONFIG)}, mean of {args.steps} steps)\n")
    D, M, m = step_table(work, pipeline, raw, args.steps)
    if args.img_dir:
        pictures(work, pipeline, D, M, m, args.img_dir)


if __name__ == "__main__":
    main()
