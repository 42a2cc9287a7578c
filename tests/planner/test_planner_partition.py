import random
from itertools import combinations

import pytest

from mimo.planner import partition_stages
from mimo.planner.partition import allocate_stages, bottleneck, stage_costs


def _brute_force(costs, stages):
    n = len(costs)
    best = float("inf")
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_matches_brute_force_on_random_costs():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, min(4, n))
        if rng.random() < 0.3:  # many exact ties
            costs = [float(rng.randint(0, 3)) for _ in range(n)]
        else:
            costs = [rng.uniform(0.0, 10.0) for _ in range(n)]
        sizes = partition_stages(costs, stages)
        assert len(sizes) == stages and all(s >= 1 for s in sizes) and sum(sizes) == n
        assert bottleneck(costs, sizes) == pytest.approx(_brute_force(costs, stages), rel=1e-12, abs=1e-12)


def test_uneven_costs_give_uneven_stages():
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    sizes = partition_stages(costs, 2)
    assert stage_costs(costs, sizes) == [5.0, 5.0]
    assert sizes == [1, 5]


def test_rejects_bad_requests():
    with pytest.raises(ValueError):
        partition_stages([1.0, 2.0], 3)
    with pytest.raises(ValueError):
        partition_stages([1.0], 0)
    with pytest.raises(ValueError):
        partition_stages([-1.0, 2.0], 1)


def test_allocate_stages_matches_brute_force():
    rng = random.Random(3)
    for _ in range(50):
        mods = [[rng.uniform(0, 5) for _ in range(rng.randint(1, 5))] for _ in range(2)]
        total = rng.randint(2, sum(len(m) for m in mods))
        got = allocate_stages(mods, total)
        assert sum(len(s) for s in got) == total
        val = max(bottleneck(m, s) for m, s in zip(mods, got))
        best = min(
            max(_brute_force(mods[0], a), _brute_force(mods[1], total - a))
            for a in range(1, total)
            if a <= len(mods[0]) and 1 <= total - a <= len(mods[1])
        )
        assert val == pytest.approx(best, rel=1e-12)
