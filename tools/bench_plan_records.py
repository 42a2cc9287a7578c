"""Host time one rank spends planning a step of JSONL `kind: llava` records from the record index,
and the records it reads from the file doing so.

    python tools/bench_plan_records.py [--global-batch 1024] [--steps 5] [--turns 2]
    python tools/bench_plan_records.py --energon [--global-batch 64] [--steps 5]

Every rank plans every step alike (which records, packed how, which are bad) and hashes the plan for
the ranks' agreement, so this part of a rank's work grows with the global batch, whatever the rank's
own share. Measured here: `ds.plan(step)` plus `ds.plan_digest(step)` per step, on one process with
the record index already made (as `build_index` leaves it), for a rank that trains none of the
step's sequences and decodes none of its items; and the records it read from the file per step.
Writes `--global-batch x --steps` LLaVA-like records (one image each, `--turns` question/answer
turns) as JSONL in a temporary directory, with the tiny tokenizer of tools/make_sample_data.py;
packing on, 256-token sequences. Prints one JSON line (best of the steps after the first). Runs
against whichever `mimo` is first on PYTHONPATH, so an older checkout can be timed the same way.

`--energon`: a `kind: energon` dataset instead (tools/make_sample_data.py's VQA one, 192 samples,
streamed over and over), planned by one process as a rank of a multi-rank run does: with the keyed
index that `build_index` gathers at start-up (here made by the one rank), and without it (each
record tokenised as the stream reaches it, as every rank did before); prints both, with the records
tokenised per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _energon_rank(raw, steps, indexed):
    """Per step plan + digest time and records tokenised of an energon dataset on this (only) rank."""
    from mimo.config import load_config
    from mimo.data import build_dataset
    from mimo.data.llava import ConversationEncoder
    from mimo.runtime.fan_in import FanIn

    ds = build_dataset(load_config(raw))
    if indexed:
        ds.build_index(FanIn(5))
    tokenised = []
    encode = ConversationEncoder.encode
    ConversationEncoder.encode = lambda self, *a, **k: tokenised.append(1) or encode(self, *a, **k)
    per_step, counts = [], []
    for step in range(steps):
        before, start = len(tokenised), time.perf_counter()
        ds.plan(step)
        ds.plan_digest(step)
        per_step.append(time.perf_counter() - start)
        counts.append(len(tokenised) - before)
    return {"keyed_index": indexed, "plan_and_digest_ms": round(1e3 * min(per_step[1:]), 2),
            "records_tokenised_per_step": counts[1:]}


def energon(args) -> int:
    import make_sample_data

    from mimo.runtime import run_on_ranks
    from test_llava_data import llava_raw

    with tempfile.TemporaryDirectory() as d:
        with open(os.devnull, "w") as quiet:
            out, sys.stdout = sys.stdout, quiet
            make_sample_data.main([d, "--records", "384", "--image-size", "16", "--energon"])
            sys.stdout = out
        raw = llava_raw(d, path=os.path.join(d, "energon_vqa"), kind="energon", seq_length=256)
        raw["model"]["language"]["max_sequence_length"] = 256
        raw["training"].update(global_batch_size=args.global_batch, micro_batch_size=1)
        for indexed in (False, True):
            (got,) = run_on_ranks(_energon_rank, 1, raw, args.steps, indexed, timeout_s=1800, daemon=False)
            print(json.dumps({"global_batch": args.global_batch, **got}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--energon", action="store_true")
    args = p.parse_args(argv)
    if args.energon:
        return energon(args)
    import make_sample_data
    from tiny import TINY

    from mimo.config import load_config
    from mimo.data import build_dataset
    from mimo.data.record_file import JsonLines
    from mimo.data.record_index import RecordIndex

    with tempfile.TemporaryDirectory() as d:
        with open(os.devnull, "w") as quiet:
            out, sys.stdout = sys.stdout, quiet
            make_sample_data.main([d, "--records", "8", "--image-size", "16"])
            sys.stdout = out
        turns = [{"from": "human", "value": "<image>\nwhat is it ?"}, {"from": "gpt", "value": "a red square ."}]
        turns += [{"from": "human", "value": "and then ?"}, {"from": "gpt", "value": "a blue circle ."}] * (args.turns - 1)
        path = os.path.join(d, "train.jsonl")
        with open(path, "w") as f:
            for i in range(args.global_batch * args.steps):
                f.write(json.dumps({"id": f"r{i}", "image": f"images/img{i % 8:04d}.png", "conversations": turns}) + "\n")
        raw = copy.deepcopy(TINY)
        del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
        raw["model"]["language"].update(attention="bitfield", max_sequence_length=256)
        raw["data"] = {"kind": "llava", "path": path, "tokenizer": os.path.join(d, "tokenizer"), "seq_length": 256,
                       "packing": True}
        raw["training"].update(global_batch_size=args.global_batch, micro_batch_size=8, train_iters=args.steps)
        ds = build_dataset(load_config(raw))
        ds.index = RecordIndex.of(len(ds.records), ds.native, ((i, ds._learn(i)) for i in range(len(ds.records))))
        reads = []
        read = JsonLines.__getitem__
        JsonLines.__getitem__ = lambda self, i: reads.append(i) or read(self, i)
        per_step, read_per_step = [], []
        for step in range(args.steps):
            before, start = len(reads), time.perf_counter()
            ds.plan(step)
            ds.plan_digest(step)
            per_step.append(time.perf_counter() - start)
            read_per_step.append(len(reads) - before)
        records = sum(len(s) for s in ds.plan(args.steps - 1).record_ids)
    print(json.dumps({"global_batch": args.global_batch, "turns": args.turns, "records_last_step": records,
                      "plan_and_digest_ms": round(1e3 * min(per_step[1:]), 2),
                      "records_read_per_step": read_per_step[1:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
