"""A module under one layout: per-stage times and memory ingredients.

The config's ``stage_layers`` counts transformer layers only, so the
embedding (or patch embed) is folded into the first transformer layer and
the LLM head / encoder projector into the last before partitioning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mimo.planner.cost_model import CostModel, Workload
from mimo.planner.costs import backward_costs, frozen_unaware_costs, output_requires_grad
from mimo.planner.partition import partition_stages
from mimo.planner.spec import ModuleSpec


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    rank_offset: int = 0

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def moved(self, rank_offset: int) -> "Layout":
        return Layout(self.tp, self.cp, self.pp, self.dp, rank_offset)

    def short(self) -> str:
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return f"tp{self.tp}{cp} pp{self.pp} dp{self.dp}"


@dataclass
class ModulePlan:
    module: ModuleSpec
    layout: Layout
    samples_per_microbatch: float
    stage_layers: list[int]
    stage_forward: list[float]
    stage_backward: list[float]
    stage_params: list[float]
    stage_trainable: list[float]
    stage_activation: list[float]
    output_requires_grad: bool
    layer_total: list[float] = field(default_factory=list)  # frozen-aware 1F+1B per layer

    @property
    def stage_total(self) -> list[float]:
        return [f + b for f, b in zip(self.stage_forward, self.stage_backward)]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_total)

    @property
    def trainable_params_per_rank(self) -> float:
        return max(self.stage_trainable)


def _fold(values: Sequence[float], pre: int, post: int) -> list[float]:
    core = list(values[pre:len(values) - post])
    if not core:
        raise ValueError("module has no transformer layers")
    core[0] += sum(values[:pre])
    core[-1] += sum(values[len(values) - post:])
    return core


def _sum_stages(values: Sequence[float], sizes: Sequence[int]) -> list[float]:
    out, i = [], 0
    for s in sizes:
        out.append(sum(values[i:i + s]))
        i += s
    return out


def plan_module(cost_model: CostModel, module: ModuleSpec, layout: Layout, samples: float,
                workload: Workload, upstream_requires_grad: bool = False, *,
                frozen_aware: bool = True, projector_out: int | None = None,
                stage_layers: Sequence[int] | None = None) -> ModulePlan:
    """``frozen_aware=False`` partitions as if every layer were trainable (the
    baseline the papers compare against) but still reports the true times."""
    works = cost_model.module_work(module, layout.tp, layout.cp, samples, workload, projector_out)
    costs = [cost_model.layer_cost(w) for w in works]
    pre = sum(1 for w in works[:1] if w.kind != "transformer")
    post = len(works) - pre - module.num_layers
    fwd = [c.forward for c in costs]
    bwd = backward_costs(costs, upstream_requires_grad)
    per_layer_f = _fold(fwd, pre, post)
    per_layer_b = _fold(bwd, pre, post)
    true_total = [f + b for f, b in zip(per_layer_f, per_layer_b)]
    if stage_layers is None:
        basis = true_total if frozen_aware else _fold(frozen_unaware_costs(costs), pre, post)
        stage_layers = partition_stages(basis, layout.pp)
    stage_layers = list(stage_layers)
    if len(stage_layers) != layout.pp or sum(stage_layers) != module.num_layers:
        raise ValueError(f"{module.name}: stage_layers {stage_layers} do not match pp/num_layers")
    params = _fold([w.params for w in works], pre, post)
    trainable = _fold([0.0 if w.frozen else w.params for w in works], pre, post)
    # Only layers a backward passes through keep activations.
    acts = _fold([w.activation_bytes if b > 0 else 0.0 for w, b in zip(works, bwd)], pre, post)
    return ModulePlan(
        module=module, layout=layout, samples_per_microbatch=samples, stage_layers=stage_layers,
        stage_forward=_sum_stages(per_layer_f, stage_layers),
        stage_backward=_sum_stages(per_layer_b, stage_layers),
        stage_params=_sum_stages(params, stage_layers),
        stage_trainable=_sum_stages(trainable, stage_layers),
        stage_activation=_sum_stages(acts, stage_layers),
        output_requires_grad=output_requires_grad(costs, upstream_requires_grad),
        layer_total=true_total,
    )
