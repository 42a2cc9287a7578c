#!/usr/bin/env python
"""Plan per-module layouts for a mimo model on N GPUs, or cost a given layout.

    python tools/plan.py --config MODEL.yaml --gpus N [--gpu h100] [--samples S.json] [--json] [--top K] [--out FILE]
    python tools/plan.py --config FILE.yaml --evaluate [--homogeneous] [--gpu h100] [--samples S.json] [--json]
    ... --profile gpu_profile.json [--no-calibrate]   # measured rates from tools/gpu_bench.py instead of --gpu's
    ... --evaluate --measured steps.jsonl [--warmup 3]  # next to a measured run of this config (--log-json)

Search: prints the best candidate layouts (homogeneous, colocated,
non-colocated; SP and recompute chosen per module), then a complete config
for the best one; ``--json`` prints one JSON object instead (its keys are listed in
docs/planner.md). Evaluate: costs the config's own layout
(``--homogeneous``: the Megatron baseline built from ``parallelism.language``).
Bad input: one ``error:`` line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.config import ConfigError, apply_overrides, load_config  # noqa: E402
from mimo.config.schema import DATA_KINDS, TrainingConfig  # noqa: E402
from mimo.planner.api import load_raw, positive_int, section  # noqa: E402
from mimo.planner.best import planned_config as _config, searcher as _searcher  # noqa: E402
from mimo.planner.emit import to_yaml  # noqa: E402
from mimo.planner.hardware import get_gpu  # noqa: E402
from mimo.planner.layout_search import GB, LayoutSearch  # noqa: E402
from mimo.planner.megatron import RECOMPUTE, Par  # noqa: E402
from mimo.planner.profile import agreement, load_profile, measured_run, profile_gpu  # noqa: E402

# A calibration factor beyond this either way means a layer timing the planner's model cannot be off
# by (its datasheet rates and the measured ones differ by far less): most likely a broken profile.
CALIBRATION_SANE = 20
from mimo.planner.spec import MAX_SIZE  # noqa: E402

# What plan.py reads of a parallelism entry (stage_layers only with --evaluate);
# the trainer's other keys must hold their defaults for the cost to mean anything.
PARALLEL_KEYS = ("tp", "cp", "pp", "dp", "ep", "etp", "sp", "recompute", "rank_offset", "stage_layers")
# Step times this close to the best are ties for the model: one effect it
# leaves out (a DP ring's bandwidth per node, docs/planner.md) moves such
# gaps by up to 4.6%.
TIE = 0.05


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the CLI contract asks
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _load_samples(path: str):
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"--samples: {path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except json.JSONDecodeError as exc:  # e.g. tools/balance.py's JSONL records
        raise ValueError(f"{path}: invalid JSON ({exc.msg}); expected one JSON list of [text_tokens, images, "
                         "audio_clips]") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable as JSON ({type(exc).__name__})") from None
    if not isinstance(data, list) or not data or not all(
            isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                        and 0 <= x <= MAX_SIZE for x in s)
            for s in data):
        raise ValueError(f"{path}: expected a non-empty JSON list of [text_tokens, images, audio_clips]")
    return [tuple(s) for s in data]


def _read_pars(raw: dict, spec, homogeneous: bool) -> dict[str, Par]:
    entries = raw.get("parallelism")
    if not isinstance(entries, dict):
        raise ValueError("parallelism: required for --evaluate")
    names = [m.name for m in spec.modules]
    for name in entries:
        if name not in names:
            raise ValueError(f"parallelism.{name}: not a module of the model ({', '.join(names)})")
    out = {}
    for mod in spec.modules:
        entry = entries.get(mod.name, {} if (homogeneous and not mod.is_language) else None)
        path = f"parallelism.{mod.name}"
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: required")
        for key in entry:
            if key not in PARALLEL_KEYS:
                raise ValueError(f"{path}.{key}: unknown key (known: {', '.join(PARALLEL_KEYS)})")
        vals = {k: positive_int(entry.get(k, 1), f"{path}.{k}") for k in ("tp", "cp", "pp", "dp", "ep", "etp")}
        off = entry.get("rank_offset", 0)
        if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off <= MAX_SIZE:
            raise ValueError(f"{path}.rank_offset: expected a non-negative integer, got {off!r}")
        sp = entry.get("sp", False)
        if not isinstance(sp, bool):
            raise ValueError(f"{path}.sp: expected true/false, got {sp!r}")
        rec = entry.get("recompute", "none")
        if rec not in RECOMPUTE:
            raise ValueError(f"{path}.recompute: expected one of {', '.join(RECOMPUTE)}, got {rec!r}")
        out[mod.name] = Par(vals["tp"], vals["cp"], vals["pp"], vals["dp"], sp, rec, off,
                            _stage_layers(entry.get("stage_layers"), vals["pp"], mod, path),
                            ep=vals["ep"], etp=vals["etp"])
    return out


def _stage_layers(value, pp: int, mod, path: str) -> tuple[int, ...]:
    """The config's uneven pipeline split, checked as the config check does."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{path}.stage_layers: expected a list of integers, got {value!r}")
    if len(value) != pp:
        raise ValueError(f"{path}.stage_layers: needs one entry per pipeline stage (pp = {pp}), got {len(value)}")
    if min(value) < 1:
        raise ValueError(f"{path}.stage_layers: every stage needs at least one layer")
    if sum(value) != mod.num_layers:
        raise ValueError(f"{path}.stage_layers: must sum to num_layers ({mod.num_layers}), got {sum(value)}")
    return tuple(value)


def _split_hint(searcher: LayoutSearch, pars: dict, homogeneous: bool) -> str:
    """Where moving LLM layers to later pipeline stages would make the layout
    fit, the split to write (the search writes such splits itself)."""
    lp = pars["language"]
    if homogeneous or lp.pp == 1 or lp.stage_layers:
        return ""
    fitted = searcher.evaluate(pars, fit_memory=True)
    if fitted.peak_memory > searcher.limit:
        return ""
    return (f"; parallelism.language.stage_layers: {list(fitted.llm_stage_layers)} would fit "
            f"(peak {_gb(fitted.peak_memory)} GB, step {fitted.step_time:.3f} s)")


def _short(p: Par, split: tuple[int, ...] = ()) -> str:
    extra = (" sp" if p.sp else "") + (f" rc-{p.recompute}" if p.recompute != "none" else "")
    layers = f" [{','.join(map(str, split))}]" if split else ""
    experts = f" ep{p.ep}" + (f" etp{p.etp}" if p.etp > 1 else "") if p.ep > 1 or p.etp > 1 else ""
    return f"tp{p.tp} cp{p.cp} pp{p.pp}{layers} dp{p.dp}{experts}{extra}"


def _gb(nbytes: float) -> str:
    """Memory in GB: one decimal from 1 GB up, three below (a CPU demo model would read 0.0)."""
    gb = nbytes / GB
    return f"{gb:.1f}" if gb >= 1 else f"{gb:.3f}"


def _layout(c, order) -> str:
    """One table cell: each module's ranks and layout (the LLM's split where
    it was moved to fit memory)."""
    return " | ".join(f"{n}[{c.pars[n].rank_offset}:{c.pars[n].rank_offset + c.pars[n].size}] "
                      f"{_short(c.pars[n], c.llm_split if n == 'language' else ())}" for n in order)


# The training settings a layout is costed with whose defaults differ between the trainer (fp32, no
# distributed optimizer) and the planner (on a GPU: bf16, the distributed optimizer on).
_TRAINER = {f.name: f.default for f in dataclasses.fields(TrainingConfig)
            if f.name in ("precision", "use_distributed_optimizer", "grad_reduce_in_fp32")}


def _trainer_settings(raw: dict, training: dict, evaluate: bool) -> list:
    """The settings of `_TRAINER` the planner fills with its own defaults (named by `_notes`).

    A search from a config the trainer runs (it has a `parallelism` section: the re-plan by hand of
    docs/checkpoints.md) takes the trainer's defaults for what the config leaves out, so the layout is
    costed and written with what the run trains with: resuming on the written config must not switch
    an fp32 run to bf16. A model file, and `--evaluate` (which costs layouts the way the search
    ranked them), take the planner's."""
    if isinstance(raw.get("parallelism"), dict) and not evaluate:
        for key, value in _TRAINER.items():
            training.setdefault(key, value)
        return []
    return [key for key in _TRAINER if key not in training]


def _notes(filled: list, searcher: LayoutSearch, evaluate: bool) -> None:
    """One stderr line per setting the planner chose where the trainer would choose another."""
    used = {"precision": searcher.precision, "use_distributed_optimizer": searcher.distributed_optimizer,
            "grad_reduce_in_fp32": searcher.grad_reduce_in_fp32}
    for key in filled:
        if used[key] != _TRAINER[key]:
            print(f"note: training.{key} is not in --config: {'costed' if evaluate else 'planned and written'} "
                  f"as {json.dumps(used[key])} (the trainer's default is {json.dumps(_TRAINER[key])}); set it "
                  "there to plan for another", file=sys.stderr)


def main(argv=None) -> int:
    p = _Parser(description=__doc__.splitlines()[1])
    p.add_argument("--config", required=True, help="model YAML (parallelism needed only for --evaluate)")
    p.add_argument("--gpus", type=int, help="GPU budget (search)")
    p.add_argument("--gpu", help="h100 | h200 | a100 | cpu (default h100; with --profile, the profile's device)")
    p.add_argument("--profile", help="a measured profile from tools/gpu_bench.py (schema mimo.gpu_profile/1): "
                                     "its device and rates replace --gpu's defaults")
    p.add_argument("--no-calibrate", action="store_true",
                   help="with --profile: measured rates only, no per-layer calibration")
    p.add_argument("--samples", help="JSON list of [text_tokens, images, audio_clips] per sample")
    p.add_argument("--evaluate", action="store_true", help="cost the config's own layout")
    p.add_argument("--homogeneous", action="store_true", help="with --evaluate: Megatron's homogeneous baseline")
    p.add_argument("--measured", help="with --evaluate: the --log-json file of a run of this config; its median "
                                      "step time is set next to the prediction")
    p.add_argument("--warmup", type=int, default=None, help="with --measured: first steps left out (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--top", type=int, default=5, help="candidates to list / emit in JSON")
    p.add_argument("--out", help="write the best config here (search)")
    p.add_argument("--global-batch", type=int, help="override training.global_batch_size")
    p.add_argument("--micro-batch", type=int, help="override training.micro_batch_size")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, as for examples/pretrain_mimo.py (repeatable)")
    args = p.parse_args(argv)
    try:
        if args.top < 1:
            raise ValueError("--top: must be >= 1")
        if args.homogeneous and not args.evaluate:
            raise ValueError("--homogeneous: only with --evaluate")
        if args.measured is not None and not args.evaluate:
            raise ValueError("--measured: only with --evaluate")
        if args.warmup is not None and args.measured is None:
            raise ValueError("--warmup: only with --measured")
        args.warmup = 3 if args.warmup is None else args.warmup
        if args.warmup < 0:
            raise ValueError(f"--warmup: expected a non-negative integer, got {args.warmup}")
        if args.out is not None and args.evaluate:
            raise ValueError("--out: only with a search (--evaluate costs the config as it is)")
        if not args.evaluate and args.gpus is None:
            raise ValueError("--gpus: required unless --evaluate")
        if args.gpus is not None and args.gpus < 1:
            raise ValueError(f"--gpus: expected a positive integer, got {args.gpus}")
        if args.gpu is not None and args.profile is not None:
            raise ValueError("--gpu: not with --profile (the profile names the device and its rates)")
        args.gpu = args.gpu or "h100"
        try:
            get_gpu(args.gpu)
        except ValueError as exc:
            raise ValueError(f"--gpu: {exc}") from None
        if args.out is not None and not args.out.strip():
            raise ValueError("--out: empty path")
        if args.out:
            from mimo.config.outputs import output_problem

            problem = output_problem(args.out, "file")
            if problem:  # found before the search, not after it
                raise ValueError(f"--out: {problem}")
        raw = apply_overrides(load_raw(args.config), args.set)
        training = section(raw, "training")
        if args.global_batch is not None:
            training["global_batch_size"] = args.global_batch
        if args.micro_batch is not None:
            training["micro_batch_size"] = args.micro_batch
        raw["training"] = training
        filled = _trainer_settings(raw, training, args.evaluate)
        samples = _load_samples(args.samples) if args.samples else None
        gpu = args.gpu
        if args.no_calibrate and args.profile is None:
            raise ValueError("--no-calibrate: only with --profile")
        if args.profile is not None:
            gpu, used = profile_gpu(load_profile(args.profile), calibrate=not args.no_calibrate)
            args.gpu = f"{gpu.name} (profile)"
            cal = f", layer calibration x{used['calibration']:.4g}" if used["calibration"] is not None else ""
            print(f"# profile {args.profile}: {used['device']} as {gpu.name}, measured rates{cal}", file=sys.stderr)
            k = used["calibration"]
            if k is not None and not 1 / CALIBRATION_SANE <= k <= CALIBRATION_SANE:
                print(f"warning: --profile: the measured layer time is {k:.3g}x the planner's model of it (more "
                      f"than {CALIBRATION_SANE}x either way): check layer.forward_ms / layer.backward_ms, or use "
                      "--no-calibrate", file=sys.stderr)
        searcher, spec = _searcher(raw, gpu, samples)
        order = [m.name for m in spec.modules]
        if args.evaluate:
            pars = _read_pars(raw, spec, args.homogeneous)
            est = searcher.evaluate(pars, homogeneous=args.homogeneous)
            if args.gpus is not None and est.gpus != args.gpus:
                # The trainer refuses ranks that belong to no module, too.
                raise ValueError(f"parallelism: the layout uses {est.gpus} GPUs, not --gpus {args.gpus}")
            out = {"placement": est.placement, "gpus": est.gpus, "step_time_s": round(est.step_time, 6),
                   "peak_memory_gb": round(est.peak_memory / GB, 3), "tokens_per_s": round(est.tokens_per_s, 1),
                   "modules": {n: {"peak_memory_gb": round(est.modules[n] / GB, 3)} for n in order}}
            if args.measured is not None:
                run = measured_run(args.measured, args.warmup)
                out.update(measured_step_time_s=round(run["step_time_s"], 6), measured_steps=run["steps"],
                           measured_mfu=run["mfu"], **agreement(est.step_time, run["step_time_s"]))
            if args.json:
                print(json.dumps(out))
            else:
                print(f"{est.placement} on {est.gpus} x {args.gpu}: step {est.step_time:.3f} s, "
                      f"{est.tokens_per_s:,.0f} tokens/s, peak {_gb(est.peak_memory)} GB per GPU")
                if args.measured is not None:
                    mfu = "" if run["mfu"] is None else f", MFU {100 * run['mfu']:.1f}%"
                    print(f"measured: step {out['measured_step_time_s']:.3f} s{mfu} (median of {run['steps']} steps "
                          f"after {args.warmup} warm-up); predicted / measured {out['ratio']:.3f}"
                          f"{'' if out['within_15_percent'] else ' (more than 15% apart)'}")
            limit = searcher.limit
            if est.peak_memory > limit:
                # Costed all the same (a layout may be compared with one that
                # fits), but the user must not read it as runnable.
                print(f"warning: predicted peak {_gb(est.peak_memory)} GB per GPU exceeds the "
                      f"{limit / GB:.1f} GB of a {args.gpu}{_split_hint(searcher, pars, args.homogeneous)}",
                      file=sys.stderr)
            _notes(filled, searcher, True)
            return 0
        t0 = time.perf_counter()
        found = searcher.search(args.gpus)
        search_time = time.perf_counter() - t0
        # Megatron's homogeneous baseline (encoders inside the LLM's first
        # stage) is costed for comparison; a mimo config cannot express it.
        chosen = next((i for i, c in enumerate(found) if c.estimate.placement != "homogeneous"), None)
        if chosen is None:
            raise ValueError(f"only Megatron's homogeneous layout fits on {args.gpus} x {args.gpu} "
                             f"(best: {_layout(found[0], order)}); a mimo config cannot express it: "
                             "more GPUs, a smaller batch or recompute may help")
        cfg = _config(raw, searcher, found[chosen], order)
        # The emitted config must pass `mimo.config check`. Its data files and
        # tokenizer may live on the cluster only, so they are checked there.
        if cfg["data"]["kind"] not in DATA_KINDS:
            raise ValueError(f"data.kind: expected one of {', '.join(DATA_KINDS)}, got {cfg['data']['kind']!r}")
        check = copy.deepcopy(cfg)
        check["data"] = {"kind": "mock", "seq_length": searcher.work.seq_length}
        try:
            load_config(check)
        except ConfigError as exc:
            field, reason = exc.problems[0]
            raise ValueError(f"the planned config fails the config check: {field}: {reason}") from None
        text = to_yaml(cfg)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                fh.write(text)
    except ConfigError as exc:  # its lines start with `error:`
        print(str(exc), file=sys.stderr)
        return 2
    except (ValueError, OSError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg}", file=sys.stderr)
        return 2
    _notes(filled, searcher, False)
    if args.json:
        print(json.dumps({"gpus": args.gpus, "gpu": args.gpu, "search_time_s": round(search_time, 4),
                          "candidates": [c.as_dict(order) for c in found[:args.top]]}))
        return 0
    print(f"# {len(found)} layouts costed for {args.gpus} x {args.gpu} in {search_time:.2f} s, global batch "
          f"{searcher.g}, micro batch {searcher.m}, seq {searcher.work.seq_length}")
    dp_cap = searcher.g // searcher.m
    if dp_cap < args.gpus:
        # Why a small batch picks CP or PP: the batch, not the model, rules out more DP.
        print(f"# the batch allows LLM DP <= {dp_cap}: an LLM on all {args.gpus} GPUs has "
              f"TP x CP x PP >= {-(-args.gpus // dp_cap)}")
    best = found[0].estimate.step_time
    ties = sum(c.estimate.step_time <= best * (1 + TIE) for c in found[1:])
    if ties:
        print(f"# {ties} other layout{'s' if ties > 1 else ''} within {TIE:.0%} of the best step time: "
              f"too close for the model to rank; measure before choosing")
    print(f"# {'#':>2}  {'placement':<13}  {'step s':>8}  {'tokens/s':>11}  {'mem GB':>6}  layout")
    for i, c in enumerate(found[:args.top], 1):
        e = c.estimate
        print(f"  {i:>2}  {e.placement:<13}  {e.step_time:8.3f}  {e.tokens_per_s:11,.0f}  "
              f"{_gb(e.peak_memory):>6}  {_layout(c, order)}")
    print()
    which = "" if chosen == 0 else (f": candidate #{chosen + 1}, the best a mimo config can express "
                                    "(#1 is Megatron's homogeneous baseline)")
    print(f"# best config{which}" + (f" (written to {args.out})" if args.out else ""))
    print(text, end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
