#!/usr/bin/env python
"""Time building and checking one step's plan (in-process, interpreter start-up excluded).

    python tools/bench_plan.py [--repeats 5] [--wide 192,384,768,1536] [--boundary 256x64,1024x256]
                               [--windows 1024x8]

Cases: a text-only LLM with 8 pipeline stages and 64 microbatches (8 ranks,
and the same on 32 ranks with tp 2, dp 2), a non-colocated graph with an
island (LLM pp 8, two encoders of different pp sharing 4 ranks, 64
microbatches), and the 64-rank LLaVA-7B example. Prints best-of-N build and
check times and the plan's size. `--wide N,...` adds wide worlds:
examples/configs/cpu_mixed_placement.yaml with the image encoder at dp D,
the LLM at tp 2 dp D/2 on the same ranks and the audio encoder at dp D/4 on
its own, N = 1.5 D ranks (the loss, norm and boundary meets span them all).
`--boundary SxD,...` times instead what an edge does per window and step: an
encoder at dp S feeding an LLM at tp 2 cp 2 dp D, 8 samples of 2 items (576
tokens each) per LLM shard: `EdgePlan.for_window` (mean of 10), the
colocated forward and backward routes of every rank (mean of 3) and one
rank's own moves, what its communicator lists (mean of 10). `--windows DxM,...` times what every rank
of a heterogeneous plan does per step to learn the step's boundary windows: an LLM at dp D with M
microbatches of one sample, two non-colocated encoders (images, audio) at dp D / 2, one item of each
per sample: `StepWindows` from the step's assignment, one encoder rank's item ids over the step and
one LLM rank's rows per microbatch of both edges (best of --repeats).
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


def wide(world: int):
    d = world * 2 // 3
    return load_config(os.path.join(ROOT, "examples", "configs", "cpu_mixed_placement.yaml"), [
        "parallelism.language.tp=2", f"parallelism.language.dp={d // 2}", f"parallelism.images.dp={d}",
        f"parallelism.audio.rank_offset={d}", f"parallelism.audio.dp={d // 4}",
        f"training.global_batch_size={d * 8}"])


def cases(wide_worlds=()):
    for n in wide_worlds:
        yield f"wide: cpu_mixed_placement at {n} ranks", wide(n)
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


def boundary(src_dp: int, dst_dp: int) -> str:
    from mimo.comm.plan import make_plan
    from mimo.data.items import divide_items
    from mimo.topology import Layout

    base = make_plan(Layout(dp=src_dp), Layout(tp=2, cp=2, dp=dst_dp), None)
    units = dst_dp * 8 * 2
    tokens = [576] * units
    t = time.perf_counter()
    for _ in range(10):
        window = base.for_window(divide_items(tokens, src_dp), [k * (units // dst_dp) for k in range(dst_dp + 1)],
                                 tokens)
    per_window = (time.perf_counter() - t) / 10
    t = time.perf_counter()
    for _ in range(3):
        window.colocated_forward_routes()
        window.colocated_backward_routes()
    routes = (time.perf_counter() - t) / 3
    rank = src_dp // 2  # what the communicator lists: one rank's own moves (mean over 10 calls)
    t = time.perf_counter()
    for _ in range(10):
        window.colocated_forward_moves_of(rank)
        window.colocated_backward_moves_of(rank)
    own = (time.perf_counter() - t) / 10
    return (f"boundary: encoder dp {src_dp} -> LLM tp2 cp2 dp {dst_dp}, {units} items, {len(window.pieces)} pieces: "
            f"for_window {per_window * 1e3:.1f} ms, colocated routes fwd+bwd {routes * 1e3:.1f} ms "
            f"(all ranks'), {own * 1e3:.3f} ms (one rank's own moves)")


def windows(dp: int, microbatches: int, repeats: int) -> str:
    from mimo.balance.assignment import contiguous
    from mimo.comm import make_plan
    from mimo.topology import Layout
    from mimo.training.step_data import encoded_item_ids
    from mimo.training.windows import StepWindows

    G, half = dp * microbatches, max(dp // 2, 1)
    raw = copy.deepcopy(TINY)
    raw["training"].update(global_batch_size=G, micro_batch_size=1)
    raw["parallelism"] = {"language": dict(dp=dp), "images": dict(dp=half, rank_offset=dp),
                          "audio": dict(dp=half, rank_offset=dp + half)}
    cfg = load_config(raw)
    lang = Layout.from_config(cfg.parallelism["language"])

    class Edge:  # what StepWindows reads of a communicator: its static plan
        def __init__(self, name):
            self.plan = make_plan(Layout.from_config(cfg.parallelism[name]), lang, None)

    comms = {n: Edge(n) for n in ("images", "audio")}
    counts = {n: [1] * G for n in comms}
    assignment = contiguous(G, dp, microbatches)

    def step():
        w = StepWindows(cfg, comms, counts, [], assignment)
        encoded_item_ids(w, "images", half // 2, [], microbatches)
        for mb in range(microbatches):
            for n in comms:
                w.llm_tokens(n, dp // 2, mb)

    _, s = best(step, repeats)
    return (f"windows: LLM dp {dp} x {microbatches} microbatches ({G} samples), two encoders at dp {half}: "
            f"{s * 1e3:.1f} ms per step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wide", default="", help="comma list of world sizes (multiples of 3) to add")
    parser.add_argument("--boundary", default="", help="comma list of SRCxDST encoder and LLM DP sizes: time "
                                                       "the per-window edge plan instead")
    parser.add_argument("--windows", default="", help="comma list of DxM LLM DP sizes and microbatch counts: "
                                                      "time the step's boundary windows instead")
    args = parser.parse_args()
    if args.windows:
        for pair in args.windows.split(","):
            print(windows(*(int(x) for x in pair.split("x")), args.repeats), flush=True)
        return
    if args.boundary:
        for pair in args.boundary.split(","):
            print(boundary(*(int(x) for x in pair.split("x"))), flush=True)
        return
    for name, cfg in cases([int(x) for x in args.wide.split(",") if x]):
        plan, build_s = best(lambda: build_plan(cfg), args.repeats)
        _, check_s = best(lambda: check_plan(plan), args.repeats)
        actions = sum(len(a) for a in plan.actions)
        print(f"{name}: {plan.family}, {plan.world_size} ranks, {num_microbatches(cfg)} microbatches, "
              f"{actions} actions; build {build_s * 1e3:.1f} ms, check {check_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
