"""Time the global gradient norm: mimo's old per-parameter fp64 loop vs the fused fp32 norm over
grad-buffer views (`mimo.training.optimizer.sq_norm_fp32` over `norm_ranges`).

The gradients are those of a GPT-shaped model (default: 24 layers, hidden 2048, FFN 8192, vocab
32000, untied embeddings; about 1.34 B parameters) laid out like one megatron-core DDP grad buffer:
one flat tensor, each parameter's gradient a view of it, in megatron's order (reversed). Only the
norm is timed, so the values are random. Three ways are timed:

* `old`: what `ModelOptimizer._local_sq_norm` did before: for each parameter's gradient
  `g.double().pow(2).sum()`, then a stack and a sum (fp64, one pass and one fp64 copy per parameter);
* `new_tp0`: the fused fp32 norm on TP rank 0: the one view of the whole buffer a rank counts with
  DP = 1 (`norm_ranges`; with DP = n each rank's slice is 1/n of it);
* `new_tp1`: the same on a TP rank > 0, which skips the TP-replicated parameters (layer norms,
  row-parallel biases): the runs between them.

    python tools/bench_grad_norm.py                       # 1.34 B parameters, fp32 (about 5.4 GB)
    python tools/bench_grad_norm.py --layers 2 --hidden 64 --ffn 256 --vocab 128 --repeats 2   # smoke

Prints one line per variant and, with --json PATH, writes the figures there. The relative error of
each fp32 result against the fp64 one is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.training.optimizer import norm_ranges, sq_norm_fp32  # noqa: E402


class _Param:
    """What `counted` reads of a parameter."""

    def __init__(self, name: str, shape: Tuple[int, ...], tensor_model_parallel: bool):
        self.name, self.shape, self.tensor_model_parallel = name, shape, tensor_model_parallel

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def gpt_params(layers: int, hidden: int, ffn: int, vocab: int) -> List[_Param]:
    """megatron-core GPT parameters (local spec, with biases, LayerNorm) in registration order."""
    h = hidden
    out = [_Param("embedding.word_embeddings.weight", (vocab, h), True)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [_Param(p + "input_layernorm.weight", (h,), False), _Param(p + "input_layernorm.bias", (h,), False),
                _Param(p + "self_attention.linear_qkv.weight", (3 * h, h), True),
                _Param(p + "self_attention.linear_qkv.bias", (3 * h,), True),
                _Param(p + "self_attention.linear_proj.weight", (h, h), True),
                _Param(p + "self_attention.linear_proj.bias", (h,), False),
                _Param(p + "pre_mlp_layernorm.weight", (h,), False), _Param(p + "pre_mlp_layernorm.bias", (h,), False),
                _Param(p + "mlp.linear_fc1.weight", (ffn, h), True), _Param(p + "mlp.linear_fc1.bias", (ffn,), True),
                _Param(p + "mlp.linear_fc2.weight", (h, ffn), True), _Param(p + "mlp.linear_fc2.bias", (h,), False)]
    out += [_Param("decoder.final_layernorm.weight", (h,), False), _Param("decoder.final_layernorm.bias", (h,), False),
            _Param("output_layer.weight", (vocab, h), True)]
    return out


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Bucket:
    def __init__(self, grad_data: torch.Tensor, offset: int):
        self.grad_data, self.offset = grad_data, offset


class GradBuffer:
    """The fields of megatron-core's `_ParamAndGradBuffer` that `norm_ranges` reads: one bucket (megatron's
    default without overlap_grad_reduce), parameters placed in reverse order like megatron's."""

    def __init__(self, params: List[_Param], dtype: torch.dtype, seed: int = 0, dp_size: int = 1, dp_rank: int = 0):
        total = sum(p.numel for p in params)
        self.grad_data = torch.empty(total, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        chunk = 1 << 24
        for a in range(0, total, chunk):  # filled in chunks: no second full-size temporary
            self.grad_data[a:a + chunk] = torch.randn(min(chunk, total - a), generator=g).to(dtype)
        self.param_index_map: Dict[_Param, Tuple[int, int, int]] = {}
        at = 0
        for p in reversed(params):
            self.param_index_map[p] = (at, at + p.numel, 0)
            at += p.numel
        self.buckets = [_Bucket(self.grad_data, 0)]
        self.data_parallel_group = _Group(dp_size, dp_rank)

    def grads(self) -> List[torch.Tensor]:
        """Each parameter's gradient as a view of the buffer (what `param.main_grad` is)."""
        return [self.grad_data[a:b].view(p.shape) for p, (a, b, _) in self.param_index_map.items()]


def old_sq_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """mimo's norm before this change (ModelOptimizer._local_sq_norm): per parameter, in fp64."""
    return torch.stack([gr.detach().double().pow(2).sum() for gr in grads]).sum()


def _time(fn, repeats: int) -> Tuple[List[float], torch.Tensor]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def run(layers: int, hidden: int, ffn: int, vocab: int, dtype: str, repeats: int, threads: int) -> dict:
    if threads:
        torch.set_num_threads(threads)
    params = gpt_params(layers, hidden, ffn, vocab)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    buf = GradBuffer(params, dt)
    fill_s = time.perf_counter() - t0
    grads = buf.grads()
    views = {rank: [buf.grad_data[a:b] for a, b in norm_ranges(buf, rank)] for rank in (0, 1)}
    dev = buf.grad_data.device
    variants = {"old": lambda: old_sq_norm(grads),
                "new_tp0": lambda: sq_norm_fp32(views[0], dev),
                "new_tp1": lambda: sq_norm_fp32(views[1], dev)}
    reference = {0: None, 1: None}
    out = {"params": sum(p.numel for p in params), "param_tensors": len(params), "dtype": dtype,
           "shape": dict(layers=layers, hidden=hidden, ffn=ffn, vocab=vocab), "repeats": repeats,
           "threads": torch.get_num_threads(), "cpu": cpu_model(), "torch": torch.__version__,
           "fill_s": fill_s, "views": {"new_tp0": len(views[0]), "new_tp1": len(views[1])}, "variants": {}}
    for name, fn in variants.items():
        times, value = _time(fn, repeats)
        out["variants"][name] = {"times_s": times, "min_s": min(times), "median_s": sorted(times)[len(times) // 2],
                                 "sq_norm": float(value)}
    # fp64 oracles: every parameter (TP rank 0), and only the TP-sharded ones (TP rank 1).
    reference[0] = out["variants"]["old"]["sq_norm"]
    reference[1] = float(old_sq_norm([g for g, p in zip(grads, buf.param_index_map) if p.tensor_model_parallel]))
    for name, rank in (("new_tp0", 0), ("new_tp1", 1)):
        v = out["variants"][name]
        v["rel_err_vs_fp64"] = abs(v["sq_norm"] - reference[rank]) / reference[rank]
    out["speedup_tp0"] = out["variants"]["old"]["median_s"] / out["variants"]["new_tp0"]["median_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="grad buffer dtype")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    res = run(a.layers, a.hidden, a.ffn, a.vocab, a.dtype, a.repeats, a.threads)
    print(f"{res['params'] / 1e9:.3f} B parameters in {res['param_tensors']} tensors, {res['dtype']} grad buffer, "
          f"{res['threads']} threads, {res['cpu']}, torch {res['torch']}")
    for name, v in res["variants"].items():
        err = f"  rel. err vs fp64 {v['rel_err_vs_fp64']:.1e}" if "rel_err_vs_fp64" in v else ""
        views = f" ({res['views'][name]} views)" if name in res["views"] else f" ({res['param_tensors']} tensors)"
        print(f"{name:8s} median {v['median_s'] * 1e3:9.1f} ms  min {v['min_s'] * 1e3:9.1f} ms{views}{err}")
    print(f"speedup (old / new_tp0, medians): {res['speedup_tp0']:.1f}x")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
