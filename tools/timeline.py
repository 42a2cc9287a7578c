#!/usr/bin/env python
"""Draw a pipeline timeline: a measured step (Chrome trace from `training.timeline`) or the planner's prediction.

    python tools/timeline.py TRACE.json --out FILE.png                 # measured: one row per rank
    python tools/timeline.py --simulate CONFIG.yaml --out FILE.png [--gpu h100]
                                                                       # predicted: one row per pipeline stage

Colour per module; forwards solid, backwards hatched and labelled "B", boundary
communication grey; the number in a box is its microbatch. The prediction comes
from mimo.planner's cost model and event simulator for the config's own layout
(colocated encoders: phase 1 forwards, the LLM's 1F1B, phase 3 backwards).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import List, NamedTuple, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Box(NamedTuple):
    row: str
    module: str
    action: str   # F | B | comm
    microbatch: int
    start: float  # seconds
    dur: float


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# -- measured -----------------------------------------------------------------------------------------

def read_trace(path: str) -> Tuple[List[Box], List[str]]:
    """Boxes and row names (one per rank, in rank order) of a Chrome trace written by mimo."""
    with open(path) as fh:
        try:
            trace = json.load(fh)
        except ValueError as exc:  # e.g. a --log-json file (one JSON object per line) given instead
            raise ValueError(f"{path}: not a Chrome trace (invalid JSON: {exc})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (expected {{\"traceEvents\": [...]}})")
    boxes, ranks = [], set()
    for e in trace["traceEvents"]:
        if e.get("ph") == "M":
            ranks.add(e["pid"])
        if e.get("ph") != "X":
            continue
        ranks.add(e["pid"])
        a = e.get("args", {})
        module, action, mb = a.get("module"), a.get("action"), a.get("microbatch")
        if module is None:  # a trace from elsewhere: "module action microbatch"
            module, action, mb = (e["name"].split() + ["F", "0"])[:3]
        boxes.append(Box(f"rank {e['pid']}", module, action, int(mb), e["ts"] / 1e6, e["dur"] / 1e6))
    return boxes, [f"rank {r}" for r in sorted(ranks)]


# -- predicted ----------------------------------------------------------------------------------------

def simulate(config: str, gpu: str) -> Tuple[List[Box], List[str]]:
    """The planner's predicted step for the config's layout: boxes, row names (pipeline stages)."""
    from mimo.config import LANGUAGE, load_config, placement
    from mimo.data import MockMultimodalDataset
    from mimo.planner.cost_model import Workload
    from mimo.planner.hardware import get_gpu
    from mimo.planner.search import Candidate, Planner, SearchSettings
    from mimo.planner.simulator import chain, simulate_1f1b
    from mimo.planner.spec import read_model
    from mimo.planner.stages import Layout
    from mimo.planner.api import load_raw

    cfg = load_config(config)
    raw = load_raw(config)
    spec = read_model(raw.get("model"))
    tr, par = cfg.training, cfg.parallelism
    G, m = tr.global_batch_size, tr.micro_batch_size
    # Items per sample as the step's data has them (the mock data is deterministic).
    samples = [MockMultimodalDataset(cfg).sample(i) for i in range(G)]
    items = {n: sum(s.items[n].shape[0] for s in samples if n in s.items) / G for n in cfg.model.encoders}
    settings = SearchSettings(cfg.world_size, G, m, Workload(cfg.data.seq_length, items), tr.precision,
                              tr.optimizer)
    hw = get_gpu(gpu)
    lang = par[LANGUAGE]
    lay = lambda p: Layout(p.tp, p.cp, p.pp, p.dp, p.rank_offset)  # noqa: E731
    colocated = [n for n in cfg.model.encoders if placement(par[n], lang) == "colocated"]
    remote = [n for n in cfg.model.encoders if n not in colocated]
    M = G // (m * lang.dp)

    # Phase 2 (or the whole step without colocated encoders): the graph of remote encoders and the LLM.
    graph_spec = dataclasses.replace(spec, encoders=tuple(e for e in spec.encoders if e.name in remote))
    planner = Planner(graph_spec, hw, settings)
    plans = {LANGUAGE: planner.plan(spec.language, lay(lang), m)}
    for n in remote:
        plans[n] = planner.plan(spec.module(n), lay(par[n]), m * lang.dp / par[n].dp)
    # Encoders on one rank range with one pp run as merged stages; an island (different pp) is drawn
    # as parallel chains (the simulator has no all-forwards-then-all-backwards island model).
    shared = len(remote) > 1 and len({(par[n].ranks, par[n].pp) for n in remote}) == 1
    cand = Candidate("timeline", "non-colocated" if remote else "single", plans, M, 0.0, {}, 0.0,
                     cfg.world_size, 0.0, encoder_grouping="shared" if shared else "parallel")
    graph = planner.stage_graph(cand) if remote else planner.llm_stages(plans[LANGUAGE], {})

    def stage_row(name: str) -> Tuple[str, str]:
        module, stage = name.rsplit(".", 1)
        if module == "encoders":  # encoders merged on one shared rank range
            return f"{'+'.join(remote)} stage {stage}", remote[0]
        return f"{module} stage {stage}", module

    boxes: List[Box] = []
    t0 = 0.0
    # Phase 1 / phase 3 of colocated encoders: each streams its chunks through its stages.
    passes = {}
    full = Planner(spec, hw, settings)  # colocated encoders are planned against the whole model
    for n in colocated:
        p = par[n]
        per_replica = G // p.dp
        chunk = m if per_replica % m == 0 else 1
        plan = full.plan(spec.module(n), lay(p), chunk)
        passes[n] = (plan, per_replica // chunk)
    for n, (plan, chunks) in passes.items():
        res = simulate_1f1b(chain(f"{n}.", plan.stage_forward, [0.0] * len(plan.stage_forward)), chunks, record=True)
        boxes += [Box(stage_row(s)[0], n, "F", k, t0 + a, b - a) for s, _, k, a, b in res.events]
        t0 += res.iteration_time
    res = simulate_1f1b(graph, M, record=True)
    for s, kind, k, a, b in res.events:
        row, module = stage_row(s)
        boxes.append(Box(row, module, kind, k, t0 + a, b - a))
    t0 += res.iteration_time
    for n, (plan, chunks) in passes.items():
        back = list(reversed(plan.stage_backward))
        if not any(v > 0 for v in back):
            continue
        pp = len(back)
        res = simulate_1f1b(chain("r.", back, [0.0] * pp), chunks, record=True)
        for s, _, k, a, b in res.events:
            stage = pp - 1 - int(s.split(".")[1])
            boxes.append(Box(f"{n} stage {stage}", n, "B", k, t0 + a, b - a))
        t0 += res.iteration_time
    order = [f"{n} stage {s}" for n in colocated for s in range(par[n].pp)]
    order += [stage_row(s.name)[0] for s in graph]
    return boxes, list(dict.fromkeys(order))


# -- drawing ------------------------------------------------------------------------------------------

def draw(boxes: List[Box], rows: List[str], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modules = list(dict.fromkeys(b.module for b in boxes))
    palette = plt.get_cmap("tab10")
    colour = {mod: palette(i % 10) for i, mod in enumerate(modules)}
    y = {r: i for i, r in enumerate(rows)}
    end = max((b.start + b.dur for b in boxes), default=1.0) or 1.0
    scale, unit = (1e3, "ms") if end < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.4), dpi=90)
    for b in boxes:
        row = y[b.row]
        if b.action == "comm":
            ax.broken_barh([(b.start * scale, b.dur * scale)], (row - 0.15, 0.3), facecolors="0.6")
            continue
        back = b.action == "B"
        ax.broken_barh([(b.start * scale, b.dur * scale)], (row - 0.4, 0.8), facecolors=colour[b.module],
                       edgecolors="black", linewidth=0.4, hatch="///" if back else None, alpha=0.65 if back else 1.0)
        if b.dur > 0.015 * end:
            ax.text((b.start + b.dur / 2) * scale, row, f"{'B' if back else ''}{b.microbatch}", ha="center",
                    va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)
    legend = [Patch(facecolor=colour[mod], label=mod) for mod in modules]
    legend += [Patch(facecolor="white", edgecolor="black", hatch="///", label="backward"),
               Patch(facecolor="0.6", label="boundary comm")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv=None) -> int:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="Chrome trace written by training.timeline")
    p.add_argument("--simulate", metavar="CONFIG.yaml", help="draw the planner's predicted step for this config")
    p.add_argument("--gpu", default="h100", help="device type of the prediction (planner table: h100, h200, a100, cpu)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    if (args.trace is None) == (args.simulate is None):
        p.error("give a trace file or --simulate CONFIG.yaml (one of them)")
    from mimo.config.outputs import output_problem

    problem = output_problem(args.out, "file")
    if problem:
        print(f"error: --out: {problem}", file=sys.stderr)
        return 2
    try:
        if args.simulate:
            boxes, rows = simulate(args.simulate, args.gpu)
            title = f"predicted step: {os.path.basename(args.simulate)} ({args.gpu}, mimo.planner)"
        else:
            boxes, rows = read_trace(args.trace)
            title = f"measured step: {os.path.basename(args.trace)}"
    except OSError as exc:
        print(f"error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    draw(boxes, rows, args.out, title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
