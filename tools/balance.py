#!/usr/bin/env python
"""Show the data-aware microbatch assignment (`data.balance`) of a sample stream.

    python tools/balance.py --samples FILE.jsonl --policy none|mmscale|entrain --dp D --microbatches M
                            [--micro-batch-size m] [--config FILE.yaml] [--gpu h100]

Reads ``{"id", "text_tokens", "image_tokens"}`` records in order, cuts them
into steps of D*M*m samples (a last partial step is dropped) and prints one
JSON object on stdout: per step, per DP rank, the ids of each encoder and LLM
microbatch in execution order. stderr gets a summary: per-microbatch LLM and
encoder workload CV and, with ``--config`` (whose model and layout the
workload estimate and the simulator use; default: a LLaVA-1.5-like 7B), the
predicted step time. Bad input: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from mimo.balance import POLICIES, Pipeline, WorkloadModel, assign, cv, microbatch_loads  # noqa: E402
from mimo.balance.records import read_records  # noqa: E402
from mimo.planner.api import load_raw, with_hf_architecture  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _model(config: str | None, gpu: str):
    """(workload model, pipeline or None) of --config, or the default 7B model without a layout."""
    if config is None:
        return WorkloadModel.from_model(None, gpu), None
    raw = load_raw(config)
    precision = (raw.get("training") or {}).get("precision", "bf16")
    work = WorkloadModel.from_model(with_hf_architecture(raw).get("model"), gpu, precision)
    par = raw.get("parallelism")
    if not isinstance(par, dict) or "language" not in par:
        raise ValueError(f"{config}: parallelism.language: required for the predicted step time")
    return work, Pipeline.from_parallelism(par, work)


def _unlike_the_trainer(config: str, policy: str, dp: int) -> list:
    """Where this run of the tool is not what the trainer would run with `config`: a --dp other than
    the LLM's, or a policy its config check refuses for that layout (one line each)."""
    from mimo.config import ConfigError, load_config

    raw = load_raw(config)
    notes = []
    llm_dp = ((raw.get("parallelism") or {}).get("language") or {}).get("dp", 1)
    if llm_dp != dp:
        notes.append(f"--dp {dp}, but {config} has parallelism.language.dp {llm_dp}: the trainer deals each "
                     f"step over {llm_dp} DP ranks")
    raw.setdefault("data", {})["balance"] = policy
    try:
        load_config(raw)
    except ConfigError as exc:
        notes += [f"the trainer refuses it: {field}: {why}" for field, why in exc.problems if field == "data.balance"]
    return notes


def main(argv=None) -> int:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", required=True)
    ap.add_argument("--policy", required=True, choices=POLICIES)
    ap.add_argument("--dp", required=True, type=_positive)
    ap.add_argument("--microbatches", required=True, type=_positive)
    ap.add_argument("--micro-batch-size", type=_positive, default=1)
    ap.add_argument("--config", help="mimo config: model for the workload estimate, layout for the simulator")
    ap.add_argument("--gpu", default="h100")
    args = ap.parse_args(argv)
    try:
        work, pipeline = _model(args.config, args.gpu)
        ids, text, image = read_records(args.samples)
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    D, M = args.dp, args.microbatches
    n = D * M * args.micro_batch_size
    enc_all, llm_all = work.from_tokens(text, image)
    steps, llm_cv, enc_cv, times, base = [], [], [], [], []
    for s in range(len(ids) // n):
        enc, llm = enc_all[s * n:(s + 1) * n], llm_all[s * n:(s + 1) * n]
        a = assign(args.policy, enc, llm, D, M, pipeline)
        steps.append({"dp": [{"encoder": [[ids[s * n + i] for i in mb] for mb in a.encoder[d]],
                              "llm": [[ids[s * n + i] for i in mb] for mb in a.llm[d]]} for d in range(D)]})
        llm_cv.append(cv(microbatch_loads(llm, a.llm)))
        enc_cv.append(cv(microbatch_loads(enc, a.encoder)))
        if pipeline is not None:
            times.append(pipeline.step_time(enc, llm, a))
            base.append(pipeline.step_time(enc, llm, assign("none", enc, llm, D, M)))
    print(json.dumps({"steps": steps}))
    for note in _unlike_the_trainer(args.config, args.policy, D) if args.config else []:
        print(f"note: {note}", file=sys.stderr)
    dropped = len(ids) - len(steps) * n
    print(f"balance: policy {args.policy}, {len(steps)} steps of {n} samples ({dropped} dropped), "
          f"dp {D} x {M} microbatches", file=sys.stderr)
    if steps:
        print(f"  per-microbatch workload CV (mean over steps): llm {np.mean(llm_cv):.4f}, "
              f"encoder {np.mean(enc_cv):.4f}", file=sys.stderr)
    if times:
        print(f"  predicted step time (simulator, mean over steps): {np.mean(times):.4f} s "
              f"(policy none: {np.mean(base):.4f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
