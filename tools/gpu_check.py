#!/usr/bin/env python
"""GPU self-check: what CI (CPU ranks only) cannot show, in one command and one JSON report.

    python tools/gpu_check.py                 # on a CUDA machine: all checks, one JSON object on stdout
    python tools/gpu_check.py --quick         # smaller sizes (a few seconds per check)

Checks, each reported with its figures and `ok`:

* `kernels`: the bitfield-attention Triton kernels compiled natively (bf16) at 4k-64k tokens on a
  multimodal mask (text, images, audio, two packed documents). The forward output is compared with
  the fp32 reference on sampled query rows at every length; the backward (dq, dk, dv) against the
  whole fp32 reference where its score matrix fits (up to 16k). Forward+backward time is measured
  next to `flex_attention` (compiled) on the same mask.
* `training_step`: one GPU, bf16 parameters with fp32 master weights, the distributed optimizer:
  `examples/pretrain_mimo.py` on the demo model for a few steps; the losses must be finite and fall.
* `offload`: encoder-parameter offload to pinned host memory releases the device memory and the
  weights come back bit-identical.

On a machine without CUDA it says so and exits 0 (nothing to check). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def check_kernels(seqlens, heads: int, head_dim: int, iters: int) -> dict:
    from bench_attention import _implementations, _time, mixed_layout

    from mimo.attention import KernelConfig, bitfield_attention, reference_attention, reference_attention_general

    dev = torch.device("cuda")
    rows = []
    ok = True
    for s in seqlens:
        torch.manual_seed(s)
        q, k, v = (torch.randn(1, s, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
        mask, docs = mixed_layout(1, s, dev)
        row = {"seq_len": s}
        out = bitfield_attention(q, k, v, mask, docs)
        # Forward: fp32 reference on 256 query rows spread over the sequence (the full score
        # matrix of 32k tokens does not fit next to everything else).
        pick = torch.linspace(0, s - 1, 256, device=dev).long()
        ref_rows = reference_attention_general(q.float()[:, pick], k.float(), v.float(), mask[:, pick], mask,
                                               q_positions=pick, q_document_ids=docs[:, pick],
                                               k_document_ids=docs)
        row["fwd_max_err"] = _max_err(out[:, pick], ref_rows)
        row_ok = row["fwd_max_err"] < 2e-2
        if s <= 16384:  # the whole fp32 reference, forward and backward
            qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
            qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
            go = torch.randn_like(q)
            reference_attention(qr, kr, vr, mask, docs).backward(go.float())
            bitfield_attention(qb, kb, vb, mask, docs).backward(go)
            for name, a, b in (("dq", qb, qr), ("dk", kb, kr), ("dv", vb, vr)):
                row[f"{name}_max_err"] = _max_err(a.grad, b.grad)
                # bf16 gradients summed over up to 16k keys: relative to the gradient's scale.
                row_ok &= row[f"{name}_max_err"] <= 2e-2 * max(1.0, float(b.grad.abs().max()))
            del qr, kr, vr, qb, kb, vb
            torch.cuda.empty_cache()
        row["ok"] = bool(row_ok)
        ok &= row_ok
        # Speed: forward + backward, the same mask for every implementation.
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        impls = _implementations(qg, kg, vg, mask, docs, KernelConfig())
        for name in ("bitfield", "flex_attention"):
            try:
                fwd = impls[name]()

                def step(fwd=fwd):
                    fwd().sum().backward()

                row[f"{name}_fwd_bwd_ms"] = round(_time(step, iters, dev) * 1e3, 3)
            except Exception as exc:  # a failed comparison implementation is reported, not fatal
                row[f"{name}_fwd_bwd_ms"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
        del q, k, v, qg, kg, vg, impls
        torch.cuda.empty_cache()
    return {"ok": bool(ok), "heads": heads, "head_dim": head_dim, "rows": rows}


def check_training_step(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "steps.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "pretrain_mimo.py"),
               "--config", os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml"), "--device", "cuda",
               "--log-json", log,
               "--set", "parallelism.language.dp=1", "--set", "parallelism.images.dp=1",
               "--set", "training.precision=bf16", "--set", "training.use_distributed_optimizer=true",
               "--set", f"training.train_iters={steps}"]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"ok": False, "command": " ".join(cmd[1:]), "returncode": proc.returncode,
                    "stderr_tail": proc.stderr[-2000:]}
        with open(log) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in rows]
    finite = all(x == x and abs(x) != float("inf") for x in losses)
    return {"ok": bool(finite and len(losses) == steps and losses[-1] < losses[0]), "steps": len(rows),
            "losses": losses, "step_time_s": [r.get("step_time_s") for r in rows],
            "max_memory_gb": rows[-1].get("max_memory_gb") if rows else None, "wall_s": round(wall, 1)}


def check_offload(numel: int) -> dict:
    from mimo.runtime import select_runtime
    from mimo.runtime.offload import ParameterOffload

    runtime = select_runtime("cuda")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // 4, device=runtime.device, dtype=torch.bfloat16))
              for _ in range(4)]
    before = [p.detach().clone().cpu() for p in params]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    off = ParameterOffload(params, runtime)
    off.to_host()
    torch.cuda.synchronize()
    released = base - torch.cuda.memory_allocated()
    off.to_device()
    torch.cuda.synchronize()
    restored = torch.cuda.memory_allocated() - (base - released)
    same = all(torch.equal(p.detach().cpu(), b) for p, b in zip(params, before))
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"ok": bool(same and released >= nbytes and restored >= nbytes), "param_bytes": nbytes,
            "released_bytes": int(released), "restored_bytes": int(restored), "bit_identical": bool(same)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes: 4k and 8k tokens, 2 training steps")
    p.add_argument("--seqlens", default="4096,8192,16384,32768,65536")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "message": "no CUDA device on this machine: nothing to check "
                          "(CPU behaviour is covered by the test suite)"}))
        return 0
    seqlens = [4096, 8192] if args.quick else [int(x) for x in args.seqlens.split(",")]
    report = {"cuda": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["kernels"] = check_kernels(seqlens, args.heads, args.head_dim, 2 if args.quick else args.iters)
    report["training_step"] = check_training_step(3 if args.quick else 5)
    report["offload"] = check_offload(1 << 26 if args.quick else 1 << 28)
    report["ok"] = all(report[k]["ok"] for k in ("kernels", "training_step", "offload"))
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
