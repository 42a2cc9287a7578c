#!/usr/bin/env python
"""FP32 step-level parity of layouts against a baseline.

    python tools/parity.py BASELINE.yaml CANDIDATE.yaml [CANDIDATE.yaml ...] [--steps 3] [--rtol 1e-4]

Each config runs on as many CPU ranks (gloo) as its layout needs, FP32, with
identical initial weights and data. Prints one JSON object per candidate and
exits 0 only if every candidate is within tolerance (1 if not, 2 for bad input).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mimo.config import ConfigError  # noqa: E402
from mimo.config.load import read_yaml  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline")
    p.add_argument("candidates", nargs="+")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest accepted relative difference of losses, gradients and parameters")
    args = p.parse_args(argv)
    if args.steps < 1:
        print("error: --steps: must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.rtol < float("inf"):  # nan too: no difference would pass or fail right
        print(f"error: --rtol: must be a finite number >= 0, got {args.rtol}", file=sys.stderr)
        return 2
    from mimo.training.parity import adam_eps_hint, parity

    try:
        base = read_yaml(args.baseline)
        cands = [read_yaml(c) for c in args.candidates]
        reports = []
        for report in parity(base, cands, args.candidates, args.steps, args.rtol):
            print(json.dumps(report), flush=True)
            reports.append(report)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    hint = adam_eps_hint(base, reports, args.rtol)
    if hint:
        print(hint, file=sys.stderr)
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
