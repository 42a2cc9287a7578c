"""Host time a rank spends loading one step's data, per rank role (CPU ranks, gloo).

    python tools/bench_step_data.py [--global-batch 256] [--steps 3] [--image-size 64] [--turns 1]
                                    [--records N] [--index]

Three ranks: the LLM alone on rank 0, a vision encoder with DP 2 on ranks 1-2 (non-colocated),
`kind: llava` records with one image each, no packing. Each rank trains `--steps` steps as
`examples/pretrain_mimo.py` does (trainer + `StepReporter`) and measures its host work per step:
`data_ms`, the time in `Trainer.step_data` (plan the step from the records, decode, collate, move to
the device; wherever it runs: the trainer may load the next step on a background thread), and
`data_cpu_ms`, the CPU time of the thread that ran it (where the load overlaps the step, its wall
time also counts waiting for the cores the step uses), `metrics_ms`, the time in `StepReporter.after_step` (the step record: FLOPs, MFU, sinks), and counts
Pillow's pixel decodes and the records tokenised per step; `start_s` is the trainer's start-up (the
record index is built there, each rank tokenising 1/3 of the records). `--turns N`: records of N
question/answer turns (more text to tokenise per record); `--records N`: the file's record count
(default: global batch x steps); `--index`: keep the index in a file (`data.index`) and run twice,
the first start building it, the second loading it. Prints one JSON line per rank (means over
the steps after the first). Runs
against whichever `mimo` is first on PYTHONPATH, so an older checkout can be timed the same way.
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


def _rank(raw, steps):
    from PIL import Image

    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.metrics import StepReporter

    from mimo.data.llava import ConversationEncoder

    calls, tokenised = [], []
    getdecoder = Image._getdecoder
    Image._getdecoder = lambda *a, **k: calls.append(1) or getdecoder(*a, **k)
    encode = ConversationEncoder.encode
    ConversationEncoder.encode = lambda self, *a, **k: tokenised.append(1) or encode(self, *a, **k)
    cfg = load_config(raw)
    start = time.perf_counter()
    trainer = Trainer(cfg, select_runtime("cpu"))
    start_s = time.perf_counter() - start
    tokenised.clear()  # counted from the first step on
    data_s = {}
    load = trainer.step_data

    def timed(step):
        start, cpu = time.perf_counter(), time.thread_time()
        out = load(step)
        data_s[step] = (time.perf_counter() - start, time.thread_time() - cpu)
        return out

    trainer.step_data = timed
    if hasattr(trainer, "next_step"):  # the loader of the next step (background thread) calls it too
        trainer.next_step.load = timed
    with open(os.devnull, "w") as quiet:
        reporter = StepReporter(cfg, trainer, select_runtime("cpu"), stream=quiet)
        metrics_s = {}
        for step in range(steps):
            res = trainer.train_step(step)
            start = time.perf_counter()
            reporter.after_step(step, res)
            metrics_s[step] = time.perf_counter() - start
    warm = range(1, steps)  # step 0 also warms the tokenizer's caches
    return {"data_ms": 1e3 * sum(data_s[s][0] for s in warm) / len(warm),
            "data_cpu_ms": 1e3 * sum(data_s[s][1] for s in warm) / len(warm),
            "metrics_ms": 1e3 * sum(metrics_s[s] for s in warm) / len(warm),
            "decodes_per_step": len(calls) / steps, "tokenised_per_step": len(tokenised) / steps,
            "start_s": start_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--records", type=int, default=0)
    p.add_argument("--index", action="store_true")
    args = p.parse_args(argv)
    import make_sample_data

    from mimo.runtime import run_on_ranks

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny import TINY

    records = max(args.records, args.global_batch * args.steps)
    with tempfile.TemporaryDirectory() as d:
        with open(os.devnull, "w") as quiet:
            out, sys.stdout = sys.stdout, quiet
            make_sample_data.main([d, "--records", "8", "--image-size", str(args.image_size)])
            sys.stdout = out
        turns = [{"from": "human", "value": "<image>\nwhat is it ?"}, {"from": "gpt", "value": "a red square ."}]
        turns += [{"from": "human", "value": "and then ?"}, {"from": "gpt", "value": "a blue circle ."}] * (args.turns - 1)
        data = [{"id": f"r{i}", "image": f"images/img{i % 8:04d}.png", "conversations": turns}
                for i in range(records)]
        with open(os.path.join(d, "train.json"), "w") as f:
            json.dump(data, f)
        raw = copy.deepcopy(TINY)
        del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
        raw["model"]["encoders"]["images"].update(image_size=args.image_size, patch_size=args.image_size // 2)
        raw["data"] = {"kind": "llava", "path": os.path.join(d, "train.json"),
                       "tokenizer": os.path.join(d, "tokenizer"), "seq_length": 48 if args.turns == 1 else 16 * args.turns + 32,
                       "packing": False}
        raw["model"]["language"]["max_sequence_length"] = raw["data"]["seq_length"]
        raw["training"].update(global_batch_size=args.global_batch, micro_batch_size=8, train_iters=args.steps,
                               log_interval=10 ** 6)
        raw["parallelism"] = {"language": {}, "images": {"dp": 2, "rank_offset": 1}}
        runs = ["no index file"]
        if args.index:
            raw["data"]["index"] = os.path.join(d, "train.index")
            runs = ["index file built", "index file loaded"]
        for run in runs:
            results = run_on_ranks(_rank, 3, raw, args.steps, timeout_s=1800, daemon=False)
            for rank, (role, r) in enumerate(zip(["llm", "encoder", "encoder"], results)):
                print(json.dumps({"rank": rank, "role": role, "global_batch": args.global_batch, "records": records,
                                  "run": run, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
