"""Boundary windows of one step: which items cross an encoder -> LLM edge in one call, and who holds them.

A non-colocated edge moves one LLM microbatch per call (a window of
micro_batch_size x LLM dp samples); a colocated edge moves the whole step at
once, in LLM-major order, so that LLM DP shard j receives its own
microbatches back to back. Inside a window the items are divided over the
encoder's DP ranks by tokens (`divide_items`, encoder data parallelism over
items) and go to the LLM DP shard that holds their sample. Every rank derives
the same windows from the step's item counts alone, so no plan travels.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from mimo.config import LANGUAGE, MimoConfig
from mimo.data import shard_indices
from mimo.data.items import divide_items, sample_item_bounds


def microbatch_offsets(counts: torch.Tensor, samples_per_microbatch: int) -> List[int]:
    """Token offsets of consecutive microbatches in a packed shard, from per-sample token counts."""
    per_mb = counts.reshape(-1, samples_per_microbatch).sum(dim=1).tolist()
    out = [0]
    for c in per_mb:
        out.append(out[-1] + int(c))
    return out


class StepWindows:
    """The boundary windows of one step.

    `item_counts[name]`: items of each step sample (host list); `order`: step sample index at each
    trainer position (data balancing reorders the step; None: identity); `comms[name].plan`: the
    edge's static plan, specialised per window.
    """

    def __init__(self, cfg: MimoConfig, comms: Dict, item_counts: Dict[str, List[int]], colocated: List[str],
                 order: Optional[List[int]]):
        self.cfg, self.comms, self.item_counts, self.colocated, self.order = cfg, comms, item_counts, colocated, order
        self._cache: Dict[Tuple[str, int], Tuple[object, List[int]]] = {}

    def placed(self, positions: List[int]) -> List[int]:
        """Step sample indices at trainer positions."""
        return positions if self.order is None else [self.order[p] for p in positions]

    def llm_indices(self, dp_rank: int) -> List[List[int]]:
        """Step sample indices of each microbatch of LLM DP shard `dp_rank`."""
        tr, dL = self.cfg.training, self.cfg.parallelism[LANGUAGE].dp
        return [self.placed(mb) for mb in shard_indices(tr.global_batch_size, tr.micro_batch_size, dp_rank, dL)]

    def _samples(self, name: str, mb: int) -> List[int]:
        """The window's samples in the order the LLM DP shards hold them (shard-major)."""
        tr, dL = self.cfg.training, self.cfg.parallelism[LANGUAGE].dp
        if name in self.colocated:
            return [i for j in range(dL) for m in self.llm_indices(j) for i in m]
        W = tr.micro_batch_size * dL
        return self.placed(list(range(mb * W, (mb + 1) * W)))

    def window(self, name: str, mb: int = 0) -> Tuple[object, List[int]]:
        """(the edge's plan of this window, step item ids in window order); colocated edges: mb is 0."""
        key = (name, mb)
        if key not in self._cache:
            counts = self.item_counts[name]
            first = [0]
            for c in counts:
                first.append(first[-1] + int(c))
            samples = self._samples(name, mb)
            ids = [first[s] + k for s in samples for k in range(int(counts[s]))]
            dE, dL = self.cfg.parallelism[name].dp, self.cfg.parallelism[LANGUAGE].dp
            per_shard = len(samples) // dL
            src = divide_items([self.cfg.model.encoders[name].tokens_per_item] * len(ids), dE)
            dst = sample_item_bounds([counts[s] for s in samples], [j * per_shard for j in range(dL + 1)])
            self._cache[key] = (self.comms[name].plan.for_window(src, dst), ids)
        return self._cache[key]

    def encoder_item_ids(self, name: str, dp_rank: int, mb: int = 0) -> List[int]:
        """Step item ids encoder DP rank `dp_rank` encodes in a window."""
        plan, ids = self.window(name, mb)
        a, b = plan.src_interval(dp_rank)
        return ids[a:b]

    def llm_items(self, name: str, dp_rank: int, mb: int = 0) -> int:
        """How many items of the window LLM DP shard `dp_rank` receives."""
        a, b = self.window(name, mb)[0].dst_interval(dp_rank)
        return b - a
