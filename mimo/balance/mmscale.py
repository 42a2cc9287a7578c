"""MMScale / DistTrain data-aware reordering within one step.

1. Balance (the paper's intra-microbatch reordering, greedy number
   partitioning): the step's samples are dealt into D*M microbatches of exactly
   m samples, heaviest LLM work first to the lightest microbatch, so every LLM
   microbatch (and so every DP rank) gets near-equal LLM work. The microbatches
   are then dealt to the D ranks, heaviest encoder work first to the rank with
   the least, M per rank: encoder DP ranks get near-equal work too. This is one
   global decision every module derives from the step's data alone.
2. Order (the paper's inter-microbatch reordering for 1F1B): per rank, the
   smallest microbatch first (every stage starts early), the p - 1 smallest
   last (the cool-down bubbles scale with them), the rest largest first (they
   fill the warm-up gap). Where a pipeline is known, the simulator keeps this
   order only if it does not lengthen the replica's step.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .assignment import StepAssignment, _micro_batch_size
from .lpt import dealt
from .pipeline import Pipeline


def bubble_order(sizes: List[float], depth: int) -> List[int]:
    """Microbatch positions -> indices into ``sizes``, by the three rules above."""
    m = len(sizes)
    rank = sorted(range(m), key=lambda k: (sizes[k], k))
    if m <= 2 or depth <= 1:
        return rank[::-1] if depth > 1 else list(range(m))
    first = rank[0]
    tail = rank[1:1 + min(depth - 1, m - 2)]
    middle = rank[1 + len(tail):]
    return [first] + middle[::-1] + tail[::-1]


def mmscale(enc: np.ndarray, llm: np.ndarray, dp: int, microbatches: int,
            pipeline: Optional[Pipeline] = None) -> StepAssignment:
    n = len(llm)
    _micro_batch_size(n, dp, microbatches)  # validates the shape
    bins = dp * microbatches
    of_sample = dealt(llm, bins, tie=enc)
    members = np.argsort(of_sample, kind="stable").reshape(bins, -1)   # row b: bin b's samples
    of_bin = dealt(enc[members].sum(1), dp, tie=llm[members].sum(1))
    rows = np.argsort(of_bin, kind="stable").reshape(dp, -1)          # row d: rank d's bins
    ranks: List[List[List[int]]] = [members[r].tolist() for r in rows]
    depth = pipeline.depth if pipeline is not None else 1
    out = []
    for mbs in ranks:
        sizes = [float(llm[b].sum() + enc[b].sum()) for b in mbs]
        ordered = [mbs[k] for k in bubble_order(sizes, depth)]
        if pipeline is not None and ordered != mbs:
            if (pipeline.replica_time(enc, llm, ordered, ordered).iteration_time
                    > pipeline.replica_time(enc, llm, mbs, mbs).iteration_time):
                ordered = mbs
        out.append(ordered)
    return StepAssignment(out, [[list(mb) for mb in rank] for rank in out])
