#!/usr/bin/env python
"""Benchmark bitfield attention vs flex_attention (equivalent block mask) vs SDPA.

    python tools/bench_attention.py                      # CUDA: 8k..64k tokens, bf16, head_dim 128
    python tools/bench_attention.py --device cpu --tiny  # smoke test through Triton's interpreter

TFLOP/s count only the tiles bitfield attention computes (non-empty tiles at
its forward tile size): 4*d flops per (query, key) pair per head forward and
2.5x that for backward; every implementation is credited with the same work.
Prints a markdown table. Exits with status 2 and a message when CUDA is asked
for but unavailable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def mixed_layout(b: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A multimodal sequence: text, images (modality 1), audio (modality 2) in a
    repeating pattern; text sees images but not audio; two packed documents."""
    from mimo.attention import build_bitfield_mask

    unit = max(s // 8, 8)
    pattern = [(0, 1), (1, 2), (0, 1), (2, 1), (0, 1), (1, 1), (0, 1)]  # (token kind, units)
    ids = torch.zeros(s, dtype=torch.int64)
    pos = 0
    while pos < s:
        for kind, n in pattern:
            ids[pos:pos + n * unit] = kind
            pos += n * unit
    ids = ids.expand(b, s).to(device)
    mask = build_bitfield_mask(ids, {1: 1, 2: 2}, text_sees={1})
    docs = (torch.arange(s, device=device) >= (s * 5) // 8).to(torch.int64).expand(b, s)
    return mask, docs


def _time(fn, iters: int, device) -> float:
    fn()  # warm-up / compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def compiled_flex():
    """`torch.compile(flex_attention)`, from an empty dynamo cache: dynamo keys its cache on the mask
    function's code, grad mode and shapes, and once `recompile_limit` (8) entries exist it runs
    flex_attention uncompiled (the whole score matrix), which would make a later row slow without
    saying so."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention)


def _implementations(q, k, v, mask, docs, cfg):
    from mimo.attention import bitfield_attention
    from mimo.attention.inputs import allowed_matrix, check_inputs

    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    impls = {"bitfield": lambda: (lambda: bitfield_attention(q, k, v, mask, docs, kernel_config=cfg))}

    def flex():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        low = (1 << 62) - 1

        def mask_mod(bi, h, qi, ki):
            qm, km = mask[bi, qi], mask[bi, ki]
            causal_ok = (ki <= qi) & ((qm & km & low) != 0)
            bidir_ok = ((qm & low) == (km & low)) & ((qm & low) != 0)
            return torch.where((qm >> 62) != 0, causal_ok, bidir_ok) & (docs[bi, qi] == docs[bi, ki])

        # Built eagerly, the mask function's int64 intermediates cover every (query, key) pair (about
        # 17 bytes a pair: 73 GB at 64k); compiled, the mask is built block by block.
        block = create_block_mask(mask_mod, b, None, s, s, device=q.device, _compile=q.is_cuda and s * s > 2**31)
        fn = compiled_flex() if q.is_cuda else flex_attention
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return lambda: fn(qt, kt, vt, block_mask=block, enable_gqa=group > 1).transpose(1, 2)

    def sdpa():
        ok = allowed_matrix(check_inputs(q, k, v, mask, mask, q_document_ids=docs, k_document_ids=docs))
        # K/V expanded: with a mask, `enable_gqa` would run SDPA's math kernel on CUDA (only flash,
        # which takes no mask, reads grouped K/V), not the memory-efficient one this row measures.
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, dim=2),
                                                  v.repeat_interleave(group, dim=2)))
        attn_mask = ok[:, None]
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=attn_mask).transpose(1, 2)

    impls["flex_attention"] = flex
    impls["sdpa (dense bool mask)"] = sdpa
    return impls


def _short(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:100].replace("|", "/")


def add_shape_args(p: argparse.ArgumentParser, seqlens: str) -> None:
    """The device and attention-shape flags this tool and tune_attention.py share."""
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run (Triton interpreter)")
    p.add_argument("--seqlens", default=seqlens)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)


def shape_problems(seqlens: str, heads: int, kv_heads: int, head_dim: int, iters: int,
                   iters_flag: str = "--iters") -> list:
    """One line per attention-shape flag a run could not use ("--flag: why"); the bench tools share it."""
    out = []
    try:
        if any(int(x) < 1 for x in seqlens.split(",")):
            out.append(f"--seqlens {seqlens!r}: each length must be >= 1")
    except ValueError:
        out.append(f"--seqlens {seqlens!r}: expected comma-separated integers")
    for flag, value in (("--heads", heads), ("--kv-heads", kv_heads), (iters_flag, iters)):
        if value < 1:
            out.append(f"{flag}: must be >= 1, got {value}")
    if heads >= 1 and kv_heads >= 1 and heads % kv_heads:
        out.append(f"--kv-heads: must divide --heads ({heads}), got {kv_heads}")
    if not 1 <= head_dim <= 256:
        out.append(f"--head-dim: must be 1..256 (what the kernels take), got {head_dim}")
    return out


def device_refused(tool: str, args) -> bool:
    """Say why and return True when a shape flag is unusable or `args.device` cannot run; a CPU smoke
    run turns on the Triton interpreter (before mimo.attention is imported)."""
    problems = shape_problems(args.seqlens, args.heads, args.kv_heads, args.head_dim, args.iters)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return True
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA GPU available; nothing measured. Use --device cpu --tiny for a smoke run.",
              file=sys.stderr)
        return True
    if args.device == "cpu":
        if not args.tiny:
            print(f"{tool}: --device cpu is only a smoke test; add --tiny", file=sys.stderr)
            return True
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, "8192,16384,32768,65536")
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    if device_refused("bench_attention", args):
        return 2

    from mimo.attention import KernelConfig
    from mimo.attention.block_plan import get_plan
    from mimo.attention.inputs import check_inputs
    from mimo.attention.kernel_loader import backend_for, kernels

    device = torch.device(args.device)
    if args.tiny:
        seqlens, dtype, hq, hkv, d, iters = [48], torch.float32, 2, 1, 16, 1
        cfg = KernelConfig(16, 16, 16, 16, split_tiles=2)
    else:
        seqlens = [int(x) for x in args.seqlens.split(",")]
        dtype, hq, hkv, d, iters = torch.bfloat16, args.heads, args.kv_heads, args.head_dim, args.iters
        cfg = KernelConfig()
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (Triton interpreter)'}; "
          f"dtype {str(dtype).replace('torch.', '')}; heads {hq}/{hkv}; head_dim {d}; batch {args.batch}")
    print("| tokens | implementation | pass | ms | TFLOP/s (allowed tiles) |")
    print("|---|---|---|---|---|")
    for s in seqlens:
        torch.manual_seed(0)
        q = torch.randn(args.batch, s, hq, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(args.batch, s, hkv, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(args.batch, s, hkv, d, device=device, dtype=dtype, requires_grad=True)
        mask, docs = mixed_layout(args.batch, s, device)
        resolved = cfg.resolve(d)
        inp = check_inputs(q, k, v, mask, mask, q_document_ids=docs, k_document_ids=docs)
        plan = get_plan(inp, (mask, mask, None, None, docs, docs), resolved.block_m, resolved.block_n,
                        resolved.split_tiles or 0, kernels(backend_for(device) == "interpret"))
        tiles = plan.counts()["partial"] + plan.counts()["full"]
        fwd_flops = 4.0 * d * hq * tiles * resolved.block_m * resolved.block_n
        for name, make in _implementations(q, k, v, mask, docs, cfg).items():
            try:
                run = make()
            except Exception as exc:  # report and go on: one backend failing must not hide the others
                print(f"| {s} | {name} | - | not measured ({_short(exc)}) | - |")
                continue
            grad = []

            def fwd_bwd():
                out = run()
                if not grad:
                    grad.append(torch.randn_like(out))
                torch.autograd.grad(out, (q, k, v), grad[0])

            def fwd():
                with torch.no_grad():
                    run()

            for label, fn, flops in (("fwd", fwd, fwd_flops), ("fwd+bwd", fwd_bwd, 3.5 * fwd_flops)):
                try:
                    t = _time(fn, iters, device)
                    print(f"| {s} | {name} | {label} | {t * 1e3:.2f} | {flops / t / 1e12:.3f} |")
                except Exception as exc:
                    print(f"| {s} | {name} | {label} | not measured ({_short(exc)}) | - |")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
