#!/usr/bin/env python
"""Time building and checking one step's plan (in-process, interpreter start-up excluded).

    python tools/bench_plan.py [--repeats 5]

Cases: a text-only LLM with 8 pipeline stages and 64 microbatches (8 ranks,
and the same on 32 ranks with tp 2, dp 2), a non-colocated graph with an
island (LLM pp 8, two encoders of different pp sharing 4 ranks, 64
microbatches), and the 64-rank LLaVA-7B example. Prints best-of-N build and
check times and the plan's size.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from mimo.config import load_config  # noqa: E402
from mimo.schedule.check import check_plan  # noqa: E402
from mimo.schedule.plan import build_plan
from mimo.schedule.plan_build import num_microbatches  # noqa: E402
from tiny import TINY  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_only(**layout):
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["num_layers"] = 8
    raw["model"]["encoders"] = {}
    raw["parallelism"] = {"language": dict(layout)}
    raw["training"]["micro_batch_size"] = 1
    raw["training"]["global_batch_size"] = 64 * layout.get("dp", 1)
    return raw


def island():
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["num_layers"] = 8
    raw["model"]["encoders"]["images"]["num_layers"] = 2
    raw["parallelism"] = {"language": {"pp": 8}, "images": {"pp": 2, "dp": 2, "rank_offset": 8},
                          "audio": {"dp": 4, "rank_offset": 8}}
    raw["training"].update(micro_batch_size=1, global_batch_size=64)
    return raw


def cases():
    yield "text-only pp8, 64 microbatches, 8 ranks", load_config(text_only(pp=8))
    yield "text-only tp2 dp2 pp8, 64 microbatches, 32 ranks", load_config(text_only(tp=2, dp=2, pp=8))
    yield "non-colocated island: LLM pp8 + images pp2 dp2 / audio dp4 on 4 shared ranks", load_config(island())
    yield "examples/configs/balance_llava7b_64gpu.yaml", load_config(
        os.path.join(ROOT, "examples", "configs", "balance_llava7b_64gpu.yaml"))


def best(fn, repeats):
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, cfg in cases():
        plan, build_s = best(lambda: build_plan(cfg), args.repeats)
        _, check_s = best(lambda: check_plan(plan), args.repeats)
        actions = sum(len(a) for a in plan.actions)
        print(f"{name}: {plan.family}, {plan.world_size} ranks, {num_microbatches(cfg)} microbatches, "
              f"{actions} actions; build {build_s * 1e3:.1f} ms, check {check_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
