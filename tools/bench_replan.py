#!/usr/bin/env python
"""Restart-to-first-step time of an elastic re-plan, 6 -> 4 CPU ranks, with and without templates.

    python tools/bench_replan.py [--config examples/configs/cpu_noncolocated.yaml] [--workdir DIR]

Trains 4 steps on 6 ranks (`training.replan: auto`, a checkpoint every 2 steps; the first start
stores templates.json), then restarts on 4 ranks from that checkpoint twice: once reading the
stored template, once with templates.json removed (a fresh search). Prints, for each, the seconds
from launching torchrun to the first resumed step's record in the log, and the re-plan alone
(`load_for_world` in one process, best of 5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")


def launch(n, config, sets, log, out):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), SCRIPT,
            "--config", config, "--device", "cpu", "--log-json", log] + [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(args, stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def to_first_step(config, sets, log, out) -> float:
    """Seconds from launch to the first step record in `log` (the run then finishes its one step)."""
    t0 = time.perf_counter()
    p = launch(4, config, sets, log, out)
    first = None
    while p.poll() is None or first is None:
        if first is None and os.path.exists(log) and open(log).read().strip():
            first = time.perf_counter() - t0
        if p.poll() is not None and first is None:
            break
        time.sleep(0.05)
    if p.wait() != 0 or first is None:
        sys.exit(f"error: the 4-rank restart failed, see {out}")
    return first


def replan_only(config, sets) -> float:
    from mimo.checkpoint.replan import load_for_world

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        with open(os.devnull, "w") as null:
            stdout, sys.stdout = sys.stdout, null
            try:
                load_for_world(config, sets, 4, "cpu", 0, 4)
            finally:
                sys.stdout = stdout
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "cpu_noncolocated.yaml"))
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="bench_replan_")
    os.makedirs(work, exist_ok=True)
    ck = os.path.join(work, "ck")
    common = ["training.replan=auto", "training.train_iters=5"]
    p6 = launch(6, args.config, common + ["training.train_iters=4", f"training.save={ck}", "training.save_interval=2"],
                os.path.join(work, "six.jsonl"), os.path.join(work, "six.out"))
    if p6.wait() != 0:
        sys.exit(f"error: the 6-rank run failed, see {os.path.join(work, 'six.out')}")
    results = {}
    for mode in ("template", "search"):
        d = os.path.join(work, f"ck_{mode}")
        shutil.copytree(ck, d)
        if mode == "search":
            os.remove(os.path.join(d, "templates.json"))
        sets = common + [f"training.save={d}", f"training.load={d}/iter_0000004"]
        alone = replan_only(args.config, sets)
        log, out = os.path.join(work, f"{mode}.jsonl"), os.path.join(work, f"{mode}.out")
        first = to_first_step(args.config, sets, log, out)
        line = next((s for s in open(out) if s.startswith("replanned for")), "").strip()
        results[mode] = {"restart_to_first_step_s": round(first, 2), "replan_only_s": round(alone, 4), "line": line}
    print(json.dumps(results, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
