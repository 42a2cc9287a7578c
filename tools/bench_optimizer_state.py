"""What saving the distributed optimizer's state costs each rank: time in `param_state` and the bytes
each rank hands to the collectives that gather the state to its writers (gloo ranks).

    python tools/bench_optimizer_state.py [--ranks 4] [--hidden 512] [--layers 4] [--repeats 3]

With `training.use_distributed_optimizer` each DP rank owns a piece of every parameter's Adam state;
a checkpoint stores each parameter whole, gathered to one DP rank (its writer). Trains one Adam step
of a text-only model (mock data, the LLM alone, DP = `--ranks`, the tiny test config's other
settings, `--hidden`/`--layers` for its size), then times `ModelOptimizer.param_state("language")`
(the gather a save runs) `--repeats` times and counts, per rank, the bytes passed to `dist.reduce`
and to the sends of `dist.batch_isend_irecv` during it (what a rank hands to the collectives; the
bytes a reduction's algorithm moves on the wire depend on the backend). Prints one JSON line: the
median time of the slowest rank and each rank's bytes. Runs against whichever `mimo` is first on
PYTHONPATH, so an older checkout can be measured the same way.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _rank(raw, repeats):
    import torch.distributed as dist

    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    trainer.train_step(0)
    handed = [0]
    reduce, batch = dist.reduce, dist.batch_isend_irecv

    def counted_reduce(t, *a, **k):
        handed[0] += t.numel() * t.element_size()
        return reduce(t, *a, **k)

    def counted_batch(ops):
        handed[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    dist.reduce, dist.batch_isend_irecv = counted_reduce, counted_batch
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        trainer.optim.param_state("language")
        times.append(time.perf_counter() - start)
    dist.reduce, dist.batch_isend_irecv = reduce, batch
    params = sum(p.numel() for p in trainer.parts["language"].parameters())
    return {"times": times, "handed_mb": handed[0] / repeats / 2 ** 20, "params": params}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from tiny import TINY

    from mimo.runtime import run_on_ranks

    raw = copy.deepcopy(TINY)
    raw["model"]["encoders"] = {}
    raw["model"]["language"].update(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                    num_query_groups=8, vocab_size=1024)
    raw["parallelism"] = {"language": {"dp": args.ranks}}
    raw["training"].update(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                           global_batch_size=2 * args.ranks, micro_batch_size=2, train_iters=1)
    got = run_on_ranks(_rank, args.ranks, raw, args.repeats, timeout_s=1800, daemon=False)
    slowest = [max(g["times"][i] for g in got) for i in range(args.repeats)]
    print(json.dumps({"ranks": args.ranks, "params": got[0]["params"],
                      "state_mb": 2 * 4 * got[0]["params"] / 2 ** 20,  # Adam's two fp32 moments
                      "param_state_s": round(statistics.median(slowest), 3),
                      "handed_mb_per_rank": [round(g["handed_mb"], 1) for g in got]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
