#!/usr/bin/env python
"""Time and peak host memory of building and initialising one rank's part of a 7B-shaped LLM.

    python tools/bench_init.py --init sharded --tp 4 [--tp-rank 0] [--layers 32] [--precision bf16]

One process builds the LLM part of TP rank `--tp-rank` of `--tp` (Llama-2-7B shape: hidden 4096,
FFN 11008, 32 heads, vocab 32000, SwiGLU, RMSNorm, no biases) and initialises it the way
`training.init` does on a rank (mimo.training.parts `build_parts`):

* sharded:   build without megatron's draws, then draw each full parameter and keep the slice;
* reference: build the part (megatron init), build the whole module, copy the part's slice;
* local:     megatron initialises the part in place.

The process is a one-rank gloo world; megatron's constructors only ask the TP group for its
size and rank, so a stand-in group gives rank `--tp-rank`'s shapes without other processes.
Prints one JSON line: seconds to build, to initialise, in total, parameters on the rank and
peak resident memory (ru_maxrss). Run one mode per process (the peak is per process).
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LLAMA2_7B = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32000,
                 max_sequence_length=4096, activation="swiglu", normalization="RMSNorm", add_bias_linear=False)


class _TPGroup:
    """A TP group of `size` ranks as megatron's constructors see it (they only ask size and rank)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _groups(tp: int, tp_rank: int):
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    for key in ("cp", "pp", "dp", "ep", "dp_cp", "tp_dp_cp", "embd", "pos_embd", "expt_dp"):
        setattr(pgs, key, dist.group.WORLD)
    for key in ("tp", "tp_cp", "mp", "expt_tp", "tp_ep"):
        setattr(pgs, key, _TPGroup(tp, tp_rank))
    return pgs


def run(init: str, tp: int, tp_rank: int, layers: int, precision: str) -> dict:
    import torch
    import torch.distributed as dist

    from mimo.config import LANGUAGE, load_config
    from mimo.model import build_llm
    from mimo.model.reference_init import load_shard
    from mimo.model.sharded_init import init_sharded
    from mimo.runtime.launch import free_port
    from mimo.topology import Layout

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    raw = {"model": {"language": dict(LLAMA2_7B, num_layers=layers), "encoders": {}},
           "parallelism": {"language": {"tp": tp}}, "data": {"seq_length": 128},
           "training": {"global_batch_size": 1, "precision": precision, "init": init}}
    cfg = load_config(raw)
    torch.manual_seed(cfg.training.seed)
    start = time.perf_counter()
    part = build_llm(cfg, Layout(tp=tp), _groups(tp, tp_rank))
    built = time.perf_counter()
    if init == "sharded":
        init_sharded(part, cfg, LANGUAGE, 0, tp_rank, tp)
    elif init == "reference":
        full = build_llm(cfg, Layout(), _groups(1, 0))
        load_shard(part, full.state_dict(keep_vars=False), 0, tp_rank, tp)
        del full
    done = time.perf_counter()
    dist.destroy_process_group()
    return {"init": init, "tp": tp, "tp_rank": tp_rank, "layers": layers, "precision": precision,
            "build_s": round(built - start, 1), "init_s": round(done - built, 1), "total_s": round(done - start, 1),
            "params_on_rank": sum(p.numel() for p in part.parameters()),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", choices=("sharded", "reference", "local"), default="sharded")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=LLAMA2_7B["num_layers"])
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    if not 0 <= args.tp_rank < args.tp:
        p.error(f"--tp-rank must be in [0, {args.tp}), got {args.tp_rank}")
    print(json.dumps(run(args.init, args.tp, args.tp_rank, args.layers, args.precision)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
