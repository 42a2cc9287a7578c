"""The planner's GPU constants from a measured profile (`tools/gpu_bench.py`, schema
`mimo.gpu_profile/1`) instead of the datasheet defaults in `hardware.py` (`tools/plan.py --profile`).

From the profile:

* the device name picks the planner's spec (`h100`, `h200`, `a100`, `cpu`) for what a one-GPU bench
  cannot measure: interconnect, latencies, memory size;
* `peak_tflops` (when the bench knew it) replaces the datasheet peak;
* the model's own GEMM rate (`gemm_tflops`) sets `gemm_efficiency`, the causal attention rows of
  the impl the step trained with set `attention_efficiency` and `attention_backward_rate`, the
  measured copy bandwidth sets `memory_bandwidth`. Rates are stored against the profile's dtype:
  an fp32 profile (CPU smoke) is read as the planner's fp32 rate (half its bf16 rate);
* calibration (`calibrate=True`, the default, when the profile has a layer timing): one factor k
  that makes the planner's forward + backward of one transformer layer of the profiled model, at
  the profiled micro batch and sequence length on one GPU, equal the measured one. It scales every
  rate (GEMM, attention, memory) by k and the per-kernel overhead by 1/k, so a one-GPU layer's
  predicted time is exactly the measured one; communication constants are left as the spec has them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

from .hardware import GPUS, GpuSpec, gpu_kind
from .megatron import Par, StepModel, Work
from .spec import read_model

SCHEMA = "mimo.gpu_profile/1"


def load_profile(path: str) -> dict:
    """The profile at `path`; ValueError with one line naming the file on anything else."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc.msg})") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable as JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object written by tools/gpu_bench.py (schema {SCHEMA})")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r} (tools/gpu_bench.py writes it)")
    if not isinstance(data.get("device"), str) or not data["device"].strip():
        raise ValueError(f"{path}: no device name")
    problems = _shape_problems(data)
    if problems:
        raise ValueError(f"{path}: {problems[0]}")
    return data


def _shape_problems(data: dict) -> list:
    """What a profile the planner reads must hold where it holds it (`key: why`, first problem first):
    tools/gpu_bench.py writes it so; a file edited by hand may not."""
    out = []
    if data.get("dtype") not in (None, "bfloat16", "float32"):  # the rates are read against this dtype's peak
        out.append(f"dtype: expected bfloat16 or float32 (what tools/gpu_bench.py measures in), "
                   f"got {data['dtype']!r}")
    for key in ("peak_tflops", "gemm_tflops", "memory_bandwidth", "memory_bytes"):
        if data.get(key) is not None and not _ok(data[key]):
            out.append(f"{key}: expected a positive number, got {data[key]!r}")
    peak, gemm = data.get("peak_tflops"), data.get("gemm_tflops")
    if _ok(peak) and _ok(gemm) and data.get("dtype") in (None, "bfloat16") and gemm > peak:
        out.append(f"gemm_tflops: {gemm} is above the device's peak_tflops ({peak}): not a measured rate")
    att = data.get("attention")
    if att is not None and not (isinstance(att, list) and all(isinstance(r, dict) for r in att)):
        out.append(f"attention: expected a list of rows (JSON objects), got {type(att).__name__}")
    layer = data.get("layer")
    if layer is not None:
        if not isinstance(layer, dict):
            return out + [f"layer: expected a JSON object, got {type(layer).__name__}"]
        if not isinstance(layer.get("model"), dict):
            out.append("layer.model: expected a JSON object (the profiled LLM's fields)")
        for key in ("micro_batch", "seq_length"):
            v = layer.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"layer.{key}: expected a positive integer, got {v!r}")
        for key in ("forward_ms", "backward_ms"):
            if not _ok(layer.get(key)):
                out.append(f"layer.{key}: expected a positive number of milliseconds, got {layer.get(key)!r}")
    step = data.get("step")
    if step is not None and not isinstance(step, dict):
        out.append(f"step: expected a JSON object, got {type(step).__name__}")
    return out


def spec_name(device: str) -> str:
    """The planner's spec of the profiled device (`hardware.gpu_kind`: a whole word of its name, and
    the memory size the name gives, if any, must be the spec's)."""
    kind = gpu_kind(device)
    if kind is None:
        known = ", ".join(f"{k} ({GPUS[k].memory_bytes / 2**30:.0f} GiB)" for k in GPUS if k != "cpu")
        raise ValueError(f"profile device {device!r}: no planner GPU spec for it (known: {known}, cpu); "
                         f"a GPU of another memory size would be planned for memory it does not have")
    return kind


def _rate(value, what: str) -> float | None:
    """A positive finite number from the profile, else None (the spec's default stays)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"profile {what}: expected a positive number, got {value!r}")
    return float(value)


def _attention_rates(profile: dict) -> tuple[float | None, float | None]:
    """Median causal forward and backward TFLOP/s of the impl the step trained with."""
    impl = profile.get("attention_impl")
    rows = [r for r in profile.get("attention") or [] if isinstance(r, dict) and r.get("mask") == "causal"
            and (impl is None or r.get("impl") == impl)]
    fwd = [r["fwd_tflops"] for r in rows if _ok(r.get("fwd_tflops"))]
    bwd = [r["bwd_tflops"] for r in rows if _ok(r.get("bwd_tflops"))]
    return (statistics.median(fwd) if fwd else None), (statistics.median(bwd) if bwd else None)


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def precision_of(profile: dict) -> str:
    return "bf16" if profile.get("dtype") in (None, "bfloat16") else "fp32"


def measured_gpu(profile: dict) -> GpuSpec:
    """The device's spec with the profile's measured rates (no layer calibration)."""
    base = GPUS[spec_name(profile["device"])]
    peak = _rate(profile.get("peak_tflops"), "peak_tflops")
    peak = peak * 1e12 if peak else base.peak_flops
    # The planner runs fp32 GEMMs at half its bf16 rate (megatron.StepModel): store fp32 rates doubled.
    unit = peak * (1.0 if precision_of(profile) == "bf16" else 0.5)
    changes = dict(name=base.name, peak_flops=peak)
    gemm = _rate(profile.get("gemm_tflops"), "gemm_tflops")
    if gemm:
        changes.update(gemm_efficiency=gemm * 1e12 / unit, efficiency=gemm * 1e12 / unit)
    fwd, bwd = _attention_rates(profile)
    if fwd:
        changes["attention_efficiency"] = fwd * 1e12 / unit
        if bwd:
            changes["attention_backward_rate"] = bwd / fwd
    bw = _rate(profile.get("memory_bandwidth"), "memory_bandwidth")
    if bw:
        changes["memory_bandwidth"] = bw
    memory = _rate(profile.get("memory_bytes"), "memory_bytes")
    if memory:  # the device's own size (a name need not give it: "NVIDIA H100 NVL" has 94 GB)
        changes["memory_bytes"] = memory
    return dataclasses.replace(base, **changes)


def layer_model(profile: dict):
    """The profiled LLM (planner spec), micro batch and sequence length of the layer timing; None
    when the profile has no usable layer timing."""
    layer = profile.get("layer")
    if not isinstance(layer, dict) or not isinstance(layer.get("model"), dict):
        return None
    if not (_ok(layer.get("forward_ms")) and _ok(layer.get("backward_ms"))):
        return None
    lang = {k: v for k, v in layer["model"].items() if k != "attention"}
    lang.setdefault("max_sequence_length", layer["seq_length"])
    try:
        spec = read_model({"language": lang, "encoders": {}})
    except ValueError as exc:  # it names the field as a config's: here it is the profile's
        raise ValueError(f"profile layer.model: {exc}") from None
    return spec, int(layer["micro_batch"]), int(layer["seq_length"])


def predicted_layer_ms(gpu: GpuSpec, spec, micro_batch: int, seq: int, precision: str) -> tuple[float, float]:
    """The planner's forward and backward milliseconds of one LLM transformer layer on one GPU."""
    model = StepModel(spec, gpu, Work(seq, {}), micro_batch, micro_batch, precision)
    costs = model.module_layers(spec.language, Par(), micro_batch * seq, seq / 2.0, spec.language.hidden_size)[0]
    layer = costs[1]
    return layer.forward * 1e3, (layer.backward_input + layer.backward_weight) * 1e3


def scaled(gpu: GpuSpec, k: float) -> GpuSpec:
    """Every compute and memory rate x k, the per-kernel overhead / k: a one-GPU layer takes 1/k the time."""
    return dataclasses.replace(gpu, gemm_efficiency=gpu.gemm_efficiency * k, efficiency=gpu.efficiency * k,
                               attention_efficiency=gpu.attention_efficiency * k,
                               memory_bandwidth=gpu.memory_bandwidth * k, kernel_overhead=gpu.kernel_overhead / k)


def profile_gpu(profile: dict, calibrate: bool = True) -> tuple[GpuSpec, dict]:
    """The planner's GpuSpec for a profile, and what was taken from it (`info`: spec, precision,
    the calibration factor and the layer's measured vs predicted milliseconds)."""
    gpu = measured_gpu(profile)
    info = {"device": profile["device"], "spec": gpu.name, "precision": precision_of(profile), "calibration": None}
    found = layer_model(profile) if calibrate else None
    if found is not None:
        spec, mb, seq = found
        f, b = predicted_layer_ms(gpu, spec, mb, seq, info["precision"])
        measured = profile["layer"]["forward_ms"] + profile["layer"]["backward_ms"]
        k = (f + b) / measured
        gpu = scaled(gpu, k)
        info.update(calibration=round(k, 6), layer_measured_ms=measured, layer_predicted_ms=round(f + b, 6))
    return gpu, info


def step_check(profile: dict, calibrate: bool = True) -> dict:
    """The planner's one-GPU step for the model the profile's mimo step trained (text-only LLM, TP1
    DP1, the bench's batch and precision) next to the measured one: the acceptance "predicted within
    15% of measured" (issue #40). The layer calibration fits one layer; the rest of the step
    (embedding, head, cross entropy, optimizer, the other layers' schedule) is the planner's own."""
    from .best import searcher  # late: best imports most of the planner

    step = (profile.get("step") or {}).get("mimo")
    layer = profile.get("layer")
    if not isinstance(step, dict) or not _ok(step.get("step_ms")) or not isinstance(layer, dict) \
            or not isinstance(layer.get("model"), dict):
        raise ValueError("profile: no measured mimo step with its model (run tools/gpu_bench.py without --skip step)")
    gpu, info = profile_gpu(profile, calibrate)
    lang = {k: v for k, v in layer["model"].items() if k != "attention"}
    lang["max_sequence_length"] = max(lang.get("max_sequence_length", 0), step["seq_length"])
    raw = {"model": {"language": lang, "encoders": {}}, "parallelism": {"language": {}},
           "data": {"seq_length": step["seq_length"]},
           "training": {"global_batch_size": step["global_batch"], "micro_batch_size": step["micro_batch"],
                        "precision": step.get("precision", "bf16"),
                        "use_distributed_optimizer": bool(step.get("distributed_optimizer", True))}}
    search, _ = searcher(raw, gpu, None)
    predicted = search.evaluate({"language": Par()}).step_time * 1e3
    measured = float(step["step_ms"])
    return {**info, "predicted_step_ms": round(predicted, 4), "measured_step_ms": measured,
            **agreement(predicted, measured)}


def agreement(predicted: float, measured: float) -> dict:
    """The acceptance of issue #40: the planner's step within 15% of the measured one."""
    return {"ratio": round(predicted / measured, 4), "within_15_percent": abs(predicted / measured - 1) <= 0.15}


def measured_run(path: str, warmup: int) -> dict:
    """A training run's `--log-json` file (examples/pretrain_mimo.py: one JSON object per step with
    `step`, `step_time_s` and `mfu`) over the steps after the first `warmup`: the median step time
    (s), how many steps that is, and the median MFU (None where the run knew no peak). A step
    logged twice (a resumed run) counts with its last row; a last line cut short (no newline: a run
    killed while writing it, as a time limit does) is left out."""
    rows = {}
    try:
        with open(path) as fh:
            lines = fh.readlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, t = row["step"], float(row["step_time_s"])
            except (json.JSONDecodeError, TypeError, KeyError, ValueError, RecursionError) as exc:
                if n == len(lines) and not line.endswith("\n") and isinstance(exc, json.JSONDecodeError):
                    break
                raise ValueError(f"{path}:{n}: not a step row of --log-json (JSON with step and step_time_s)") \
                    from None
            if isinstance(step, bool) or not isinstance(step, int) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"{path}:{n}: step {step!r} with step_time_s {t!r}")
            rows[step] = (t, row.get("mfu"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    kept = [rows[s] for s in sorted(rows)[warmup:]]
    if not kept:
        raise ValueError(f"{path}: {len(rows)} steps logged, none after the {warmup} warm-up steps (--warmup)")
    mfu = [m for _, m in kept if _ok(m)]
    return {"step_time_s": statistics.median(t for t, _ in kept), "steps": len(kept),
            "mfu": statistics.median(mfu) if len(mfu) == len(kept) else None}


def main(argv=None) -> int:
    """`python -m mimo.planner.profile PROFILE.json [--no-calibrate]`: one JSON line, step_check's."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description=step_check.__doc__)
    p.add_argument("profile")
    p.add_argument("--no-calibrate", action="store_true")
    args = p.parse_args(argv)
    try:
        print(json.dumps(step_check(load_profile(args.profile), not args.no_calibrate)))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
