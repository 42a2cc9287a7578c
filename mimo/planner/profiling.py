"""Macroscopic profiling of a dataset sample (Entrain Algorithm 2).

Per-sample modality workloads vary wildly, but their ratio over a large
enough batch converges. The profiling batch is grown (doubling) until
independent random batches all round to the same discrete GPU split; that
batch size is stable with confidence ``1 - alpha`` and error ``p_error``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from mimo.planner.cost_model import CostModel, Workload
from mimo.planner.costs import frozen_aware_costs
from mimo.planner.spec import ModelSpec

Sample = tuple[int, int, int]  # (text tokens, image count, audio clips)


@dataclass(frozen=True)
class ProfileResult:
    ratio: dict[str, float]          # module -> share of the total work
    batch_size: int                  # minimum stable profiling batch size found
    allocation: tuple[int, ...]      # GPUs per module (language first) at that size
    stable: bool                     # False when max_batch was hit first
    trials: int                      # validation batches per size


class _SampleCoster:
    def __init__(self, spec: ModelSpec, cost_model: CostModel):
        self.spec, self.cm = spec, cost_model
        self._cache: dict[tuple, float] = {}
        self.upstream = any(not e.frozen or (e.projector_kind and not e.projector_frozen)
                            for e in spec.encoders)

    def _module_time(self, name: str, seq: int, items: float) -> float:
        key = (name, seq, items)
        if key not in self._cache:
            m = self.spec.module(name)
            if items <= 0 or seq <= 0:
                self._cache[key] = 0.0
            else:
                costs = self.cm.module_costs(m, 1, 1, 1, Workload(seq, {name: items}),
                                             self.spec.language.hidden_size)
                up = self.upstream if m.is_language else False
                self._cache[key] = sum(frozen_aware_costs(costs, up))
        return self._cache[key]

    def __call__(self, sample: Sample) -> dict[str, float]:
        text, images, clips = sample
        out, llm_tokens = {}, int(text)
        for e in self.spec.encoders:
            count = images if e.kind == "vision" else clips
            out[e.name] = self._module_time(e.name, e.tokens_per_item, count)
            llm_tokens += count * e.llm_tokens_per_item
        out["language"] = self._module_time("language", llm_tokens, 1)
        return out


def workload_ratio(samples: Sequence[Sample], spec: ModelSpec, cost_model: CostModel) -> dict[str, float]:
    """Share of one training step's work that each module carries for these samples."""
    if not samples:
        raise ValueError("no samples to profile")
    coster = _SampleCoster(spec, cost_model)
    return _ratio([coster(s) for s in samples], spec)


def _ratio(per_sample: Sequence[dict[str, float]], spec: ModelSpec) -> dict[str, float]:
    totals = {m.name: 0.0 for m in spec.modules}
    for w in per_sample:
        for k, v in w.items():
            totals[k] += v
    total = sum(totals.values())
    if total <= 0:
        raise ValueError("samples carry no work")
    return {k: v / total for k, v in totals.items()}


def proportional_allocation(ratio: dict[str, float], gpus: int) -> tuple[int, ...]:
    """Largest-remainder rounding of ``gpus`` by share, at least one each."""
    names = list(ratio)
    if gpus < len(names):
        raise ValueError("fewer GPUs than modules")
    spare = gpus - len(names)
    raw = [ratio[n] * spare for n in names]
    alloc = [1 + math.floor(r) for r in raw]
    left = gpus - sum(alloc)
    order = sorted(range(len(names)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order[:left]:
        alloc[i] += 1
    return tuple(alloc)


def stable_profiling_batch(samples: Sequence[Sample], spec: ModelSpec, cost_model: CostModel,
                           gpus: int, dp: int = 1, alpha: float = 0.05, p_error: float = 0.05,
                           initial: int = 8, max_batch: int = 4096, seed: int = 0) -> ProfileResult:
    """Grow the profiling batch until every validation draw gives the same
    per-replica GPU split; return that size and the ratio measured on it."""
    if not samples:
        raise ValueError("no samples to profile")
    if not (0 < alpha < 1 and 0 < p_error < 1):
        raise ValueError("alpha and p_error must lie in (0, 1)")
    per_replica = max(len(spec.modules), gpus // max(1, dp))
    trials = math.ceil(math.log(alpha) / math.log(1 - p_error))
    rng = random.Random(seed)
    coster = _SampleCoster(spec, cost_model)
    costed = [coster(s) for s in samples]

    def draw(n: int) -> dict[str, float]:
        return _ratio([costed[rng.randrange(len(costed))] for _ in range(n)], spec)

    n = max(1, initial)
    while True:
        ref = draw(n)
        alloc = proportional_allocation(ref, per_replica)
        stable = all(proportional_allocation(draw(n), per_replica) == alloc for _ in range(trials))
        if stable or n >= max_batch:
            return ProfileResult(ref, n, alloc, stable, trials)
        n *= 2


def mean_items(samples: Sequence[Sample], spec: ModelSpec) -> dict[str, float]:
    """Average images / clips per sample, per encoder, for the search's workload."""
    n = len(samples)
    out = {}
    for e in spec.encoders:
        idx = 1 if e.kind == "vision" else 2
        out[e.name] = sum(s[idx] for s in samples) / n
    return out
