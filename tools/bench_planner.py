#!/usr/bin/env python
"""Time the layout search (in-process, interpreter start-up excluded).

    python tools/bench_planner.py [--repeats 3]

Cases: the LLaVA-like example and a 3B ViT + 70B LLM at 8K tokens (50%
vision), each at 256 and 1024 H100s. Prints one line per case with the
best-of-N search time and the chosen layout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402

import paper_check  # noqa: E402
from mimo.planner.hardware import get_gpu  # noqa: E402
from mimo.planner.layout_search import LayoutSearch  # noqa: E402
from mimo.planner.megatron import Work  # noqa: E402
from mimo.planner.spec import read_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cases():
    with open(os.path.join(ROOT, "examples", "planner", "llava_like.yaml")) as fh:
        llava = read_model(yaml.safe_load(fh)["model"])
    big = read_model(paper_check.model_config("3B", "70B"))
    for gpus in (256, 1024):
        yield f"llava-like seq 2048, {gpus} GPUs", llava, Work(2048, {"images": 1.0}), 64, gpus
        yield f"3B ViT + 70B LLM seq 8192 50% vision, {gpus} GPUs", big, Work(8192, {"images": 4.0}), 256, gpus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for name, spec, work, gbs, gpus in cases():
        best, result = float("inf"), None
        for _ in range(args.repeats):
            s = LayoutSearch(spec, get_gpu("h100"), work, gbs, 1)  # fresh caches every time
            t0 = time.perf_counter()
            result = s.search(gpus)
            best = min(best, time.perf_counter() - t0)
        top = result[0]
        lay = ", ".join(f"{n} tp{q.tp} cp{q.cp} pp{q.pp} dp{q.dp}" for n, q in top.pars.items())
        print(f"{name}: search {best:.3f} s ({len(result)} layouts); best {top.estimate.placement}: {lay}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
