#!/usr/bin/env python
"""Plan per-module layouts for a mimo model on N GPUs.

    python tools/plan.py --config MODEL.yaml --gpus N [--gpu h100] [--top K] [--out FILE]

Prints the best candidate layouts, then a complete config for the best one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.planner.api import make_plan  # noqa: E402
from mimo.planner.emit import to_yaml  # noqa: E402
from mimo.planner.hardware import GIB  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the CLI contract asks
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _load_samples(path: str):
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, list) or not all(
            isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) and x >= 0 for x in s)
            for s in data):
        raise ValueError(f"{path}: expected a JSON list of [text_tokens, images, audio_clips]")
    return [tuple(s) for s in data]


def _table(result, top: int) -> str:
    rows = [("#", "placement", "layout", "step s", "samples/s", "mem GiB", "bubble", "why")]
    g = result.settings.global_batch
    for i, c in enumerate(result.candidates[:top], 1):
        fam = c.family + (f"/{c.encoder_grouping}" if c.encoder_grouping and len(result.spec.encoders) > 1 else "")
        busy = _bubble(result, c)
        rows.append((str(i), fam, c.describe(), f"{c.step_time:.3f}", f"{g / c.step_time:.1f}",
                     f"{c.peak_memory / GIB:.1f}", busy, "; ".join(c.reasons)))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1])
    return "\n".join(lines)


def _bubble(result, cand) -> str:
    # share of the step the LLM's busiest stage is idle
    llm = cand.plans["language"]
    work = cand.num_microbatches * llm.bottleneck
    return f"{max(0.0, 1 - work / cand.pipeline_time):.0%}" if cand.pipeline_time > 0 else "-"


def main(argv=None) -> int:
    p = _Parser(description=__doc__.splitlines()[1])
    p.add_argument("--config", required=True, help="model YAML (parallelism optional)")
    p.add_argument("--gpus", required=True, type=int, help="GPU budget")
    p.add_argument("--gpu", default="h100", help="h100 | h200 | a100 | cpu")
    p.add_argument("--top", type=int, default=5, help="candidates to list")
    p.add_argument("--out", help="write the best config here")
    p.add_argument("--global-batch", type=int, help="override training.global_batch_size")
    p.add_argument("--micro-batch", type=int, help="override training.micro_batch_size")
    p.add_argument("--samples", help="JSON list of [text_tokens, images, audio_clips] to profile")
    args = p.parse_args(argv)
    try:
        if args.top < 1:
            raise ValueError("--top must be >= 1")
        samples = _load_samples(args.samples) if args.samples else None
        result = make_plan(args.config, args.gpus, args.gpu, samples=samples,
                           global_batch=args.global_batch, micro_batch=args.micro_batch)
        text = to_yaml(result.config)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
    except (ValueError, OSError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg}", file=sys.stderr)
        return 2
    s = result.settings
    print(f"# {len(result.candidates)} candidates simulated for {s.gpus} x {args.gpu}, "
          f"global batch {s.global_batch}, micro batch {s.micro_batch}, seq {s.workload.seq_length}")
    if result.profile:
        pr = result.profile
        ratio = ", ".join(f"{k} {v:.2f}" for k, v in pr.ratio.items())
        print(f"# workload ratio ({'stable' if pr.stable else 'NOT stable'} at profiling batch "
              f"{pr.batch_size}): {ratio}")
    print(_table(result, args.top))
    print()
    print("# best config" + (f" (written to {args.out})" if args.out else ""))
    print(text, end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
