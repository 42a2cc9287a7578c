#!/usr/bin/env python
"""GPU self-check: what CI (CPU ranks only) cannot show, in one command and one JSON report.

    python tools/gpu_check.py                 # on a CUDA machine: all checks, one JSON object on stdout
    python tools/gpu_check.py --quick         # smaller sizes (a few seconds per check)
    python tools/gpu_check.py --layouts       # multi-GPU bring-up: tiny-model layouts (NCCL) vs CPU FP32

`--layouts` (the first thing to run on a new cluster, README "New cluster bring-up") trains a tiny
two-encoder model for a few steps in each layout of LAYOUTS that fits the GPUs present (2: homogeneous
TP2 and colocated; 4: non-colocated with LLM PP2 or CP2; 8: non-colocated with LLM PP2 x CP2) under
torchrun with NCCL, one rank per GPU, FP32 with TF32 and fusions off, and compares the losses, the
first step's gradients and the final parameters with the same config and seed run on one CPU rank
(gloo) — one JSON line per layout (`ok`, `max_rel_diff`), then a summary line. Layouts needing more
GPUs are listed as not checked (on one GPU or CPU-only: all of them; the CPU reference still runs);
exit 0 unless a checked layout differs. `--cpu-self-check` runs the comparison on gloo CPU ranks
instead, with a control run (another seed) that must be caught (tests/test_gpu_check_layouts.py also
runs the torchrun launch on gloo CPU ranks with the hidden `--torchrun-cpu`).

Checks, each reported with its figures and `ok`:

* `kernels`: the bitfield-attention Triton kernels compiled natively (bf16) at 4k-64k tokens on a
  multimodal mask (text, images, audio, two packed documents). The forward output is compared with
  the fp32 reference on sampled query rows at every length; the backward (dq, dk, dv) against the
  whole fp32 reference where its score matrix fits (up to 16k), as two launches (`dq_max_err`, ...)
  and as one (`fused_backward`: `fused_dq_max_err`, ...). Forward+backward time is measured
  next to `flex_attention` (compiled) on the same mask (not with `--quick`: `tools/gpu_bench.py`
  times both).
* `training_step`: one GPU, bf16 parameters with fp32 master weights, the distributed optimizer:
  `examples/pretrain_mimo.py` on the demo model for a few steps; the losses must be finite and fall.
* `offload`: encoder-parameter offload to pinned host memory releases the device memory and the
  weights come back bit-identical.

Each check's result is also printed on stderr as it ends; a check that raises is reported failed
and the others still run. On a machine without CUDA it says so and exits 0 (nothing to check).
Exit 1 when a check fails.
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


def check_kernels(seqlens, heads: int, head_dim: int, iters: int, compare=("bitfield", "flex_attention"),
                  device: str = "cuda") -> dict:
    """`device`: cuda; the test suite runs it on cpu (Triton's interpreter) at tiny sizes."""
    from bench_attention import _implementations, _time, mixed_layout

    from mimo.attention import KernelConfig, bitfield_attention, reference_attention, reference_attention_general

    dev = torch.device(device)
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
            go = torch.randn_like(q)
            reference_attention(qr, kr, vr, mask, docs).backward(go.float())
            # The backward as two launches (the default) and as one (KernelConfig.fused_backward).
            for prefix, cfg in (("", KernelConfig()), ("fused_", KernelConfig(fused_backward=True))):
                qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
                bitfield_attention(qb, kb, vb, mask, docs, kernel_config=cfg).backward(go)
                for name, a, b in (("dq", qb, qr), ("dk", kb, kr), ("dv", vb, vr)):
                    row[f"{prefix}{name}_max_err"] = _max_err(a.grad, b.grad)
                    # bf16 gradients summed over up to 16k keys: relative to the gradient's scale.
                    row_ok &= row[f"{prefix}{name}_max_err"] <= 2e-2 * max(1.0, float(b.grad.abs().max()))
            del qr, kr, vr, qb, kb, vb
            torch.cuda.empty_cache()
        row["ok"] = bool(row_ok)
        ok &= row_ok
        # Speed: forward + backward, the same mask for every implementation.
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        impls = _implementations(qg, kg, vg, mask, docs, KernelConfig())
        for name in compare:
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


# ---- --layouts: multi-GPU layouts (NCCL, torchrun) against the 1-rank CPU FP32 run ----------------

# A tiny two-encoder model (tests/tiny.py's sizes); each layout differs only in `parallelism`.
LAYOUT_MODEL = {
    "model": {
        "language": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                         max_sequence_length=64),
        "encoders": {
            "images": dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2, image_size=8,
                           patch_size=4, frozen=False, projector={"kind": "mlp"}),
            "audio": dict(kind="audio", num_layers=1, hidden_size=16, num_attention_heads=2, clip_frames=16,
                          frames_per_token=4, num_mel_bins=8, frozen=True, projector={"kind": "linear"}),
        },
    },
    "data": {"seq_length": 48, "seed": 3},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": 3, "optimizer": "sgd", "lr": 0.1,
                 "seed": 7},
}
# name -> (GPUs, parallelism, LLM attention). Colocated: every module on the same ranks;
# non-colocated: each module on its own ranks (rank_offset), the LLM pipelined and/or context-parallel.
LAYOUTS = {
    "homogeneous_tp2": (2, dict(language=dict(tp=2), images=dict(tp=2), audio=dict(tp=2)), "sdpa"),
    "colocated_llm_tp2_encoders_dp2": (2, dict(language=dict(tp=2), images=dict(dp=2), audio=dict(dp=2)), "sdpa"),
    "noncolocated_llm_pp2": (4, dict(language=dict(pp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3)),
                             "sdpa"),
    "noncolocated_llm_cp2": (4, dict(language=dict(cp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3)),
                             "bitfield"),
    "noncolocated_llm_pp2_cp2": (8, dict(language=dict(pp=2, cp=2), images=dict(dp=2, rank_offset=4),
                                         audio=dict(tp=2, rank_offset=6)), "bitfield"),
}
LAYOUT_RTOL = 2e-3  # GPU FP32 (TF32 and fusions off) vs CPU FP32: other kernels, other summation orders


def layout_config(name: str, steps: int) -> dict:
    """The complete FP32 parity config of one layout (mimo.training.parity.parity_overrides)."""
    import copy

    from mimo.training.parity import parity_overrides

    raw = copy.deepcopy(LAYOUT_MODEL)
    gpus, par, attention = LAYOUTS[name]
    raw["model"]["language"]["attention"] = attention
    raw["parallelism"] = copy.deepcopy(par)
    return parity_overrides(raw, steps)


def reference_config(steps: int, attention: str = "sdpa") -> dict:
    """The same model on one rank."""
    import copy

    from mimo.training.parity import parity_overrides

    raw = copy.deepcopy(LAYOUT_MODEL)
    raw["model"]["language"]["attention"] = attention
    raw["parallelism"] = {m: {} for m in ("language", "images", "audio")}
    return parity_overrides(raw, steps)


def _worst(report: dict) -> float:
    return max(report["max_rel_loss_diff"], report["max_rel_grad_diff"], report["max_rel_param_diff"])


def layout_worker(name: str, steps: int, result: str, device: str = "cuda") -> int:
    """One torchrun rank of a layout on its GPU (NCCL): train, gather every rank's record on rank 0.
    `device` cpu (tests only, `--torchrun-cpu`): the same launch on gloo CPU ranks."""
    import torch.distributed as dist

    from mimo.config import load_config
    from mimo.runtime import fusions, init_distributed, select_runtime, setup_megatron, shutdown
    from mimo.training import Trainer
    from mimo.training.parity import merge_ranks, placement_of, record_run

    runtime = select_runtime(device)
    if device == "cpu":
        torch.set_num_threads(1)
    init_distributed(runtime, 5.0)
    setup_megatron(runtime, seed=0)
    # The check is about the layouts' communication: FP32 as the CPU run computes it, no TF32, no fusions.
    fusions.activate(None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        cfg = load_config(layout_config(name, steps))
        rec = record_run(Trainer(cfg, runtime), steps)
        rec = {"losses": [float(x) for x in rec["losses"]],
               "grads": {k: v.detach().cpu() for k, v in rec["grads"].items()},
               "params": {k: v.detach().cpu() for k, v in rec["params"].items()}}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rec)
        if dist.get_rank() == 0:
            torch.save(merge_ranks(gathered, placement_of(cfg)), result)
    finally:
        shutdown()
    return 0


def _run_layout_on_gpus(name: str, steps: int, timeout_s: float, device: str = "cuda") -> dict:
    gpus = LAYOUTS[name][0]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               os.path.abspath(__file__), "--layout-worker", name, "--steps", str(steps), "--result", result,
               "--worker-device", device]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(result):
            tail = (proc.stderr or proc.stdout)[-1500:]
            return {"error": f"torchrun exit {proc.returncode}", "stderr_tail": tail}
        return {"run": torch.load(result, weights_only=True)}  # plain tensors, floats and dicts only


def arg_problems(args) -> list:
    """One line per flag the checks could not use ("--flag: why"), found before any check runs."""
    out = []
    if args.only and not all(args.only.split(",")):
        out.append(f"--only {args.only!r}: an empty layout name")
    from bench_attention import shape_problems

    out += shape_problems(args.seqlens, args.heads, args.heads, args.head_dim, args.iters)
    for flag, value in (("--rtol", args.rtol), ("--cpu-rtol", args.cpu_rtol), ("--timeout", args.timeout)):
        if not value > 0:  # a tolerance below 0 fails every layout; NaN passes none
            out.append(f"{flag}: must be > 0, got {value}")
    return out


def layouts_main(args) -> int:
    """`--layouts` / `--cpu-self-check`: one JSON line per layout, then a summary line."""
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(LAYOUTS) if args.only else set()
    if unknown:
        print(f"error: --only: unknown layout(s) {', '.join(sorted(unknown))} (known: {', '.join(LAYOUTS)})",
              file=sys.stderr)
        return 2
    if args.steps < 1:
        print("error: --steps: must be >= 1", file=sys.stderr)
        return 2
    from mimo.training.parity import compare, run_config

    steps, rtol = args.steps, args.rtol
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.torchrun_cpu:  # tests: the torchrun launch, gather and comparison on gloo CPU ranks
        gpus = max(g for g, _, _ in LAYOUTS.values())
    refs = {}

    def reference(attention):  # the 1-rank CPU FP32 run (gloo), once per LLM attention kind
        if attention not in refs:
            refs[attention] = run_config(reference_config(steps, attention), steps)
        return refs[attention]

    rows = []
    if args.cpu_self_check:
        # The comparison machinery on gloo CPU ranks: each layout vs the 1-rank run must agree (FP32,
        # tight), and a deliberately wrong run (the first layout with another init seed) must not.
        for name in names:
            report = compare(reference(LAYOUTS[name][2]), run_config(layout_config(name, steps), steps), args.cpu_rtol)
            rows.append({"layout": name, "ranks": LAYOUTS[name][0], "where": "cpu", "ok": report["ok"],
                         "max_rel_diff": _worst(report)})
        wrong = layout_config(names[0], steps)
        wrong["training"]["seed"] += 1
        report = compare(reference(LAYOUTS[names[0]][2]), run_config(wrong, steps), args.cpu_rtol)
        rows.append({"layout": f"{names[0]} (control: another seed, must differ)", "ranks": LAYOUTS[names[0]][0],
                     "where": "cpu", "ok": not report["ok"], "max_rel_diff": _worst(report)})
    else:
        for name in names:
            need, _, attention = LAYOUTS[name]
            row = {"layout": name, "gpus": need}
            if gpus < need:
                row.update(status="not checked", reason=f"needs {need} GPUs, {gpus} present")
                rows.append(row)
                continue
            got = _run_layout_on_gpus(name, steps, args.timeout, "cpu" if args.torchrun_cpu else "cuda")
            if "error" in got:
                row.update(status="failed", ok=False, **got)
            else:
                report = compare(reference(attention), got["run"], rtol)
                row.update(status="checked", ok=report["ok"], max_rel_diff=_worst(report),
                           loss=report["loss"], cpu_loss=report["baseline_loss"])
            rows.append(row)
        if not refs and names:
            # Nothing fits the GPUs present: still run the CPU reference so this side of the tool is exercised.
            ref = reference(LAYOUTS[names[0]][2])
            rows.append({"layout": "cpu_reference", "ranks": 1, "where": "cpu", "status": "ran",
                         "losses": [round(x, 6) for x in ref["losses"]]})
    for row in rows:
        print(json.dumps(row), flush=True)
    checked = [r for r in rows if "ok" in r]
    skipped = [r["layout"] for r in rows if r.get("status") == "not checked"]
    summary = {"summary": True, "gpus": gpus, "checked": len(checked), "failed": sum(not r["ok"] for r in checked),
               "not_checked": skipped, "ok": all(r["ok"] for r in checked)}
    if args.cpu_self_check:
        summary["mode"] = "cpu-self-check"
    elif skipped:
        summary["message"] = (f"{len(skipped)} of {len(names)} layouts need more GPUs than the {gpus} present "
                              "(NCCL puts one rank on each GPU): not checked" +
                              ("; nothing was compared on a GPU" if not checked else ""))
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes: 4k and 8k tokens (not --seqlens), 2 kernel timings, 3 training steps")
    p.add_argument("--layouts", action="store_true",
                   help="tiny-model layouts under torchrun + NCCL vs the 1-rank CPU FP32 run (the layouts that fit "
                        "the GPUs present; the rest are reported as not checked)")
    p.add_argument("--cpu-self-check", action="store_true",
                   help="with --layouts' machinery on gloo CPU ranks: each layout vs the 1-rank run, plus a control "
                        "that must differ")
    p.add_argument("--only", default="", help=f"comma list of layouts ({', '.join(LAYOUTS)})")
    p.add_argument("--steps", type=int, default=2, help="training steps per layout run")
    p.add_argument("--rtol", type=float, default=LAYOUT_RTOL, help="GPU vs CPU: largest relative difference")
    p.add_argument("--cpu-rtol", type=float, default=1e-4, help="--cpu-self-check: largest relative difference")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per torchrun layout run")
    p.add_argument("--layout-worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--torchrun-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--seqlens", default="4096,8192,16384,32768,65536")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    problems = arg_problems(args)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if args.layout_worker:
        return layout_worker(args.layout_worker, args.steps, args.result, args.worker_device)
    if args.layouts or args.cpu_self_check:
        return layouts_main(args)
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "message": "no CUDA device on this machine: nothing to check "
                          "(CPU behaviour is covered by the test suite)"}))
        return 0
    seqlens = [4096, 8192] if args.quick else [int(x) for x in args.seqlens.split(",")]
    report = {"cuda": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    # --quick leaves the flex_attention timing (each length a cold torch.compile) to tools/gpu_bench.py.
    checks = {"kernels": lambda: check_kernels(seqlens, args.heads, args.head_dim, 2 if args.quick else args.iters,
                                               ("bitfield",) if args.quick else ("bitfield", "flex_attention")),
              "training_step": lambda: check_training_step(3 if args.quick else 5),
              "offload": lambda: check_offload(1 << 26 if args.quick else 1 << 28)}
    for name, check in checks.items():
        t0 = time.perf_counter()
        try:
            report[name] = check()
        except Exception as exc:  # one check failing (a kernel that does not build) must not hide the others
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        # As each check ends, on stderr: a run cut short by a time limit still shows what it found.
        print(f"gpu_check: {name} ({time.perf_counter() - t0:.0f} s): {json.dumps(report[name])}",
              file=sys.stderr, flush=True)
    report["ok"] = all(report[k]["ok"] for k in checks)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
