"""Entrain's hierarchical microbatch assignment (dissertation Algorithm 4).

1. DP level: samples, heaviest encoder work first, are dealt to the D replicas
   (M*m each; ties in encoder work go by LLM work).
2. Stratified assignment per replica: the M samples of most LLM work form the
   coarse set (about one per microbatch), the rest the fine set; each set,
   heaviest encoder work first, goes min-max greedy onto the M encoder
   microbatches (coarse first). The paper leaves the split open; on the skewed
   benchmark distribution this one beats a median split (6.8x vs 4.9x less LLM
   variability at 8 samples per microbatch). Both sets together are one list
   scheduling run over encoder work, so Graham's (2 - 1/M) bound holds, and
   every microbatch gets fine samples to defer later. Microbatch sizes may
   differ. Samples without encoder work cannot unbalance
   the encoder, so they go where the LLM work is least.
3. Pairwise deferral (`deferral.defer`): each overloaded microbatch runs right
   before its underloaded partner, whose LLM microbatch also runs the deferred
   samples: order ol0, ul0, ol1, ul1, ...
"""

from __future__ import annotations

from typing import List

import numpy as np

from .assignment import StepAssignment, _micro_batch_size
from .deferral import defer
from .lpt import dealt_rounds, greedy


def stratified(enc: np.ndarray, llm: np.ndarray, samples: List[int], microbatches: int) -> List[List[int]]:
    """Encoder microbatches (global sample indices) of one replica."""
    s = np.asarray(samples, dtype=np.int64)
    longest = np.argsort(-llm[s], kind="stable")
    coarse, fine = s[longest[:microbatches]], s[longest[microbatches:]]
    ordered = np.concatenate([part[np.lexsort((-llm[part], -enc[part]))] for part in (coarse, fine)])
    bins = greedy(enc[ordered].tolist(), microbatches, llm[ordered].tolist())
    return [ordered[b].tolist() for b in bins]


def entrain(enc: np.ndarray, llm: np.ndarray, dp: int, microbatches: int, resolution: int = 1024) -> StepAssignment:
    _micro_batch_size(len(llm), dp, microbatches)
    of_sample = dealt_rounds(enc, dp, tie=llm)
    encoder, llm_side = [], []
    for d in range(dp):
        mbs = stratified(enc, llm, np.flatnonzero(of_sample == d).tolist(), microbatches)
        loads = np.array([llm[mb].sum() for mb in mbs])
        pairs, _ = defer(loads, mbs, llm, resolution)
        e_out, l_out = [], []
        for first, partner, moved in pairs:
            keep = set(moved)
            e_out.append(list(mbs[first]))
            l_out.append([i for i in mbs[first] if i not in keep])
            if partner is not None:
                e_out.append(list(mbs[partner]))
                l_out.append(list(mbs[partner]) + moved)
        encoder.append(e_out)
        llm_side.append(l_out)
    return StepAssignment(encoder, llm_side)
