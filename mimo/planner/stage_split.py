"""Pipeline splits under a per-stage memory limit.

``partition`` cuts a chain of layer costs into ``pp`` contiguous stages with
the smallest possible slowest stage; given ``StageMemory`` and a byte limit,
the smallest slowest stage among the splits whose every stage fits. The step
model (``megatron.py``) uses it for the LLM's pipeline and the homogeneous
baseline (a tuned run's ``decoder_first_pipeline_num_layers``, mimo's
``stage_layers``). The library model (``make_plan``) keeps its exact dynamic
program in ``partition.py``, which has no memory limit.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate


class StageMemory:
    """What pipeline stages hold, for ``partition``: per item, bytes held
    once (``fixed``: weights, gradients, optimizer shard), bytes per
    in-flight microbatch (``per_microbatch``) and bytes live once
    (``transient``, the largest counts); stage ``k`` holds ``in_flight[k]``
    microbatches."""

    def __init__(self, fixed, per_microbatch, transient, in_flight):
        self.fixed = [0.0, *accumulate(fixed)]
        self.act = [0.0, *accumulate(per_microbatch)]
        # Sparse table for the largest transient of a range.
        self.peak = [list(transient)]
        width = 1
        while 2 * width <= len(transient):
            row = self.peak[-1]
            self.peak.append([max(row[i], row[i + width]) for i in range(len(row) - width)])
            width *= 2
        self.in_flight = in_flight

    def held(self, stage: int, i: int, j: int) -> float:
        """Bytes items ``i .. j-1`` hold as stage ``stage``."""
        level = (j - i).bit_length() - 1
        row = self.peak[level]
        transient = max(row[i], row[j - (1 << level)])
        return self.fixed[j] - self.fixed[i] + self.in_flight[stage] * (self.act[j] - self.act[i]) + transient

    def fits(self, stage: int, i: int, j: int, limit: float) -> bool:
        return self.held(stage, i, j) <= limit

    def earliest(self, stage: int, lo: int, j: int, limit: float) -> int | None:
        """The earliest start in ``lo .. j-1`` of a stage ending at ``j``
        that fits (memory grows as the start moves back), or None."""
        if not self.fits(stage, j - 1, j, limit):
            return None
        if self.fits(stage, lo, j, limit):
            return lo
        hi = j - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(stage, mid, j, limit):
                hi = mid
            else:
                lo = mid
        return hi


def partition(costs: list[float], pp: int, memory: StageMemory | None = None,
              limit: float = float("inf")) -> list[int] | None:
    """Contiguous split into ``pp`` non-empty stages with the smallest possible
    slowest stage (optimal to 1e-12 relative); with ``memory``, the smallest
    slowest stage among splits whose every stage holds at most ``limit``
    bytes, or None if none does.
    A greedy sweep from the back (each stage as long as the bound, and the
    memory, allow) decides whether a bound is feasible: both limits only
    tighten as a stage grows, so the sweep finds every stage's earliest
    start. Bisection on the bound, with both ends snapped to values a
    split can take: a feasible sweep lowers the upper end to its own slowest
    stage; a failed one raises the lower end to the smallest stage that
    time alone kept from growing by one layer (no bound below that can
    succeed, since the sweep would cut the same stages). Stages fill from
    the back, leaving the early stages (which hold more 1F1B microbatches)
    the lightest."""
    n = len(costs)
    if pp < 1 or pp > n:
        raise ValueError(f"cannot split {n} layers into {pp} non-empty stages")
    if pp == 1:
        return [n] if memory is None or memory.fits(0, 0, n, limit) else None
    pre = [0.0, *accumulate(costs)]

    def cut(bound: float) -> tuple[list[int] | None, float]:
        """(sizes, slowest stage) when ``bound`` is feasible, else (None, the
        next bound worth trying; infinite when no larger bound helps)."""
        sizes, j, worst, grow = [], n, 0.0, float("inf")
        for s in range(pp, 0, -1):
            # earliest start leaving s - 1 layers before it and one in it
            i = bisect_left(pre, pre[j] - bound, s - 1, j - 1)
            while i < j - 1 and pre[j] - pre[i] > bound:
                i += 1    # rounding: pre[i] >= pre[j] - bound need not mean pre[j] - pre[i] <= bound
            if pre[j] - pre[i] > bound:
                return None, pre[j] - pre[j - 1]
            held = memory is not None and not memory.fits(s - 1, i, j, limit)
            if held:
                i = memory.earliest(s - 1, i, j, limit)
                if i is None:
                    # Its last layer alone does not fit here: only a later
                    # stage that time kept short can change that by growing.
                    return None, grow
            worst = max(worst, pre[j] - pre[i])
            if i > s - 1 and not held:
                # time, not the layers the earlier stages need, kept it short
                grow = min(grow, pre[j] - pre[i - 1])
            sizes.append(j - i)
            j = i
        if j == 0:
            return sizes[::-1], worst
        return None, grow

    peak = max(costs)
    lo = max(peak, pre[n] / pp)
    best, hi = cut(lo + peak if memory is None else pre[n])
    if best is None:
        return None
    mid = lo
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        sizes, value = cut(mid)
        if sizes is None:
            lo = max(lo, mid, min(value, hi))
        else:
            best, hi = sizes, value
        mid = (lo + hi) / 2
    return best
