#!/usr/bin/env python
"""Load time and peak host memory of importing a Llama-shaped HF checkpoint (random weights).

    python tools/bench_hf_load.py --dir /tmp/llama_bench [--shape 1b|7b] [--tp 1] [--keep]

Writes a random bf16 Llama checkpoint of the given shape (sharded safetensors, config.json)
unless DIR already holds one, then builds the LLM on `--tp` CPU ranks (bf16) with its weights
from DIR and prints, per rank: time to build the model, time reading its HF slices, and the
rank's peak resident memory (ru_maxrss). Needs the disk for the checkpoint (7b: 13.5 GB) and,
per rank, host memory for its shard plus megatron's construction.
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    # Llama-2-7B
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    # TinyLlama-1.1B (GQA)
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
}


def write_checkpoint(directory: str, shape: dict) -> float:
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    cfg = dict(model_type="llama", hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16", **shape)
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    start = time.perf_counter()
    weight_map = {}

    def save(tensors, name):
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    r = lambda *s: (torch.randn(*s) * 0.02).to(torch.bfloat16)  # noqa: E731
    save({"model.embed_tokens.weight": r(v, h), "lm_head.weight": r(v, h), "model.norm.weight": r(h)},
         "model-embed.safetensors")
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        save({p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(kv, h),
              p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, h),
              p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
              p + "mlp.down_proj.weight": r(h, f), p + "input_layernorm.weight": r(h),
              p + "post_attention_layernorm.weight": r(h)}, f"model-{i:05d}.safetensors")
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return time.perf_counter() - start


def _rank(raw):
    import mimo.training.trainer as trainer_mod
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    read = [0.0]
    orig = trainer_mod.load_hf_part

    def timed(*a, **k):
        t = time.perf_counter()
        orig(*a, **k)
        read[0] += time.perf_counter() - t

    trainer_mod.load_hf_part = timed
    start = time.perf_counter()
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    total = time.perf_counter() - start
    params = sum(p.numel() for p in trainer.parts["language"].parameters())
    return {"build_and_load_s": round(total, 1), "hf_read_s": round(read[0], 1), "params_on_rank": params,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        print(f"writing a random {args.shape} checkpoint to {args.dir}: "
              f"{write_checkpoint(args.dir, SHAPES[args.shape]):.1f} s", flush=True)
    from mimo.runtime import run_on_ranks

    raw = {"model": {"language": {"hf": args.dir}}, "parallelism": {"language": {"tp": args.tp}},
           "data": {"seq_length": 128}, "training": {"global_batch_size": 1, "precision": "bf16"}}
    for rank, res in enumerate(run_on_ranks(_rank, args.tp, raw, timeout_s=3600)):
        print(json.dumps({"shape": args.shape, "tp": args.tp, "rank": rank, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
