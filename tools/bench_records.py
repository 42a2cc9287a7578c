"""Memory and time of holding a JSONL records file on one rank: parsed whole (a list of dicts, as
`data.path` was read before) vs read on demand (`mimo.data.record_file.JsonLines`).

    python tools/bench_records.py [--records 200000]

Writes LLaVA-like records (an id, an image path, two to six turns of text, about 0.6 KB a line) to a
temporary JSONL file, then in a fresh process each: opens it the one way or the other and reports
the wall time to open, the growth of the process's peak RSS (ru_maxrss), and the mean time to read
one record at random afterwards. One JSON line per way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _measure(path: str, way: str) -> dict:
    from mimo.data.record_file import JsonLines

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if way == "parsed whole":
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        records = JsonLines(path)
    open_s = time.perf_counter() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    picks = random.Random(0).choices(range(len(records)), k=2000)
    start = time.perf_counter()
    for i in picks:
        records[i]
    read_us = 1e6 * (time.perf_counter() - start) / len(picks)
    return {"way": way, "records": len(records), "file_mb": os.path.getsize(path) / 2 ** 20, "open_s": open_s,
            "peak_rss_growth_mb": grown_mb, "read_one_us": read_us}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return 0
    rng = random.Random(0)
    words = "the a cat dog sits on red blue square image what is shown in this picture describe briefly".split()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train.jsonl")
        with open(path, "w") as f:
            for i in range(args.records):
                turns = []
                for k in range(2 * rng.randint(1, 3)):
                    text = " ".join(rng.choices(words, k=rng.randint(8, 30)))
                    turns.append({"from": "gpt" if k % 2 else "human", "value": ("<image>\n" if k == 0 else "") + text})
                f.write(json.dumps({"id": f"{i:09d}", "image": f"coco/train2017/{i:012d}.jpg",
                                    "conversations": turns}) + "\n")
        for way in ("parsed whole", "read on demand"):
            out = subprocess.run([sys.executable, __file__, "--child", path, way], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": ROOT}, check=True)
            print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
