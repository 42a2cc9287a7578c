"""Step-level FP32 parity between layouts of one model (the paper's methodology).

A config is run on as many CPU ranks as its layout needs, in FP32 with the
layout-independent `reference` initialisation; the per-step losses, every
parameter's full gradient before the first update and every parameter after
the last step are gathered and compared with the baseline's.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from mimo.config import ConfigError, MimoConfig, TrainingConfig, load_config
from mimo.runtime import run_on_ranks, select_runtime

from .optimizer import trainable
from .trainer import Trainer

SAME_SECTIONS = ("model", "data", "training")


def parity_overrides(raw: Dict, steps: int) -> Dict:
    """FP32, layout-independent (sharded) init and `steps` iterations: what makes two layouts comparable."""
    raw = copy.deepcopy(raw)
    tr = raw.setdefault("training", {})
    tr.update(precision="fp32", init="sharded", train_iters=steps)
    return raw


def check_comparable(baseline: Dict, candidate: Dict, name: str) -> None:
    """Only `parallelism` may differ; anything else would not be a layout comparison."""
    problems = []
    for section in SAME_SECTIONS:
        if baseline.get(section) != candidate.get(section):
            problems.append((section, f"{name} differs from the baseline here; only parallelism may differ"))
    if problems:
        raise ConfigError(problems)


def record_run(trainer, steps: int) -> Dict:
    """Train `steps` steps; this rank's losses, full gradients of step 0 and full parameters at the end
    (and an MoE LLM's step metrics, `moe`, one dict per step; None otherwise)."""
    from .state import full_state

    tp_groups = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    losses, grads, moe = [], {}, []
    for s in range(steps):
        result = trainer.train_step(s)
        losses.append(result.loss)
        moe.append(result.moe)
        if s == 0:
            grads = step_grads(trainer)
    params = full_state(trainer.parts, tp_groups, layer_offsets=trainer.layer_offsets,
                        experts=expert_shards(trainer))
    return {"losses": losses, "grads": grads, "params": params, "moe": moe}


def expert_shards(trainer) -> Dict:
    """module -> this rank's ExpertShard, for an MoE LLM part (routed experts by global index)."""
    from mimo.config import LANGUAGE
    from mimo.model.reference_init import expert_shard

    if LANGUAGE not in trainer.parts:
        return {}
    shard = expert_shard(trainer.cfg.model.language, trainer.topo.grid(LANGUAGE))
    return {LANGUAGE: shard} if shard is not None else {}


def step_grads(trainer) -> Dict[str, torch.Tensor]:
    """`module.param` -> the full gradient the step just taken reduced over DP (x CP) and stepped with,
    on every rank holding the parameter. Collective over each module's DP x CP and TP groups, modules
    in the same (config) order on every rank."""
    from .state import state_key, tp_group_of, unshard

    optim, out = trainer.optim, {}
    experts = expert_shards(trainer)
    for module, part in trainer.parts.items():
        sharded = optim.cfg.training.use_distributed_optimizer and module in optim.ddp
        reduced = gather_owned_grads(optim, module) if sharded else {}
        tp_group = trainer.topo.grid(module).groups["tp"]
        ex = experts.get(module)
        for name, p in part.named_parameters():
            # megatron-core's DDP accumulates (and reduces) gradients in `main_grad`.
            g = reduced.get(id(p), getattr(p, "main_grad", p.grad))
            if g is not None:
                key = state_key(module, name, p, trainer.layer_offsets.get(module, 0), ex.offset if ex else 0)
                out[key] = unshard(g, p, tp_group_of(name, tp_group, ex)).cpu()
    return out


def gather_owned_grads(optim, module: str) -> Dict[int, torch.Tensor]:
    """id(param) -> the full DP (x CP) reduced gradient, with the distributed optimizer.

    Its DDP reduce-scatters the gradient buffer: a rank's `main_grad` then holds the reduced sum only
    in the flat ranges its optimizer steps (`ModelOptimizer.owned_ranges`) and its own unreduced
    gradient elsewhere. The owners' ranges are disjoint and cover every parameter, so summing them,
    zero elsewhere, over the module's DP x CP group gives what an all-reduce would have. One
    all-reduce of the module part's concatenated gradients; the buffer itself is left as it is."""
    ranges, out = optim.owned_ranges(module), {}
    grid = optim.topo.grid(module)
    # Routed experts of an expert-parallel MoE LLM are reduced and sharded over expert DP instead.
    for key in ("dp_cp", "expt_dp"):
        params = [p for p in trainable(optim.ddp[module].module.parameters())
                  if optim.grad_group(module, p) is grid.groups.get(key)]
        if not params:
            continue
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=optim.runtime.device)
        offset = 0
        for p in params:
            if id(p) in ranges:
                start, end = ranges[id(p)] or (0, p.numel())  # None: all of it
                flat[offset + start:offset + end] = p.main_grad.detach().view(-1)[start:end]
            offset += p.numel()
        dist.all_reduce(flat, group=grid.groups[key])
        out.update({id(p): g.view_as(p) for p, g in zip(params, flat.split([p.numel() for p in params]))})
    return out


def _run_rank(raw: Dict, steps: int):
    return record_run(Trainer(load_config(raw), select_runtime("cpu")), steps)


def run_config(raw: Dict, steps: int, timeout_s: float = 900.0) -> Dict:
    """Train `raw` for `steps` steps on its ranks; the whole model's state, merged over ranks."""
    cfg = load_config(raw)
    results = run_on_ranks(_run_rank, cfg.world_size, raw, steps, timeout_s=timeout_s)
    return merge_ranks(results, placement_of(cfg))


def merge_ranks(results: List[Dict], placement: str = "") -> Dict:
    """One run from every rank's `record_run`: the losses (every rank must report the same) and the
    union of the ranks' gradients and parameters (each rank holds its own module parts); any other
    key is rank 0's."""
    merged = {**results[0], "grads": {}, "params": {}, "world_size": len(results), "placement": placement}
    for r in results:
        if r["losses"] != merged["losses"]:
            raise RuntimeError("ranks disagree on the loss; the run is not consistent")
        merged["grads"].update(r["grads"])
        merged["params"].update(r["params"])
    return merged


def placement_of(cfg: MimoConfig) -> str:
    """`single`, `colocated` or `non-colocated`: a layout with some encoders on the LLM's ranks and
    others on ranks of their own counts as non-colocated (as the planner reports it)."""
    if cfg.world_size == 1:
        return "single"
    from mimo.topology import edges_of

    kinds = {e.placement for e in edges_of(cfg)}
    return "non-colocated" if "non-colocated" in kinds else "colocated"


def _tied_copies(state: Dict[str, torch.Tensor]):
    """(`state` without tied-embedding copies, [(copy, the key of the tensor it copies)])."""
    from .state import TIED_COPY

    main = {k: v for k, v in state.items() if not k.endswith(TIED_COPY)}
    return main, [(v, k[:-len(TIED_COPY)]) for k, v in state.items() if k.endswith(TIED_COPY)]


def max_rel_diff(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|got - ref| / max|ref| (a missing or extra tensor is infinite).

    A tied embedding's last-stage copy (`mimo.training.state.state_key`), in either run, is one
    weight with the embedding: `got`'s copy is compared with `ref`'s embedding too, so a layout
    whose two copies drifted apart differs from a one-stage baseline."""
    got, copies = _tied_copies(got)
    ref, _ = _tied_copies(ref)
    if set(got) != set(ref):
        return float("inf")
    worst = 0.0
    for c, k in copies:
        if k not in ref or c.shape != ref[k].shape:
            return float("inf")
        worst = max(worst, max_rel_diff({k: c}, {k: ref[k]}))
    for k, r in ref.items():
        g = got[k]
        if g.shape != r.shape:
            return float("inf")
        scale = max(float(r.abs().max()), 1e-12) if r.numel() else 1.0
        worst = max(worst, float((g.double() - r.double()).abs().max()) / scale if r.numel() else 0.0)
    return worst


def compare(baseline: Dict, candidate: Dict, rtol: float) -> Dict:
    b, c = torch.tensor(baseline["losses"], dtype=torch.float64), torch.tensor(candidate["losses"], dtype=torch.float64)
    loss_diff = float(((c - b).abs() / b.abs().clamp_min(1e-12)).max())
    grad_diff = max_rel_diff(candidate["grads"], baseline["grads"])
    param_diff = max_rel_diff(candidate["params"], baseline["params"])
    return {
        "world_size": candidate["world_size"],
        "placement": candidate["placement"],
        "loss": candidate["losses"],
        "baseline_loss": baseline["losses"],
        "max_rel_loss_diff": loss_diff,
        "max_rel_grad_diff": grad_diff,
        "max_rel_param_diff": param_diff,
        "ok": max(loss_diff, grad_diff, param_diff) <= rtol,
    }


def adam_eps_hint(baseline_raw: Dict, reports: List[Dict], rtol: float) -> Optional[str]:
    """A line for the user when the only failures are weights after Adam steps with a small eps: Adam
    then moves a weight whose gradient is near 0 by about lr either way, so summation-order rounding
    that the gradients show at 1e-7 can reach 1e-4..1e-3 in the weights (docs/training.md)."""
    tr = baseline_raw.get("training", {})
    optimizer, eps = tr.get("optimizer", TrainingConfig.optimizer), tr.get("adam_eps", TrainingConfig.adam_eps)
    if optimizer != "adam" or float(eps) >= 1e-4:
        return None
    failed = [r for r in reports if not r["ok"]]
    if not failed or any(max(r["max_rel_loss_diff"], r["max_rel_grad_diff"]) > rtol for r in failed):
        return None
    return ("note: losses and gradients agree; only weights after Adam steps differ. With a small adam_eps, Adam "
            "magnifies summation-order rounding in near-zero gradients: set training.adam_eps: 1.0e-3 in the "
            "baseline and every candidate to compare layouts (docs/training.md)")


def parity(baseline_raw: Dict, candidates: List[Dict], names: List[str], steps: int, rtol: float):
    """Yield one report dict per candidate (the baseline runs once)."""
    base = parity_overrides(baseline_raw, steps)
    cands = [parity_overrides(c, steps) for c in candidates]
    for name, c in zip(names, cands):
        check_comparable(base, c, name)
        load_config(c)  # every candidate is valid before anything runs
    ref = run_config(base, steps)
    for name, c in zip(names, cands):
        yield {"candidate": name, **compare(ref, run_config(c, steps), rtol)}
