#!/usr/bin/env python
"""Time to checksum a checkpoint for its manifest: one process vs the ranks' shares.

    python tools/bench_manifest.py --dir /tmp/bench_manifest --files 32 --mib 4096 --ranks 1 2 4

Writes `--files` random files of `--mib` MiB in all (once; reused when they are there),
then for each rank count times `mimo.checkpoint.manifest.gather_checksums` on that many
gloo ranks (what a save does; a load's `verify` reads the same shares): the slowest
rank's wall time, median of `--repeat`. One rank is what rank 0 alone did before the
work was split. Files just written sit in the page cache, so on one machine this
measures CRC32 and memory bandwidth, not the filesystem. One JSON line per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _timed(ckpt: str, repeat: int) -> list[float]:
    import torch.distributed as dist

    from mimo.checkpoint.manifest import gather_checksums

    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        gather_checksums(ckpt)
        times.append(time.perf_counter() - t0)
    return times


def _write(ckpt: str, files: int, mib: int) -> None:
    os.makedirs(ckpt, exist_ok=True)
    per = mib * (1 << 20) // files
    for i in range(files):
        path = os.path.join(ckpt, f"__{i}_0.distcp")
        if not os.path.exists(path) or os.path.getsize(path) != per:
            with open(path, "wb") as f:
                for _ in range(per // (1 << 24)):
                    f.write(os.urandom(1 << 24))
                f.write(os.urandom(per % (1 << 24)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--dir", required=True)
    p.add_argument("--files", type=int, default=32)
    p.add_argument("--mib", type=int, default=4096)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    if args.files < 1 or args.mib < 1 or min(args.ranks) < 1 or args.repeat < 1:
        print("error: --files, --mib, --ranks and --repeat must be positive", file=sys.stderr)
        return 2
    from mimo.runtime import run_on_ranks

    _write(args.dir, args.files, args.mib)
    for ranks in args.ranks:
        per_rank = run_on_ranks(_timed, ranks, args.dir, args.repeat + 1, timeout_s=3600)
        slowest = [max(t[i] for t in per_rank) for i in range(1, args.repeat + 1)]  # first call: warm-up
        s = statistics.median(slowest)
        print(json.dumps({"ranks": ranks, "files": args.files, "mib": args.mib, "seconds": round(s, 3),
                          "gib_per_s": round(args.mib / 1024 / s, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
