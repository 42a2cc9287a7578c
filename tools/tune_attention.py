#!/usr/bin/env python
"""Tune bitfield attention's launch settings (tile sizes, warps, pipeline stages) on one GPU.

    python tools/tune_attention.py                                # CUDA: 16k and 64k tokens, head_dim 128
    python tools/tune_attention.py --seqlens 8192 --head-dim 64
    python tools/tune_attention.py --device cpu --tiny            # smoke run (Triton interpreter)

The forward and the two backward kernels are tuned apart (they take separate `KernelConfig` fields:
forward, `bwd_*` for dK/dV, `dq_*` for dQ): each candidate forward is timed alone, each candidate
dK/dV kernel alone (repeated `autograd.grad` over one retained forward whose queries need no
gradient) and each dQ kernel alone (keys and values need none). Then forward + backward with the
fastest settings of the three, in each launch form: the backward as two launches or as one
(`fused_backward`; only where the dK/dV and dQ settings' warps and stages agree, as one launch
needs), each kernel's programs per head in turn or with the heads fastest (`heads_fastest`). Every
candidate's output and gradients are compared with the first candidate's, so a setting that computes
something else is reported, never picked. The mask is
`bench_attention.py`'s multimodal sequence (text, images, audio, two packed documents). Prints one
markdown table per phase and the `KernelConfig` of the fastest candidates summed over the lengths;
before them, a `measured ...` line per candidate as soon as it is timed, so a run stopped at a time
limit (a GPU lent for minutes) still leaves what it measured. `--json-out FILE` also writes the
fastest settings as JSON (`{"kernel_config": {...}, "ms": {...}}`), which `tools/gpu_bench.py
--kernel-config FILE` benchmarks against flex_attention in the same session; the printed
`attention_kernel: {...}` line sets them for training in a model's YAML. Exits with status 2 and a message when
CUDA is asked for but unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import _short, _time, add_shape_args, device_refused, mixed_layout  # noqa: E402

# (block_m, block_n, num_warps, num_stages). The first of each list is KernelConfig's default for
# head_dim 65-128 and the reference every other row is checked against (the forward's second, 8 warps,
# was the default before the H200 tuning of 2026-11-29). The lists hold the settings that came close
# on an H200 (docs/benchmarks.md) and those torch's flex_attention uses on sm_90
# (forward 128x64 with 8 warps and 3 stages; dK/dV 64 queries x 128 keys and dQ 128 queries x 64 keys,
# 8 warps, 3 stages); BACKWARD serves both backward kernels (block_m: queries, block_n: keys). Its
# 64x64 8-warp rows were last timed on the first H200 (2026-11-26) with both backward kernels in one
# timing and the dK/dV kernel before its transposed orientation (4 warps 1.67x faster then); the
# current dK/dV kernel spills far less at 8 warps (docs/benchmarks.md).
FORWARD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 64, 8, 4),
           (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]
BACKWARD = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3), (128, 64, 8, 3), (64, 128, 8, 2),
            (128, 64, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3),
            (64, 64, 8, 2), (64, 64, 8, 3)]
TINY_FORWARD = [(16, 16, 4, 2), (32, 16, 4, 2)]
TINY_BACKWARD = [(16, 16, 4, 2), (16, 32, 4, 2)]
TOLERANCE = 2e-2  # bf16 outputs and gradients; fp32 (--tiny) agree far closer


# KernelConfig's fields a candidate (block_m, block_n, num_warps, num_stages) sets, per kernel; a
# launch form's, two.
FIELDS = {"forward": ("block_m", "block_n", "num_warps", "num_stages"),
          "dkdv": ("bwd_block_m", "bwd_block_n", "bwd_num_warps", "bwd_num_stages"),
          "dq": ("dq_block_m", "dq_block_n", "dq_num_warps", "dq_num_stages"),
          "launch": ("fused_backward", "heads_fastest")}


def config(phase: str, c) -> "KernelConfig":
    """The KernelConfig of candidate `c` for `phase`'s kernel (the other kernels keep their defaults)."""
    from mimo.attention import KernelConfig

    return KernelConfig(**dict(zip(FIELDS[phase], c)))


# backward phase -> which of q, k, v need gradients
BACKWARD_PHASES = {"dkdv": (False, True, True), "dq": (True, False, False)}
# Forward + backward with the fastest settings of the three kernels, in each launch form
# (fused_backward, heads_fastest); the first, the default, is the reference.
LAUNCHES = [(False, False), (True, False), (False, True), (True, True)]
NOT_APPLICABLE = "n/a: one launch needs the dK/dV and dQ settings' warps and stages to agree"


def _max_err(got, want) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))


def _failed(err: str) -> str:
    return err if err == NOT_APPLICABLE else f"fails ({err})"


def _progress(s: int, phase: str, c, result) -> None:
    t, err = result
    what = _failed(err) if t is None else f"{t * 1e3:.3f} ms (diff {err:.1e})"
    print(f"measured {s} tokens {phase} {c}: {what}", flush=True)


def _inputs(s: int, args, dtype, device):
    torch.manual_seed(s)
    q, k, v = (torch.randn(1, s, h, args.head_dim, device=device, dtype=dtype, requires_grad=True)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    mask, docs = mixed_layout(1, s, device)
    return q, k, v, mask, docs, torch.randn_like(q)


def _time_backward(phase, candidates, inputs, mask, docs, go, s, time_fn, device) -> dict:
    """{candidate: (seconds, max difference from the first candidate's gradients / their scale)} of
    `phase`'s kernel: repeated `autograd.grad` over one retained forward per candidate; (None, why) for
    one that fails."""
    from mimo.attention import bitfield_attention

    wrt = [t for t in inputs if t.requires_grad]
    out, want_grads = {}, None
    for c in candidates:
        try:
            o = bitfield_attention(*inputs, mask, docs, kernel_config=config(phase, c))
            got = torch.autograd.grad(o, wrt, go, retain_graph=True)
            want_grads = got if want_grads is None else want_grads
            err = _max_err(got, want_grads)
            scale = max(1.0, max(float(g.float().abs().max()) for g in want_grads))

            def bwd(o=o):
                torch.autograd.grad(o, wrt, go, retain_graph=True)

            out[c] = (time_fn(bwd), err / scale)
            del o
        except Exception as exc:  # a setting the GPU cannot launch (shared memory) is reported, not fatal
            out[c] = (None, _short(exc))
        _progress(s, phase, c, out[c])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def tune_length(s: int, args, dtype, device, forward, backward, time_fn) -> dict:
    from mimo.attention import bitfield_attention

    q, k, v, mask, docs, go = _inputs(s, args, dtype, device)
    out = {"forward": {}}
    want_out = None
    for c in forward:
        try:
            with torch.no_grad():
                got = bitfield_attention(q, k, v, mask, docs, kernel_config=config("forward", c))
                want_out = got if want_out is None else want_out
                err = _max_err([got], [want_out])

                def fwd(cfg=config("forward", c)):
                    bitfield_attention(q, k, v, mask, docs, kernel_config=cfg)

                out["forward"][c] = (time_fn(fwd), err)
        except Exception as exc:  # a setting the GPU cannot launch (shared memory) is reported, not fatal
            out["forward"][c] = (None, _short(exc))
        _progress(s, "forward", c, out["forward"][c])
    for phase, needs in BACKWARD_PHASES.items():
        # Only the inputs this kernel differentiates need gradients: the other kernel never runs.
        inputs = [t if need else t.detach() for t, need in zip((q, k, v), needs)]
        out[phase] = _time_backward(phase, backward, inputs, mask, docs, go, s, time_fn, device)
    return out


def tune_launch(s: int, args, dtype, device, fields: dict, time_fn) -> dict:
    """Forward + backward (dQ, dK, dV) with the tuned kernel `fields`, for each launch form of LAUNCHES;
    a one-launch form whose dK/dV and dQ warps or stages differ is reported as not applicable."""
    from mimo.attention import KernelConfig, bitfield_attention

    q, k, v, mask, docs, go = _inputs(s, args, dtype, device)
    same = (fields["bwd_num_warps"], fields["bwd_num_stages"]) == (fields["dq_num_warps"], fields["dq_num_stages"])
    out, want = {}, None
    for c in LAUNCHES:
        if c[0] and not same:
            out[c] = (None, NOT_APPLICABLE)
            _progress(s, "launch", c, out[c])
            continue
        cfg = KernelConfig(**dict(fields, **dict(zip(FIELDS["launch"], c))))

        def step(cfg=cfg):
            o = bitfield_attention(q, k, v, mask, docs, kernel_config=cfg)
            return (o.detach(),) + torch.autograd.grad(o, (q, k, v), go)

        try:
            got = step()
            want = got if want is None else want
            scale = max(1.0, max(float(g.float().abs().max()) for g in want))
            out[c] = (time_fn(step), _max_err(got, want) / scale)
        except Exception as exc:  # a setting the GPU cannot launch is reported, not fatal
            out[c] = (None, _short(exc))
        _progress(s, "launch", c, out[c])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, "16384,65536")
    p.add_argument("--json-out", default=None,
                   help="also write the fastest settings here as JSON (for gpu_bench.py --kernel-config)")
    args = p.parse_args(argv)
    if args.json_out:
        from mimo.config.outputs import output_problem

        problem = output_problem(args.json_out, "file")
        if problem:  # found now, not after minutes of tuning
            print(f"error: --json-out: {problem}", file=sys.stderr)
            return 2
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    if device_refused("tune_attention", args):
        return 2

    device = torch.device(args.device)
    if args.tiny:
        seqlens, dtype, forward, backward = [48], torch.float32, TINY_FORWARD, TINY_BACKWARD
        args.heads, args.kv_heads, args.head_dim, args.iters = 2, 1, 16, 1
    else:
        seqlens, dtype, forward, backward = [int(x) for x in args.seqlens.split(",")], torch.bfloat16, FORWARD, BACKWARD
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}; dtype {str(dtype).replace('torch.', '')}; heads {args.heads}/{args.kv_heads}; "
          f"head_dim {args.head_dim}; iters {args.iters}", flush=True)
    time_fn = lambda fn: _time(fn, args.iters, device)  # noqa: E731
    results = {s: tune_length(s, args, dtype, device, forward, backward, time_fn) for s in seqlens}
    best = {}
    for phase, cands in (("forward", forward), ("dkdv", backward), ("dq", backward)):
        _table(phase, cands, seqlens, results, best)
    if len(best) == 3:
        for s in seqlens:
            results[s]["launch"] = tune_launch(s, args, dtype, device, best_fields(best), time_fn)
        _table("launch", LAUNCHES, seqlens, results, best)
    if len(best) == 4:
        fields = best_fields(best)
        print("\nKernelConfig(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")")
        print("# in a model's YAML (model.language, or an encoder with attention: bitfield):\n"
              "attention_kernel: {" + ", ".join(f"{k}: {_yaml(v)}" for k, v in fields.items()) + "}")
        if args.json_out:
            ms = {phase: {str(s): round(results[s][phase][c][0] * 1e3, 4) for s in seqlens}
                  for phase, c in best.items()}
            with open(args.json_out, "w") as f:
                json.dump({"device": name, "dtype": str(dtype).replace("torch.", ""), "heads": args.heads,
                           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "kernel_config": fields,
                           "ms": ms}, f, indent=1)
    elif args.json_out:
        # The launch forms are timed only once the three kernels have a setting each.
        missing = ", ".join(p for p in FIELDS if p not in best and (p != "launch" or len(best) == 3))
        print(f"tune_attention: no candidate of {missing} was within the tolerance; {args.json_out} not written",
              file=sys.stderr)
    return 0


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _table(phase: str, cands, seqlens, results, best: dict) -> None:
    """Print `phase`'s markdown table (ms per length, and each candidate's difference from the first)
    and put its fastest candidate within the tolerance, summed over the lengths, in `best`."""
    fields = ", ".join(FIELDS[phase])
    print(f"\n{phase} ({fields}); ms, and max difference from the first row (the reference)")
    print("| config | " + " | ".join(f"{s} tokens" for s in seqlens) + " | total ms |")
    print("|---|" + "---|" * (len(seqlens) + 1))
    totals = {}
    for c in cands:
        cells, total = [], 0.0
        for s in seqlens:
            t, err = results[s][phase][c]
            if t is None:
                cells.append(_failed(err))
                total = None
                continue
            ok = err <= TOLERANCE
            cells.append(f"{t * 1e3:.2f} (diff {err:.1e}{'' if ok else ', WRONG'})")
            if total is not None:
                total = total + t if ok else None
        if total is not None:
            totals[c] = total
        print(f"| {c} | " + " | ".join(cells) + f" | {'-' if total is None else f'{total * 1e3:.2f}'} |")
    if totals:
        best[phase] = min(totals, key=totals.get)
        gain = totals[cands[0]] / totals[best[phase]] if cands[0] in totals else float("nan")
        print(f"fastest {phase}: {best[phase]} ({gain:.2f}x the first row)")


def best_fields(best: dict) -> dict:
    """KernelConfig's fields of the fastest forward, dK/dV and dQ settings (and of the launch form,
    once tuned)."""
    return {k: v for phase, keys in FIELDS.items() if phase in best for k, v in zip(keys, best[phase])}


if __name__ == "__main__":
    sys.exit(main())
