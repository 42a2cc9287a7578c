"""Contiguous pipeline-stage partitioning that minimises the bottleneck stage.

Exact dynamic program over prefix sums: best[s][i] is the smallest possible
maximum stage cost when the first ``i`` layers form ``s`` stages. Among equally
good boundaries the earliest is kept, which moves layers towards later stages;
early 1F1B stages hold more in-flight microbatches, so this is the
memory-friendlier of the optimal answers.
"""

from __future__ import annotations

from itertools import product
from typing import Sequence

_REL_TIE = 1e-12


def _prefix(costs: Sequence[float]) -> list[float]:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + float(c))
    return out


def partition_stages(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage (contiguous, each >= 1) minimising the max stage cost."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError("num_stages must be >= 1")
    if num_stages > n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be non-negative")
    pre = _prefix(costs)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(1, n + 1):
        best[1][i] = pre[i]
    for s in range(2, num_stages + 1):
        for i in range(s, n + 1):
            b, arg = inf, s - 1
            for j in range(s - 1, i):
                v = max(best[s - 1][j], pre[i] - pre[j])
                # strict improvement only, so the earliest optimal boundary wins
                if b == inf or v < b - _REL_TIE * abs(b):
                    b, arg = v, j
            best[s][i], cut[s][i] = b, arg
    sizes = []
    i = n
    for s in range(num_stages, 1, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return sizes[::-1]


def stage_costs(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    out, start = [], 0
    for size in sizes:
        out.append(sum(costs[start:start + size]))
        start += size
    if start != len(costs):
        raise ValueError("stage sizes do not cover every layer")
    return out


def bottleneck(costs: Sequence[float], sizes: Sequence[int]) -> float:
    return max(stage_costs(costs, sizes))


def allocate_stages(module_costs: Sequence[Sequence[float]], total_stages: int) -> list[list[int]]:
    """Split ``total_stages`` among modules in a chain (each module gets its own
    stages, at least one) and partition each, minimising the global bottleneck.
    This is how a fixed pipeline depth is shared between encoders and the LLM."""
    k = len(module_costs)
    if total_stages < k or total_stages > sum(len(c) for c in module_costs):
        raise ValueError("total_stages out of range for these modules")
    cache: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def part(m: int, pp: int) -> tuple[float, list[int]]:
        if (m, pp) not in cache:
            sizes = partition_stages(module_costs[m], pp)
            cache[(m, pp)] = (bottleneck(module_costs[m], sizes), sizes)
        return cache[(m, pp)]

    best_val, best = float("inf"), None
    ranges = [range(1, min(len(c), total_stages) + 1) for c in module_costs]
    for pps in product(*ranges):
        if sum(pps) != total_stages:
            continue
        val = max(part(m, pp)[0] for m, pp in enumerate(pps))
        if val < best_val:
            best_val, best = val, [part(m, pp)[1] for m, pp in enumerate(pps)]
    assert best is not None
    return best
