#!/usr/bin/env python
"""Time what every rank does with each mock sample of a step when it plans the step (in-process).

    python tools/bench_mock_plan.py [--config examples/configs/cpu_demo.yaml] [--seq 4096] [--samples 1024]

Makes `--samples` mock samples and reads what planning reads of each (its length and loss
positions), best of 3 after a warm-up; prints the time per sample. Token ids and item inputs are
made only when a rank trains on or encodes the sample, so they are not part of this.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.config import apply_overrides, load_config, read_yaml  # noqa: E402
from mimo.data.mock import MockMultimodalDataset  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--config", default="examples/configs/cpu_demo.yaml")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--samples", type=int, default=1024)
    args = p.parse_args(argv)
    raw = apply_overrides(read_yaml(args.config), [f"data.seq_length={args.seq}",
                                                   f"model.language.max_sequence_length={args.seq}"])
    cfg = load_config(raw)
    ds = MockMultimodalDataset(cfg)
    for i in range(50):  # first calls pay torch's lazy set-up
        ds.sample(10 ** 6 + i).token_count()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        samples = [ds.sample(i) for i in range(args.samples)]
        sum(s.token_count() + s.loss_count(cfg.placeholder_ids) for s in samples)
        best = min(best, time.perf_counter() - t)
    print(f"mock planning: {args.samples} samples of {args.seq} tokens ({args.config}): {best * 1e3:.0f} ms, "
          f"{best / args.samples * 1e3:.3f} ms a sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())
