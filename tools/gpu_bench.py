#!/usr/bin/env python
"""One-GPU speed bench: attention kernels, mimo vs plain megatron-core training step, top kernels,
and a measured hardware profile for the planner (DESIGN.md, "GPU speed"; issue #40 item 3).

    python tools/gpu_bench.py --out gpu_bench.jsonl          # on one CUDA GPU (175 s on an H200)
    python tools/gpu_bench.py --cpu-smoke --out smoke.jsonl  # CPU, gloo world size 1, fp32, tiny sizes

Every result is one JSON line on stdout (and appended to --out), each with `"device"`; the order of
the run is env, step (both impls, then the profiled step, one layer alone, the model's GEMMs), then
the attention table, whose rows not started within --budget-s seconds (default 360) of the start are
emitted with `"skipped"`, so the whole command stays inside a few minutes (175 s on an H200):

* `{"bench": "env", "torch", "triton", "megatron_core", "gemm_n", "gemm_tflops", ...}`: versions and
  one 8192^3 bf16 GEMM rate.
* `{"bench": "attention", "tokens", "mask": "causal"|"multimodal", "impl": "bitfield"|"flex"|"sdpa",
  "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", ...}` for 8k-64k tokens (bf16, batch 1,
  16 query / 8 KV heads, head dim 128 by default). FLOPs count the (query, key) pairs the mask allows
  (causal: s (s + 1) / 2): 4 d pairs per head forward, 3.5x that for forward + backward; every
  implementation is credited with the same work. `multimodal` is tools/bench_attention.py's mask
  (text, images, audio, two packed documents). sdpa runs `is_causal=True` (flash) for the causal
  mask and a dense boolean mask for the multimodal one (up to --sdpa-max-tokens; beyond, a row with
  `"skipped"`). A failed implementation gives a row with `"error"` and null times. bitfield rows
  also carry `fwd_speedup_vs_flex` and `fwd_bwd_speedup_vs_flex` (flex ms / bitfield ms) and
  `kernel_config`, the launch settings they ran with: KernelConfig's defaults, or those of
  `--kernel-config FILE` (tools/tune_attention.py --json-out's file, or an object of its fields).
* `{"bench": "step", "impl": "mimo"|"megatron", "model", "step_ms", "tokens_per_s", "mfu",
  "peak_memory_gb", "losses", ...}`: the same text-only GPT (default: the 1.24B LLM of
  examples/configs/gpu_llava_8gpu.yaml, 24 x 2048, GQA 16/8, ffn 8192, vocab 32000, 2048 tokens),
  trained by mimo's Trainer and by plain megatron-core (`GPTModel` built from the same
  TransformerConfig, layer spec and seed, megatron's `DistributedDataParallel`,
  `get_megatron_optimizer`, `OptimizerParamScheduler` and
  `forward_backward_no_pipelining`), with identical shape, global / micro batch, precision (bf16
  params, fp32 master weights, distributed optimizer), Adam settings, seed and data (mimo's mock
  samples; the megatron run gets them pre-built on the device, an ideal data loader); default
  global batch 16, micro batch 4, 8 steps of which 3 warm up (megatron runs first, then mimo; the
  TransformerConfig is mimo.model.transformer_config's, so mimo's CUDA fusion settings apply to
  both, and both take torch's fused Adam step on CUDA). The CPU smoke run uses 2 steps of a 2-layer model in fp32; its losses agree. `step_ms`
  is the median of the timed steps after the warm-up ones; MFU = model FLOPs of the step
  (mimo.training.flops) / step time / the device's dense bf16 peak (mimo.training.flops.PEAK_TFLOPS).
  `ratio_mimo_over_megatron` rides on the megatron row.
* `{"bench": "profile", "kernel", "ms", "share", "calls"}`: the top CUDA kernels (by summed time) of
  one torch.profiler-recorded mimo training step; `share` is the kernel's fraction of all kernel
  time of the step. On the CPU smoke run: top CPU operators instead.

It also writes the planner profile (`--profile-out`, default: next to --out as
`<out stem>.profile.json`, else `gpu_profile.json`), one JSON object, schema `mimo.gpu_profile/1`:

    {"schema": "mimo.gpu_profile/1", "device": "NVIDIA H100 80GB HBM3", "torch": "...",
     "memory_bytes": <the device's total memory>,         # null on the CPU smoke run
     "date": "YYYY-MM-DD", "peak_tflops": 989.0,          # table value; null when unknown
     "dtype": "bfloat16",
     "gemm": [{"name": "qkv", "m": tokens, "k": in, "n": out, "ms", "tflops"}, ...],
     "gemm_tflops": <FLOP-weighted rate over the model's layer GEMMs>,
     "gemm_efficiency": gemm_tflops / peak_tflops,        # null without a peak
     "large_gemm_tflops": <8192^3 bf16 GEMM>, "memory_bandwidth": <bytes/s of a 1 GiB copy, read + write>,
     "attention": [{"tokens", "mask", "impl", "fwd_tflops", "fwd_bwd_tflops", "bwd_tflops"}, ...],
     "attention_impl": "sdpa",                            # the impl the step model trains with
     "attention_efficiency": fwd TFLOP/s / peak (causal, the impl above, median over lengths),
     "attention_backward_rate": backward TFLOP/s / forward TFLOP/s (same rows),
     "layer": {"model": {...}, "micro_batch", "seq_length", "forward_ms", "backward_ms",
               "forward_tflops", "backward_tflops"},     # one transformer layer alone, fwd and bwd
     "step": {"mimo": {...step row...}, "megatron": {...}},
     "kernels": [...profile rows...],
     "errors": {"<part>_error": "..."}}                  # parts that failed (absent figures are null)

Everything is measured on the one device; attention `bwd_tflops` = 2.5 x fwd FLOPs / (fwd_bwd - fwd)
time; the layer's FLOPs follow mimo.training.flops (matmuls only, causal pairs, backward = 2 x
forward); GEMM `m` is the tokens of one microbatch.
Without CUDA (and without --cpu-smoke) it prints one line saying what it cannot measure and exits 0.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402

SCHEMA = "mimo.gpu_profile/1"

# The text-only model both step benches train (GPU default: the LLM of gpu_llava_8gpu.yaml).
GPU_MODEL = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=8192,
                 vocab_size=32000, max_sequence_length=2048)
SMOKE_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=128, max_sequence_length=32)


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Emitter:
    """JSON lines to stdout and to --out (appended), each stamped with the device."""

    def __init__(self, device: str, out: str | None):
        self.device, self.out, self.rows = device, out, []

    def __call__(self, row: dict) -> dict:
        row = {"device": self.device, **row}
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")
        return row


def _sig(x: float) -> float:
    """Four significant digits (CPU smoke rates are tiny; GPU ones large)."""
    return float(f"{x:.4g}")


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, iters: int, device, warmup: int = 1) -> float:
    """Mean milliseconds of `fn` over `iters` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

def causal_layout(b: int, s: int, device):
    """An all-text sequence: the bitfield mask of plain causal attention, one document."""
    from mimo.attention import build_bitfield_mask

    ids = torch.zeros(b, s, dtype=torch.int64, device=device)
    return build_bitfield_mask(ids, {}, text_sees=set()), torch.zeros(b, s, dtype=torch.int64, device=device)


def attention_impls(q, k, v, mask, docs, causal: bool, cfg, sdpa_dense_ok: bool):
    """name -> a maker of a zero-argument forward (q, k, v as [b, s, h, d]); the multimodal flex
    and sdpa paths are tools/bench_attention.py's, the causal ones use each library's causal path."""
    from bench_attention import _implementations, compiled_flex

    from mimo.attention import bitfield_attention

    group = q.shape[2] // k.shape[2]
    general = _implementations(q, k, v, mask, docs, cfg)
    impls = {}
    if causal:
        def flex():
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            b, s = q.shape[0], q.shape[1]
            # Compiled at long lengths, as the multimodal mask (bench_attention): eagerly about 10 bytes a pair.
            block = create_block_mask(lambda bi, h, qi, ki: ki <= qi, None, None, s, s, device=q.device,
                                      _compile=q.is_cuda and s * s > 2**31)
            fn = compiled_flex() if q.is_cuda else flex_attention
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: fn(qt, kt, vt, block_mask=block, enable_gqa=group > 1).transpose(1, 2)

        def sdpa():
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=group > 1).transpose(1, 2)

        impls["flex"], impls["sdpa"] = flex, sdpa
    else:
        impls["flex"] = general["flex_attention"]
        if sdpa_dense_ok:
            impls["sdpa"] = general["sdpa (dense bool mask)"]
        else:
            impls["sdpa"] = None
    impls["bitfield"] = lambda: (lambda: bitfield_attention(q, k, v, mask, docs, kernel_config=cfg))  # last: vs flex
    return impls


def kernel_config_of(path: str, head_dim: int):
    """The KernelConfig in a JSON file (`tools/tune_attention.py --json-out`'s, under its
    "kernel_config", or a plain object of KernelConfig fields), checked for `head_dim`, and the file's
    whole object. Raises ValueError naming the file and the field."""
    from mimo.config.kernel import KernelConfig, field_problems, resolve_problem

    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise ValueError(f"--kernel-config {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"--kernel-config {path}: cannot read it as JSON ({exc})") from None
    fields = raw.get("kernel_config", raw) if isinstance(raw, dict) else raw
    problem = (field_problems(fields) or [resolve_problem(fields, head_dim)])[0]
    if problem:
        key, reason = problem
        raise ValueError(f"--kernel-config {path}: {key + ': ' if key else ''}{reason}")
    return KernelConfig(**fields), raw


def tuned_shape_mismatch(tuned: dict, heads: int, kv_heads: int, head_dim: int) -> str:
    """What differs between the attention shape a tune_attention.py file (its object) was tuned at
    and this run's ('' when nothing, or when the file does not say)."""
    ours = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    return ", ".join(f"{k} {tuned[k]} there, {v} here" for k, v in ours.items() if k in tuned and tuned[k] != v)


def bench_attention(emit, device, seqlens, heads, kv_heads, head_dim, iters, dtype, masks, sdpa_max_tokens,
                    tiny=False, deadline=None, cfg=None) -> list:
    """The attention table; once `deadline` (time.perf_counter()) has passed, the remaining rows are
    emitted with `"skipped"` so that the whole run stays inside its budget. `cfg`: the bitfield
    kernels' KernelConfig (default: its defaults); its resolved fields go into the bitfield rows."""
    from mimo.attention import KernelConfig
    from mimo.training.flops import attention_pairs

    from bench_attention import mixed_layout

    if cfg is None:
        cfg = KernelConfig(16, 16, 16, 16, split_tiles=2) if tiny else KernelConfig()
    resolved = dataclasses.asdict(cfg.resolve(head_dim))
    rows = []
    for s in seqlens:
        for mask_kind in masks:
            torch.manual_seed(0)
            q = torch.randn(1, s, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(1, s, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(1, s, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            causal = mask_kind == "causal"
            mask, docs = causal_layout(1, s, device) if causal else mixed_layout(1, s, device)
            pairs = s * (s + 1) // 2 if causal else attention_pairs(mask.cpu(), docs.cpu())
            fwd_flops = 4.0 * head_dim * heads * pairs
            impls = attention_impls(q, k, v, mask, docs, causal, cfg, s <= sdpa_max_tokens)
            for name, make in impls.items():
                base = {"bench": "attention", "tokens": s, "mask": mask_kind, "impl": name, "heads": heads,
                        "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
                        "allowed_pairs": pairs}
                t0 = time.perf_counter()
                if deadline is not None and t0 > deadline:
                    rows.append(emit({**base, "fwd_ms": None, "fwd_bwd_ms": None, "fwd_tflops": None,
                                      "fwd_bwd_tflops": None, "skipped": "time budget (--budget-s) spent"}))
                    continue
                if make is None:
                    rows.append(emit({**base, "fwd_ms": None, "fwd_bwd_ms": None, "fwd_tflops": None,
                                      "fwd_bwd_tflops": None,
                                      "skipped": f"dense {s}x{s} mask over --sdpa-max-tokens {sdpa_max_tokens}"}))
                    continue
                row = dict(base)
                try:
                    run = make()
                    grad = []

                    def fwd_bwd(run=run):
                        out = run()
                        if not grad:
                            grad.append(torch.randn_like(out))
                        torch.autograd.grad(out, (q, k, v), grad[0])

                    def fwd(run=run):
                        with torch.no_grad():
                            run()

                    f_ms = _time_ms(fwd, iters, device)
                    fb_ms = _time_ms(fwd_bwd, iters, device)
                    row.update(fwd_ms=round(f_ms, 4), fwd_bwd_ms=round(fb_ms, 4),
                               fwd_tflops=_sig(fwd_flops / f_ms / 1e9),
                               fwd_bwd_tflops=_sig(3.5 * fwd_flops / fb_ms / 1e9),
                               bwd_tflops=_sig(2.5 * fwd_flops / (fb_ms - f_ms) / 1e9) if fb_ms > f_ms else None)
                except Exception as exc:  # one backend failing must not hide the others
                    row.update(fwd_ms=None, fwd_bwd_ms=None, fwd_tflops=None, fwd_bwd_tflops=None, error=_short(exc))
                if name == "bitfield":
                    row["kernel_config"] = resolved
                flex = next((r for r in rows[::-1] if r["impl"] == "flex" and r["tokens"] == s
                             and r["mask"] == mask_kind), None)
                if name == "bitfield" and flex and flex.get("fwd_bwd_ms") and row.get("fwd_bwd_ms"):
                    row["fwd_speedup_vs_flex"] = round(flex["fwd_ms"] / row["fwd_ms"], 4)
                    row["fwd_bwd_speedup_vs_flex"] = round(flex["fwd_bwd_ms"] / row["fwd_bwd_ms"], 4)
                rows.append(emit(row))
                log(f"attention {mask_kind} {s} {name}: fwd {row['fwd_ms']} ms, fwd+bwd {row['fwd_bwd_ms']} ms "
                    f"({time.perf_counter() - t0:.1f}s)")
                _free(device)
            del q, k, v, mask, docs
            _free(device)
    return rows


# ----------------------------------------------------------------------------------------------
# Training step: mimo and plain megatron-core
# ----------------------------------------------------------------------------------------------

def step_config(model: dict, seq: int, gbs: int, mbs: int, precision: str, dist_opt: bool, attention: str,
                steps: int) -> dict:
    """The raw mimo config of the text-only model both impls train."""
    return {
        "model": {"language": dict(model, max_sequence_length=max(model["max_sequence_length"], seq),
                                   attention=attention),
                  "encoders": {}},
        "parallelism": {"language": {"tp": 1, "dp": 1}},
        "data": {"kind": "mock", "seq_length": seq, "seed": 0},
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs, "train_iters": steps, "optimizer": "adam",
                     "lr": 1.0e-4, "clip_grad": 1.0, "seed": 1234, "precision": precision, "init": "local",
                     "use_distributed_optimizer": dist_opt},
    }


def step_flops_of(cfg, steps: int) -> list:
    """Model FLOPs of each step (mimo.training.flops over the step's global batch): identical for both impls."""
    from mimo.data import build_dataset
    from mimo.training.flops import step_flops, step_work

    ds = build_dataset(cfg)
    G = cfg.training.global_batch_size
    return [step_flops(cfg, step_work(cfg, [ds.sample(s * G + i) for i in range(G)]))
            for s in range(steps)]


def _peak_mem_reset(device):
    """Reset the peak; GB allocated at that moment (the model, its optimizer state and anything left
    over; `peak_memory_gb` is absolute), None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return round(torch.cuda.memory_allocated() / 1e9, 3)


def _peak_mem_gb(device):
    return round(torch.cuda.max_memory_allocated() / 1e9, 3) if device.type == "cuda" else None


def step_row(impl: str, cfg, model_name: str, times_s: list, losses: list, flops: list, warmup: int, device,
             peak_tflops, extra=None) -> dict:
    timed = times_s[warmup:] or times_s
    step_s = statistics.median(timed)
    tokens = cfg.training.global_batch_size * cfg.data.seq_length
    fl = statistics.median(flops[warmup:] or flops)
    return {"bench": "step", "impl": impl, "model": model_name,
            "step_ms": round(step_s * 1e3, 3), "step_ms_all": [round(t * 1e3, 3) for t in times_s],
            "tokens_per_s": round(tokens / step_s, 1),
            "tflops": _sig(fl / step_s / 1e12),
            "mfu": round(fl / step_s / (peak_tflops * 1e12), 4) if peak_tflops else None,
            "peak_memory_gb": _peak_mem_gb(device), "losses": [float(x) for x in losses],
            "global_batch": cfg.training.global_batch_size, "micro_batch": cfg.training.micro_batch_size,
            "seq_length": cfg.data.seq_length, "precision": cfg.training.precision,
            "distributed_optimizer": cfg.training.use_distributed_optimizer, "warmup_steps": warmup,
            **(extra or {})}


def run_mimo(cfg, runtime, steps: int):
    """mimo's Trainer on the text-only config: per-step seconds and losses; the trainer is kept for the
    profiled step and the per-layer timing, the caller frees it."""
    from mimo.training import Trainer

    trainer = Trainer(cfg, runtime)
    at_start = _peak_mem_reset(runtime.device)
    times, losses = [], []
    for step in range(steps):
        r = trainer.train_step(step)
        times.append(r.step_time_s)
        losses.append(r.loss)
        log(f"mimo step {step}: loss {r.loss:.4f}, {r.step_time_s * 1e3:.1f} ms")
    return trainer, times, losses, at_start


def build_megatron(cfg, runtime):
    """Plain megatron-core: GPTModel from the same TransformerConfig, layer spec and seed as mimo's LLM,
    megatron's DDP, optimizer and LR schedule. Returns (ddp model, optimizer, scheduler, config)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mimo.config import LANGUAGE
    from mimo.model.architecture import finish_llm, gpt_model_kwargs
    from mimo.model.norm import block_spec
    from mimo.model.specs import llm_layer_spec
    from mimo.model.transformer_config import dtype_of, transformer_config
    from mimo.runtime import fusion_support, megatron_scope, optimizer_scope
    from mimo.topology import Layout
    from mimo.training import module_seed
    from mimo.training.optimizer import lr_scheduler, use_fused_adam

    if not parallel_state.model_parallel_is_initialized():
        # megatron's own parallel state at world size 1 (mimo never initialises it; its global memory
        # buffer, which initialize_model_parallel would create a second time, is kept).
        buffer, parallel_state._GLOBAL_MEMORY_BUFFER = parallel_state._GLOBAL_MEMORY_BUFFER, None
        with megatron_scope(runtime):
            parallel_state.initialize_model_parallel(1, 1)
        if buffer is not None:
            parallel_state._GLOBAL_MEMORY_BUFFER = buffer
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    lang, tr = cfg.model.language, cfg.training
    config = transformer_config(lang, Layout(), tr.precision, par=cfg.parallelism[LANGUAGE])
    spec = block_spec(llm_layer_spec(lang.attention, lang.normalization), config.num_layers)
    torch.manual_seed(module_seed(tr.seed, LANGUAGE))  # mimo seeds its LLM build the same way (init: local)
    with megatron_scope(runtime):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=lang.vocab_size,
                         max_sequence_length=lang.max_sequence_length, pre_process=True, post_process=True,
                         parallel_output=True, pg_collection=pgs, **gpt_model_kwargs(lang))
        finish_llm(model, lang)
    model.to(runtime.device)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=tr.grad_reduce_in_fp32 or tr.precision != "bf16",
                                               overlap_grad_reduce=tr.overlap_grad_reduce,
                                               use_distributed_optimizer=tr.use_distributed_optimizer)
    opt_config = OptimizerConfig(optimizer=tr.optimizer, lr=tr.lr, min_lr=tr.min_lr, weight_decay=tr.weight_decay,
                                 bf16=tr.precision == "bf16", params_dtype=dtype_of(tr.precision),
                                 use_distributed_optimizer=tr.use_distributed_optimizer, clip_grad=tr.clip_grad)
    with optimizer_scope(runtime):
        ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
        optimizer = get_megatron_optimizer(opt_config, [ddp], pg_collection=pgs, use_gloo_process_groups=False)
    if fusion_support(runtime).fused_adam:  # the optimizer step mimo takes on this runtime, for both
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            use_fused_adam(inner)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    return ddp, optimizer, lr_scheduler(optimizer, tr), config


def megatron_batches(cfg, runtime, steps: int):
    """The exact microbatches mimo trains on (its mock dataset, its collation), pre-built on the device,
    and the global batch's loss-token count of each step."""
    from mimo.balance.step import StepBalancer
    from mimo.data import PAD_ID, build_dataset
    from mimo.model.transformer_config import dtype_of
    from mimo.training.step_data import shard_step

    ds, bal = build_dataset(cfg), StepBalancer(cfg)
    G = cfg.training.global_batch_size
    out = []
    for step in range(steps):
        # DP rank 0's microbatches, as the trainer assigns them (one GPU: the whole step).
        shard = bal.assignment([ds.sample(step * G + i) for i in range(G)], PAD_ID).llm[0]
        data = shard_step(cfg, ds, shard, step, runtime.device, dtype_of(cfg.training.precision))
        out.append(([{k: b[k] for k in ("input_ids", "position_ids", "labels", "loss_mask")}
                     | {"attention_mask": b.get("attention_mask")} for b in data.llm_batches],
                    float(data.n_tokens)))
    return out


@contextlib.contextmanager
def _schedule_scope(runtime):
    """CPU smoke only: megatron's schedules (token counter) and gradient-norm code (overflow buffer,
    local l2 norm) make tensors with device="cuda"; inside, those are made on the CPU (mimo.runtime.megatron_cpu's
    namespace for megatron's optimizer module). On CUDA: nothing."""
    if runtime.is_cuda:
        yield
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    from mimo.runtime.megatron_cpu import _cpu_torch

    mods = (schedules, clip_grads, mcore_utils)
    saved = [m.torch for m in mods]
    for m in mods:
        m.torch = _cpu_torch()
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.torch = t


def run_megatron(cfg, runtime, steps: int):
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from mimo.runtime import megatron_scope, optimizer_scope, synchronize

    ddp, optimizer, scheduler, config = build_megatron(cfg, runtime)
    batches = megatron_batches(cfg, runtime, steps)
    tr = cfg.training
    at_start = _peak_mem_reset(runtime.device)
    times, losses = [], []
    for step in range(steps):
        mbs, n_tokens = batches[step]
        M = len(mbs)
        step_loss = []

        def loss_func(loss_mask, output_tensor):
            # Normalised by the step's loss-token count (as mimo does); x M undoes the schedule's / M.
            loss = (output_tensor.float() * loss_mask).sum() / max(n_tokens, 1.0)
            step_loss.append(loss.detach())
            return loss * M, {"lm loss": loss.detach()}

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            return out, partial(loss_func, b["loss_mask"])

        synchronize(runtime)
        t0 = time.perf_counter()
        with optimizer_scope(runtime):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
        with megatron_scope(runtime), optimizer_scope(runtime), _schedule_scope(runtime):
            forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                                           num_microbatches=M, seq_length=cfg.data.seq_length,
                                           micro_batch_size=tr.micro_batch_size, forward_only=False)
        with optimizer_scope(runtime), _schedule_scope(runtime):
            optimizer.step()  # megatron's own grad norm, clip and update
        scheduler.step(increment=1)
        loss = float(torch.stack(step_loss).sum())
        synchronize(runtime)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        log(f"megatron step {step}: loss {loss:.4f}, {times[-1] * 1e3:.1f} ms")
    del ddp, optimizer, scheduler, batches
    return times, losses, at_start


def layer_timing(llm, cfg, device, iters: int) -> dict:
    """One transformer layer of the model alone (its real weights, its dtype, RoPE on): forward and
    backward milliseconds at the step's micro batch and sequence length."""
    from mimo.training.flops import attention_core_flops, is_gated, layer_linear_flops

    lang = cfg.model.language
    s, b, h = cfg.data.seq_length, cfg.training.micro_batch_size, lang.hidden_size
    layer = llm.decoder.layers[0]
    dtype = next(layer.parameters()).dtype
    rope = llm.rotary_pos_emb(s) if getattr(llm, "rotary_pos_emb", None) is not None else None
    x = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)

    def fwd():
        with torch.no_grad():
            layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)

    out_grad = []

    def fwd_bwd():
        out = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        out = out[0] if isinstance(out, tuple) else out
        if not out_grad:
            out_grad.append(torch.randn_like(out))
        out.backward(out_grad[0])

    f_ms = _time_ms(fwd, iters, device)
    fb_ms = _time_ms(fwd_bwd, iters, device)
    for p in layer.parameters():  # the step bench is over; leave no stray gradients behind
        p.grad = None
    a = lang.num_attention_heads
    # mimo.training.flops' counting: matmuls only; backward = 2x forward (input and weight gradients,
    # dQ/dK/dV), causal attention pairs.
    flops = (b * s * layer_linear_flops(h, a, lang.num_query_groups, lang.ffn_hidden_size, is_gated(lang),
                                          lang.kv_channels)
             + attention_core_flops(b * s * (s + 1) // 2, a * (lang.kv_channels or h // a)))
    bwd_ms = fb_ms - f_ms  # null below when timing noise (tiny CPU shapes) makes it non-positive
    return {"micro_batch": b, "seq_length": s, "forward_ms": round(f_ms, 4),
            "backward_ms": round(bwd_ms, 4) if bwd_ms > 0 else None, "forward_tflops": _sig(flops / f_ms / 1e9),
            "backward_tflops": _sig(2 * flops / bwd_ms / 1e9) if bwd_ms > 0 else None, "flops_forward": flops}


def gemm_rates(cfg, device, dtype, iters: int) -> list:
    """Achieved rates of the model's own GEMM shapes (tokens of one microbatch x in -> out)."""
    lang = cfg.model.language
    t = cfg.training.micro_batch_size * cfg.data.seq_length
    h, a, g, f, V = (lang.hidden_size, lang.num_attention_heads, lang.num_query_groups, lang.ffn_hidden_size,
                     lang.vocab_size)
    d = lang.kv_channels or h // a
    fc1 = f * (2 if lang.activation == "swiglu" else 1)
    shapes = [("qkv", h, (a + 2 * g) * d), ("proj", a * d, h), ("fc1", h, fc1), ("fc2", f, h), ("head", h, V)]
    rows = []
    for name, k, n in shapes:
        x = torch.randn(t, k, device=device, dtype=dtype)
        w = torch.randn(k, n, device=device, dtype=dtype)
        ms = _time_ms(lambda: torch.matmul(x, w), iters, device)
        rows.append({"name": name, "m": t, "k": k, "n": n, "ms": round(ms, 4),
                     "tflops": _sig(2 * t * k * n / ms / 1e9)})
        del x, w
    return rows


def profile_step(trainer, step: int, device, top: int) -> list:
    """Top kernels (CUDA) or operators (CPU) of one mimo training step under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        trainer.train_step(step)
        _sync(device)
    totals, calls = {}, {}
    if device.type == "cuda":
        from torch.autograd import DeviceType

        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                us = e.time_range.elapsed_us()
                totals[e.name] = totals.get(e.name, 0.0) + us
                calls[e.name] = calls.get(e.name, 0) + 1
        if not totals:  # no kernel events in this torch's trace: operators by their own device time
            for e in prof.key_averages():
                us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
                if us > 0:
                    totals[e.key], calls[e.key] = us, e.count
    else:
        for e in prof.key_averages():
            totals[e.key] = float(e.self_cpu_time_total)
            calls[e.key] = e.count
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [{"bench": "profile", "kernel": name[:200], "ms": round(us / 1e3, 4), "share": round(us / whole, 4),
             "calls": calls[name], "kind": "cuda_kernel" if device.type == "cuda" else "cpu_op"}
            for name, us in ranked]


def bench_steps(emit, runtime, cfg, model_name: str, steps: int, warmup: int, peak, layer_iters: int, top: int):
    """Both impls, then (on mimo's model) one profiled step, one layer's timing and the GEMM rates."""
    device = runtime.device
    flops = step_flops_of(cfg, steps)
    log(f"step bench: {model_name}, {steps} steps ({warmup} warm-up), {flops[0] / 1e12:.2f} TFLOP per step")
    rows, extra = {}, {}
    # megatron first: its parallel_state (world size 1) and mimo's own groups live side by side.
    try:
        times, losses, at_start = run_megatron(cfg, runtime, steps)
        rows["megatron"] = step_row("megatron", cfg, model_name, times, losses, flops, warmup, device, peak,
                                    {"allocated_at_start_gb": at_start})
    except Exception as exc:
        log(f"megatron step bench failed: {_short(exc)}\n{traceback.format_exc()}")
        rows["megatron"] = {"bench": "step", "impl": "megatron", "model": model_name, "step_ms": None,
                            "tokens_per_s": None, "mfu": None, "peak_memory_gb": None, "error": _short(exc)}
    _free(device)
    trainer = None
    try:
        trainer, times, losses, at_start = run_mimo(cfg, runtime, steps)
        rows["mimo"] = step_row("mimo", cfg, model_name, times, losses, flops, warmup, device, peak,
                                {"allocated_at_start_gb": at_start})
    except Exception as exc:
        log(f"mimo step bench failed: {_short(exc)}\n{traceback.format_exc()}")
        rows["mimo"] = {"bench": "step", "impl": "mimo", "model": model_name, "step_ms": None,
                        "tokens_per_s": None, "mfu": None, "peak_memory_gb": None, "error": _short(exc)}
    m, g = rows["mimo"].get("step_ms"), rows["megatron"].get("step_ms")
    if m and g:
        rows["megatron"]["ratio_mimo_over_megatron"] = round(m / g, 4)
    for impl in ("mimo", "megatron"):
        emit(rows[impl])
    if trainer is not None:
        from mimo.config import LANGUAGE
        from mimo.runtime import megatron_scope

        try:
            if top <= 0:
                raise RuntimeError("skipped (--skip profile)")
            log("profiling one mimo step")
            extra["kernels"] = [emit(r) for r in profile_step(trainer, steps, device, top)]
        except Exception as exc:
            log(f"profile failed: {_short(exc)}")
            extra["kernels_error"] = _short(exc)
        try:
            with megatron_scope(runtime):
                extra["layer"] = layer_timing(trainer.parts[LANGUAGE], cfg, device, layer_iters)
            extra["layer"]["model"] = {
                k: getattr(cfg.model.language, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                           "num_query_groups", "ffn_hidden_size", "vocab_size",
                                                           "attention")}
            log(f"one layer: fwd {extra['layer']['forward_ms']} ms, bwd {extra['layer']['backward_ms']} ms")
        except Exception as exc:
            log(f"layer timing failed: {_short(exc)}")
            extra["layer_error"] = _short(exc)
        del trainer
        _free(device)
    return rows, extra


# ----------------------------------------------------------------------------------------------
# Profile file
# ----------------------------------------------------------------------------------------------

def build_profile(device_name, peak, dtype, gemm, attention_rows, step_rows, extra, attention_impl) -> dict:
    total = sum(2 * r["m"] * r["k"] * r["n"] for r in gemm)
    gemm_tflops = _sig(total / 1e9 / sum(r["ms"] for r in gemm)) if gemm else None
    att = [{k: r.get(k) for k in ("tokens", "mask", "impl", "fwd_tflops", "fwd_bwd_tflops", "bwd_tflops")}
           for r in attention_rows if r.get("fwd_ms") is not None]
    mine = [r for r in att if r["impl"] == attention_impl and r["mask"] == "causal" and r["bwd_tflops"]]
    fwd_rate = statistics.median([r["fwd_tflops"] for r in mine]) if mine else None
    bwd_rate = statistics.median([r["bwd_tflops"] for r in mine]) if mine else None
    memory = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
              if torch.cuda.is_available() else None)
    return {"schema": SCHEMA, "device": device_name, "torch": torch.__version__, "memory_bytes": memory,
            "date": datetime.date.today().isoformat(), "peak_tflops": peak, "dtype": str(dtype).replace("torch.", ""),
            "gemm": gemm, "gemm_tflops": gemm_tflops,
            "gemm_efficiency": round(gemm_tflops / peak, 4) if (peak and gemm_tflops) else None,
            "attention": att, "attention_impl": attention_impl,
            "attention_efficiency": round(fwd_rate / peak, 4) if (peak and fwd_rate) else None,
            "attention_backward_rate": round(bwd_rate / fwd_rate, 4) if (fwd_rate and bwd_rate) else None,
            "layer": extra.get("layer"), "step": step_rows, "kernels": extra.get("kernels", []),
            "errors": {k: v for k, v in extra.items() if k.endswith("_error")}}


def env_row(device, smoke: bool) -> dict:
    """Versions and one large bf16 GEMM rate (8192^3 on a GPU): the context of every other figure."""
    import triton

    import megatron.core

    row = {"bench": "env", "torch": torch.__version__, "triton": triton.__version__,
           "megatron_core": getattr(megatron.core, "__version__", None), "python": sys.version.split()[0]}
    if device.type == "cuda":
        row["cuda"] = torch.version.cuda
        row["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
    n, dtype = (256, torch.float32) if smoke else (8192, torch.bfloat16)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = _time_ms(lambda: a @ b, 1 if smoke else 20, device, warmup=1 if smoke else 3)
    row.update(gemm_n=n, gemm_tflops=_sig(2 * n ** 3 / ms / 1e9))
    del a, b
    # Device memory bandwidth: a copy reads and writes every byte (1 GiB on a GPU).
    nbytes = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 2 if smoke else 20, device, warmup=1 if smoke else 3)
    row["memory_bandwidth"] = _sig(2 * nbytes / (ms / 1e3))  # bytes/s
    return row


def default_profile_path(out) -> str:
    if out:
        stem = out[:-len(".jsonl")] if out.endswith(".jsonl") else os.path.splitext(out)[0]
        return stem + ".profile.json"
    return "gpu_profile.json"


# ----------------------------------------------------------------------------------------------

PARTS = ("attention", "step", "profile")
MASKS = ("causal", "multimodal")


def arg_problems(args) -> list:
    """One line per flag whose value the run could not use ("--flag: why")."""
    out = []
    unknown = [x for x in args.skip.split(",") if x and x not in PARTS]
    if unknown:
        out.append(f"--skip: unknown part(s) {', '.join(unknown)} (parts: {', '.join(PARTS)})")
    masks = args.masks.split(",")
    if not all(masks) or any(m not in MASKS for m in masks):
        out.append(f"--masks {args.masks!r}: expected comma-separated names from {', '.join(MASKS)}")
    from bench_attention import shape_problems

    out += shape_problems(args.seqlens, args.heads, args.kv_heads, args.head_dim, args.attn_iters, "--attn-iters")
    for flag, value in (("--seq-length", args.seq_length), ("--global-batch", args.global_batch),
                        ("--micro-batch", args.micro_batch), ("--steps", args.steps)):
        if value < 1:
            out.append(f"{flag}: must be >= 1, got {value}")
    if not 0 <= args.warmup < args.steps:
        out.append(f"--warmup: must be >= 0 and below --steps ({args.steps}), got {args.warmup}")
    if args.micro_batch >= 1 and args.global_batch % args.micro_batch:
        out.append(f"--global-batch: must be a multiple of --micro-batch ({args.micro_batch}), got "
                   f"{args.global_batch}")
    if not args.budget_s > 0:
        out.append(f"--budget-s: must be > 0, got {args.budget_s}")
    if args.top_kernels < 0:
        out.append(f"--top-kernels: must be >= 0, got {args.top_kernels}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--profile-out", default=None, help="planner profile JSON (default: next to --out)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU, gloo world size 1, fp32, tiny model and attention (Triton interpreter)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: attention,step,profile")
    # Longest first: the acceptance lengths (16k-64k) come before 8k if --budget-s runs out.
    p.add_argument("--seqlens", default="65536,32768,16384,8192")
    p.add_argument("--masks", default="causal,multimodal")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--attn-iters", type=int, default=3)
    p.add_argument("--kernel-config", default=None, metavar="FILE",
                   help="bitfield kernels' launch settings: tools/tune_attention.py --json-out's file, or a "
                        "JSON object of KernelConfig fields (default: KernelConfig's defaults)")
    p.add_argument("--sdpa-max-tokens", type=int, default=16384,
                   help="multimodal sdpa needs a dense s x s mask: not beyond this many tokens")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="training steps per impl (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--llm-attention", default="sdpa", choices=["sdpa", "bitfield"],
                   help="core attention of the step model (both impls)")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--top-kernels", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="attention rows not started within this many seconds of the start are skipped")
    args = p.parse_args(argv)
    problems = arg_problems(args)
    if problems:  # found now, in every mode, not when the attention table starts minutes into a GPU run
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    skip = {s for s in args.skip.split(",") if s}
    from mimo.config.outputs import output_problem

    prof_path = args.profile_out or default_profile_path(args.out)
    for flag, path in (("--out", args.out), ("--profile-out", prof_path)):
        problem = path and output_problem(path, "file")
        if problem:  # found now, not after the run's minutes on the GPU
            where = flag if flag == "--out" or args.profile_out else "--profile-out (default: next to --out)"
            print(f"error: {where}: {problem}", file=sys.stderr)
            return 2

    cuda = torch.cuda.is_available()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if not cuda and not args.cpu_smoke:  # the line goes to --out too: a results file says what was not measured
        Emitter("cpu", args.out)({"cuda": False, "message": (
            "gpu_bench: no CUDA device on this machine; nothing measured (attention kernels, training step, MFU, "
            "kernel profile and planner profile need a GPU). `--cpu-smoke` runs the code paths at tiny sizes.")})
        return 0
    if prof_path:
        os.makedirs(os.path.dirname(os.path.abspath(prof_path)), exist_ok=True)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before mimo.attention is imported
    kernel_cfg = None
    if args.kernel_config:
        try:
            kernel_cfg, tuned = kernel_config_of(args.kernel_config, 16 if args.cpu_smoke else args.head_dim)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        differs = isinstance(tuned, dict) and not args.cpu_smoke and tuned_shape_mismatch(
            tuned, args.heads, args.kv_heads, args.head_dim)
        if differs:
            log(f"warning: --kernel-config {args.kernel_config} was tuned for another attention shape "
                f"({differs}): its settings are run as they are")
    t_start = time.perf_counter()

    from mimo.config import load_config
    from mimo.runtime import init_distributed, select_runtime, setup_megatron
    from mimo.runtime.launch import free_port
    from mimo.training.flops import peak_tflops

    smoke = args.cpu_smoke
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    runtime = select_runtime("cpu" if smoke else "cuda")
    device = runtime.device
    device_name = "cpu" if smoke else torch.cuda.get_device_name()
    peak = None if smoke else peak_tflops(device_name)
    emit = Emitter(device_name, args.out)
    log(f"device {device_name}; peak {peak} TFLOP/s; torch {torch.__version__}")

    attention_rows, step_rows, extra, gemm = [], {}, {}, []
    env = emit(env_row(device, smoke))
    dtype = torch.float32 if smoke else torch.bfloat16

    def write_profile():
        """Written after the step benches and again after the attention table (a run cut short by a
        timeout still leaves the first)."""
        profile = build_profile(device_name, peak, dtype, gemm, attention_rows, step_rows, extra,
                                args.llm_attention)
        profile["memory_bandwidth"] = env.get("memory_bandwidth")  # bytes/s, device-to-device copy
        profile["large_gemm_tflops"] = env.get("gemm_tflops")      # 8192^3 bf16 on a GPU
        with open(prof_path, "w") as f:
            json.dump(profile, f, indent=1)
        log(f"profile written to {prof_path} at {time.perf_counter() - t_start:.0f}s")

    if "step" not in skip:
        init_distributed(runtime, 10.0)
        steps, warmup = (2, 1) if smoke else (args.steps, args.warmup)
        # train_iters: the timed steps + the profiled one (the same LR schedule for both impls).
        raw = (step_config(SMOKE_MODEL, 32, 4, 2, "fp32", not args.no_distributed_optimizer, args.llm_attention,
                           steps + 1)
               if smoke else
               step_config(GPU_MODEL, args.seq_length, args.global_batch, args.micro_batch, "bf16",
                           not args.no_distributed_optimizer, args.llm_attention, steps + 1))
        setup_megatron(runtime, raw["training"]["seed"])
        cfg = load_config(raw)
        lang = cfg.model.language
        model_name = (f"gpt {lang.num_layers}x{lang.hidden_size} heads {lang.num_attention_heads}/"
                      f"{lang.num_query_groups} ffn {lang.ffn_hidden_size} vocab {lang.vocab_size} "
                      f"seq {cfg.data.seq_length} attn {lang.attention}")
        step_rows, extra = bench_steps(emit, runtime, cfg, model_name, steps, warmup, peak,
                                       1 if smoke else 5, 0 if "profile" in skip else args.top_kernels)
        try:
            gemm = gemm_rates(cfg, device, dtype, 1 if smoke else 10)
        except Exception as exc:
            extra["gemm_error"] = _short(exc)
        log(f"steps done at {time.perf_counter() - t_start:.0f}s")
        write_profile()


    if "attention" not in skip:
        deadline = None if smoke else t_start + args.budget_s
        if smoke:
            attention_rows = bench_attention(emit, device, [48], 2, 1, 16, 1, torch.float32,
                                             args.masks.split(","), 1 << 30, tiny=True, cfg=kernel_cfg)
        else:
            attention_rows = bench_attention(emit, device, [int(x) for x in args.seqlens.split(",")], args.heads,
                                             args.kv_heads, args.head_dim, args.attn_iters, dtype,
                                             args.masks.split(","), args.sdpa_max_tokens, deadline=deadline,
                                             cfg=kernel_cfg)
        log(f"attention done at {time.perf_counter() - t_start:.0f}s")
        write_profile()

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
