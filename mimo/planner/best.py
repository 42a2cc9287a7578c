"""The planner's search as a library: a searcher for a config, and the complete config (the
README's schema) for one of its candidates. `tools/plan.py` prints and writes what these
return; the elastic re-plan (mimo/checkpoint/replan.py) calls them at a restart.
"""

from __future__ import annotations

import copy
import sys

from mimo.planner.api import DEFAULT_GLOBAL_BATCH, positive_int, section, sequence_length, with_hf_architecture
from mimo.planner.emit import TRAINING_DEFAULTS
from mimo.planner.hardware import get_gpu
from mimo.planner.layout_search import LayoutSearch
from mimo.planner.megatron import Work
from mimo.planner.profiling import mean_items
from mimo.planner.spec import read_model


def searcher(raw: dict, gpu: str, samples) -> tuple[LayoutSearch, object]:
    model = with_hf_architecture(raw).get("model")
    spec = read_model(model)
    hw = get_gpu(gpu)
    data, training = section(raw, "data"), section(raw, "training")
    seq = sequence_length(model, data)
    g = positive_int(training.get("global_batch_size", DEFAULT_GLOBAL_BATCH), "training.global_batch_size")
    m = positive_int(training.get("micro_batch_size", 1), "training.micro_batch_size")
    if g % m:
        raise ValueError("training.global_batch_size: not divisible by micro_batch_size")
    precision = training.get("precision", "fp32" if hw.name == "cpu" else "bf16")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"training.precision: expected bf16 or fp32, got {precision!r}")
    # Default on (an MoE LLM's experts are then sharded over expert DP).
    dist_opt = training.get("use_distributed_optimizer", True)
    if not isinstance(dist_opt, bool):
        raise ValueError("training.use_distributed_optimizer: expected true/false")
    fp32_grads = training.get("grad_reduce_in_fp32", True)
    if not isinstance(fp32_grads, bool):
        raise ValueError("training.grad_reduce_in_fp32: expected true/false")
    if not fp32_grads and precision != "bf16":
        raise ValueError(f"training.grad_reduce_in_fp32: false needs precision: bf16 (precision {precision} "
                         "keeps fp32 gradients)")
    items = mean_items(samples, spec) if samples else {e.name: 1.0 for e in spec.encoders}
    for e in spec.encoders:
        if items[e.name] * e.llm_tokens_per_item > seq:
            where = "--samples: on average" if samples else f"model.encoders.{e.name}:"
            raise ValueError(f"{where} {items[e.name]:g} items of {e.name} ({e.llm_tokens_per_item} tokens each) "
                             f"do not fit in data.seq_length {seq}")
    over = [i for i, s in enumerate(samples or ())
            if s[0] + sum(s[1 if e.kind == "vision" else 2] * e.llm_tokens_per_item for e in spec.encoders) > seq]
    kinds = {e.kind for e in spec.encoders}
    for column, kind, what in ((1, "vision", "images"), (2, "audio", "audio clips")):
        foreign = [i for i, s in enumerate(samples or ()) if s[column] and kind not in kinds]
        if foreign:
            # The trainer skips such records (media the model has no encoder for); the plan costs their text only.
            print(f"warning: --samples: {len(foreign)} of {len(samples)} samples (first: {foreign[0]}) hold "
                  f"{what}, but the model has no {kind} encoder; their {what} are not costed", file=sys.stderr)
    if over:
        # The trainer's loaders skip such records; the plan still costs the
        # items they hold, so say so rather than refuse a nearly-right file.
        print(f"warning: --samples: {len(over)} of {len(samples)} samples (first: {over[0]}) hold more text and "
              f"item tokens than data.seq_length {seq}; their items are costed as given", file=sys.stderr)
    return LayoutSearch(spec, hw, Work(seq, items), g, m, precision, dist_opt,
                        grad_reduce_in_fp32=fp32_grads), spec


def planned_config(raw: dict, searcher: LayoutSearch, planned, order) -> dict:
    """A complete config (the README's config schema) for a searched candidate."""
    cfg = {"model": copy.deepcopy(raw["model"])}
    model = cfg["model"]
    if model.get("hf") is None and model["language"].get("hf") is None:
        # A Hugging Face directory sets the length itself (max_position_embeddings).
        model["language"].setdefault("max_sequence_length", searcher.work.seq_length)
    pars = planned.pars
    par = {}
    for name in order:
        p = pars[name]
        entry = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp, "rank_offset": p.rank_offset,
                 "sp": p.sp, "recompute": p.recompute}
        if p.pp > 1 and name == "language":
            # The split that was costed (balanced, or moved to fit memory).
            entry["stage_layers"] = list(planned.estimate.llm_stage_layers)
        elif p.pp > 1:
            samples = searcher.m * pars["language"].dp / p.dp
            entry["stage_layers"] = searcher.model.chain([(searcher.spec.module(name), p, samples)], p.pp).sizes
        par[name] = entry
    cfg["parallelism"] = par
    if par["language"]["cp"] > 1:
        model.setdefault("language", {})["attention"] = "bitfield"  # CP runs on the bitfield kernel only
    data = dict(raw.get("data") or {})
    data.setdefault("kind", "mock")
    data.setdefault("seq_length", searcher.work.seq_length)
    cfg["data"] = data
    training = {**TRAINING_DEFAULTS, **dict(raw.get("training") or {})}
    training["global_batch_size"] = searcher.g
    training["micro_batch_size"] = searcher.m
    if isinstance(training.get("replan_min_ranks"), int) and training["replan_min_ranks"] > planned.estimate.gpus:
        # The floor of the world sizes a re-plan prepares for, below this layout's own size: the config
        # check refuses it, and a job re-planned down to here has gone below it already.
        del training["replan_min_ranks"]
    # What the layout was costed with (the trainer's own defaults are fp32 and no
    # distributed optimizer, the planner's bf16 with it on a GPU).
    training.setdefault("precision", searcher.precision)
    training.setdefault("use_distributed_optimizer", searcher.distributed_optimizer)
    training.setdefault("grad_reduce_in_fp32", searcher.grad_reduce_in_fp32)
    cfg["training"] = training
    return cfg
