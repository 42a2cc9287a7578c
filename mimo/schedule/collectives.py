"""Which collectives each action of a step plan makes: the plan's own, and those hidden inside work.

The checker (`check.py`) treats every collective as a *meet*: it completes
once every rank it spans has reached a meet with the same key and ranks. A
`collective` action names its ranks. Three other kinds of action hold
collectives that the plan does not list, because the executor runs each of
them as one call into megatron-core:

* a **forward or backward** of a module stage runs tensor-parallel (and
  sequence-parallel) collectives over the stage's TP group and, for an LLM
  with CP > 1, context-parallel ones over its CP group. TP and CP calls
  interleave inside the one call, so it completes only once every rank of
  the stage's TP x CP block (the ranks that differ from this one in tp and
  cp only) runs the same forward or backward: one meet over that block,
  keyed by module, stage and microbatch, so peers that run two microbatches
  in different orders do not meet.
* an **optimizer** step with the distributed optimizer all-gathers the
  updated parameters over the module's DP x CP group (megatron-core's
  `intra_dist_opt`, which `ModelOptimizer` sets to the module's `dp_cp`
  group; for an encoder CP = 1, so it is the DP group).

The step's gradient sums (`grad_sync ...`, megatron-core's
`finalize_model_grads` at a module's first one) and the global gradient norm
(`grad norm`, a world all-reduce) are `collective` actions already.

The groups come from the plan's layouts (`StepPlan.layouts`), the same
coordinate arithmetic `mimo.topology` checks megatron-core's groups against.
A plan without layouts (hand-made in a test) has only its own collectives.

Not modelled: with `overlap_grad_reduce` the LLM's DDP starts its bucket
reductions (DP x CP) asynchronously during the last backward and waits for
them at its grad-sync action; every DP x CP peer runs its backwards and
reductions in one order, so the plan's grad-sync collective stands for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

from .plan_types import BACKWARD, COLLECTIVE, FORWARD, OPTIMIZER, Action, StepPlan

# Grid dims whose collectives run inside a module's forward and backward.
COMPUTE_DIMS = ("tp", "cp")
# The distributed optimizer's group: the module's data-parallel replicas, CP ranks included.
DIST_OPT_DIMS = ("cp", "dp")


@dataclass(frozen=True)
class Meet:
    """One rendezvous of `action`: completes once every rank in `ranks` is at a meet with this key and ranks."""
    key: Tuple
    ranks: Tuple[int, ...]
    action: Action
    what: str = ""  # the collectives inside the action it stands for ("" for a `collective` action)

    def describe(self) -> str:
        return f"`{self.action.describe()}`" + (f" ({self.what})" if self.what else "")


def meets(plan: StepPlan, a: Action) -> List[Meet]:
    """The meets action `a` makes, in order; none when it never waits for another rank."""
    if a.op == COLLECTIVE:
        return [Meet((COLLECTIVE, a.name), a.ranks, a)]
    if a.op in (FORWARD, BACKWARD):
        return _compute_meets(plan, a)
    if a.op == OPTIMIZER:
        return _optimizer_meets(plan, a)
    return []


def _compute_meets(plan: StepPlan, a: Action) -> List[Meet]:
    """A forward or backward: one meet over its stage's TP x CP block, if that holds more than this rank.
    An MoE LLM's layers also all-to-all / all-gather over its expert groups (expert TP x EP, a second
    decomposition of the stage's ranks, docs/moe.md): the block is then every rank reachable through
    TP x CP and expert TP x EP groups."""
    layout = plan.layouts.get(a.module)
    if layout is None:
        return []
    dims = tuple(d for d in COMPUTE_DIMS if getattr(layout, d) > 1)
    experts = getattr(layout, "ep", 1) > 1 or getattr(layout, "etp", 1) > 1
    if not dims and not experts:
        return []
    ranks = compute_block(layout, a.rank, dims) if experts else group_ranks(layout, a.rank, dims)
    if len(ranks) == 1:
        return []
    what = f"its {' x '.join(dims + (('expert tp x ep',) if experts else ()))} collectives over ranks {list(ranks)}"
    return [Meet((a.op, a.module, a.stage, a.mb), ranks, a, what)]


@lru_cache(maxsize=65536)
def compute_block(layout, rank: int, dims: Tuple[str, ...]) -> Tuple[int, ...]:
    """The ranks tied to `rank` by `dims` groups and expert TP x EP groups, transitively, sorted."""
    block, frontier = {rank}, [rank]
    while frontier:
        r = frontier.pop()
        for g in (layout.group_of(r, list(dims)) if dims else [r], layout.expert_group_of(r, ["etp", "ep"])):
            for x in g:
                if x not in block:
                    block.add(x)
                    frontier.append(x)
    return tuple(sorted(block))


def _optimizer_meets(plan: StepPlan, a: Action) -> List[Meet]:
    """An optimizer step: with the distributed optimizer, one meet over the module's DP x CP group."""
    layout = plan.layouts.get(a.module)
    if not plan.distributed_optimizer or layout is None:
        return []
    ranks = group_ranks(layout, a.rank, DIST_OPT_DIMS)
    if len(ranks) == 1:
        return []
    what = f"the distributed optimizer's parameter all-gather over dp x cp ranks {list(ranks)}"
    return [Meet((OPTIMIZER, a.module), ranks, a, what)]


@lru_cache(maxsize=65536)  # one lookup per (layout, rank, dims); `group_of` scans every group
def group_ranks(layout, rank: int, dims: Tuple[str, ...]) -> Tuple[int, ...]:
    """The ranks of `layout` that differ from `rank` only in `dims`, sorted."""
    return tuple(sorted(layout.group_of(rank, list(dims))))
