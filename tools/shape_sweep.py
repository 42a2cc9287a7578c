#!/usr/bin/env python
"""The paper check's targets over random model shapes of the paper's sizes.

    python tools/shape_sweep.py [--seeds 0:600] [--json]

The paper gives model sizes only, and #21's acceptance uses shapes of those
sizes that we do not know. For each seed this draws a plausible shape set
(``paper_check.random_shapes``: widths, depths, heads, query groups, gated
or not, vocabulary, image size), costs Tables A2-A4 and the crossover with
``tools/paper_check.py``'s rules, runs the two search targets of 1B + 7B on
32 GPUs (64K: heterogeneous, encoder CP 1, LLM CP >= 2, no slower than the
paper's colocated layout; 8K: LLM CP 1), and reports how many shape sets
meet each target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paper_check  # noqa: E402
from mimo.planner.megatron import Par  # noqa: E402

# The paper's colocated layout for 1B + 7B at 64K, 75% vision (Table A3).
PAPER_C_64K = {"language": Par(2, 8, 1, 2, True), "images": Par(1, 1, 1, 32, False, "none", 0)}


def search_targets(gpu: str = "h100") -> dict:
    """The search targets for 1B + 7B on 32 GPUs at 64K and 8K tokens, 75% vision."""
    s = paper_check._searcher("1B+7B", 65536, 75, 4, 1, gpu)
    best = s.search(32)[0]
    paper_c = s.evaluate(PAPER_C_64K)
    long_ok = (best.estimate.placement != "homogeneous" and best.pars["images"].cp == 1
               and best.pars["language"].cp >= 2 and best.estimate.step_time <= paper_c.step_time)
    short = paper_check._searcher("1B+7B", 8192, 75, 64, 1, gpu).search(32)[0]
    return {"search_64k": long_ok, "search_8k_cp1": short.pars["language"].cp == 1}


def targets(seed: int, gpu: str = "h100") -> dict:
    """Every target of the paper check for the shape set ``random:seed``:
    True / False per met-or-not target, "hit/rows" counts for the per-row ones."""
    paper_check.use_shapes(f"random:{seed}")
    try:
        a2 = paper_check.metrics("A2", paper_check.rows("A2", gpu), gpu)
        a3 = paper_check.metrics("A3", paper_check.rows("A3", gpu), gpu)
        a4 = paper_check.metrics("A4", paper_check.rows("A4", gpu), gpu)
        x = paper_check.crossover(gpu)
        search = search_targets(gpu)
    finally:
        paper_check.use_shapes("ours")
    return {
        "a3_big_gains": a3["big_gains_predicted"],
        "a3_spearman": a3["spearman_gain"] >= 0.5,
        "a3_time_median": 0.6 <= a3["step_ratio_median"] <= 1.6,
        "a3_time_within": a3["step_ratio_within_0.5_2"] >= 0.75,
        "a3_memory_within": a3["memory_within_40pct"] >= 0.75,
        "a3_memory_max": a3["max_predicted_memory_gb"] <= 100,
        "a2_par_or_slower": a2["par_or_slower_below_8"],
        "crossover_large": x["non_colocated_beats_c_large"],
        **search,
        "a2_big_gains": a2["big_gains_hit"],
        "a4_big_gains": a4["big_gains_hit"],
        "crossover_small": x["colocated_beats_h_small"],
        "a3_time_median_value": a3["step_ratio_median"],
        "a3_memory_max_gb": a3["max_predicted_memory_gb"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--seeds", default="0:600", help="seed range A:B (B excluded)")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--json", action="store_true", help="one JSON object per seed")
    args = p.parse_args(argv)
    lo, sep, hi = args.seeds.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        print(f"error: --seeds: expected A:B with A < B, got {args.seeds!r}", file=sys.stderr)
        return 2
    results = [targets(seed, args.gpu) for seed in range(int(lo), int(hi))]
    if args.json:
        for seed, r in zip(range(int(lo), int(hi)), results):
            print(json.dumps({"seed": seed, **r}))
        return 0
    n = len(results)
    print(f"{n} random shape sets (seeds {args.seeds})")
    for key, value in results[0].items():
        if isinstance(value, bool):
            print(f"  {key}: {sum(r[key] for r in results)}/{n}")
        elif isinstance(value, str):
            counts = sorted(Counter(r[key] for r in results).items(), key=lambda kv: int(kv[0].split("/")[0]))
            print(f"  {key}: " + ", ".join(f"{k} in {c}" for k, c in counts))
        else:
            vals = sorted(r[key] for r in results)
            print(f"  {key}: min {vals[0]}, median {vals[n // 2]}, max {vals[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
