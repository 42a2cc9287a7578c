"""Boundary windows of one step: which items cross an encoder -> LLM edge in one call, and who holds them.

A step's samples are placed by a `StepAssignment` (`mimo.balance`): for each
LLM DP shard d and microbatch k, the samples whose items the encoders take in
encoder microbatch k, and those whose tokens the LLM runs in LLM microbatch k.
Both are the same for `none` and `mmscale`. Under `entrain` an LLM microbatch
may also run *deferred* samples, encoded one microbatch earlier; an LLM
microbatch is then its *kept* samples (encoded in the same microbatch)
followed by its deferred ones.

A non-colocated edge moves one LLM microbatch per call: the kept window of
microbatch k (the kept samples of every LLM shard, shard-major) and, when
deferral moved items into it, a second call with the deferred window of
encoder microbatch k - 1. A colocated edge moves the whole step at once, in
LLM-major order, so that LLM DP shard j receives its own microbatches back
to back. Inside a window the items are divided over the encoder's DP ranks by
tokens (`divide_items`, encoder data parallelism over items) and go to the
LLM DP shard that holds their sample. Every rank derives the same windows
from the step's item counts and assignment alone, so no plan travels.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

from mimo.balance.assignment import StepAssignment
from mimo.config import LANGUAGE, MimoConfig
from mimo.data.items import divide_items, sample_item_bounds

KEPT, DEFERRED = "kept", "deferred"


def microbatch_offsets(counts: Sequence[int], sizes: Sequence[int]) -> List[int]:
    """Token offsets of consecutive microbatches of `sizes` samples in a packed shard, from per-sample
    token counts."""
    bounds = [0] + list(accumulate(sizes))
    prefix = [0] + list(accumulate(int(c) for c in counts))
    return [prefix[b] for b in bounds]


def split_deferred(a: StepAssignment) -> Tuple[List[List[List[int]]], List[List[List[int]]]]:
    """(kept, deferred) per [LLM shard][microbatch]: of LLM microbatch k's samples, those encoded in
    encoder microbatch k and those encoded in k - 1 (the only deferral the trainer executes: an
    overloaded microbatch hands LLM work to the partner that runs right after it)."""
    kept, late = [], []
    for d, (enc, llm) in enumerate(zip(a.encoder, a.llm)):
        if enc == llm:  # nothing deferred on this DP rank (always so under none and mmscale)
            kept.append([list(mb) for mb in llm])
            late.append([[] for _ in llm])
            continue
        k_rows, l_rows = [], []
        for k, mb in enumerate(llm):
            here, before = set(enc[k]), set(enc[k - 1]) if k else set()
            stray = [s for s in mb if s not in here and s not in before]
            if stray:
                raise ValueError(f"data.balance: LLM microbatch {k} of DP rank {d} runs samples {stray[:4]} "
                                 f"encoded neither in its own encoder microbatch nor in the one before")
            k_rows.append([s for s in mb if s in here])
            l_rows.append([s for s in mb if s not in here])
        kept.append(k_rows)
        late.append(l_rows)
    return kept, late


class StepWindows:
    """The boundary windows of one step.

    `item_counts[name]`: items of each step sample (host list); `assignment`: where the step's
    samples run (`mimo.balance`); `comms[name].plan`: the edge's static plan, specialised per window;
    `item_tokens[name]`: LLM tokens of each step item in step item order (`mimo.data.items.
    step_item_tokens`; default: every item the encoder's fixed `tokens_per_item`).
    """

    def __init__(self, cfg: MimoConfig, comms: Dict, item_counts: Dict[str, List[int]], colocated: List[str],
                 assignment: StepAssignment, item_tokens: Optional[Dict[str, List[int]]] = None):
        self.cfg, self.comms, self.item_counts, self.colocated = cfg, comms, item_counts, colocated
        # Each sample's first step item id, per encoder (items are numbered in sample order).
        self._first = {n: [0] + list(accumulate(int(c) for c in counts)) for n, counts in item_counts.items()}
        self.item_tokens = {n: list(item_tokens[n]) if item_tokens and n in item_tokens
                            else [cfg.model.encoders[n].tokens_per_item] * self._first[n][-1]
                            for n in item_counts}
        for n in item_counts:
            if len(self.item_tokens[n]) != self._first[n][-1]:
                raise ValueError(f"item_tokens[{n!r}]: {len(self.item_tokens[n])} sizes for "
                                 f"{self._first[n][-1]} items")
        self.kept, self.late = split_deferred(assignment)
        self._cache: Dict[Tuple[str, int, str], Tuple[object, List[int]]] = {}

    def tokens(self, name: str, ids: Sequence[int]) -> List[int]:
        """LLM tokens of each of the given step items of `name`."""
        return [self.item_tokens[name][i] for i in ids]

    def sample_tokens(self, name: str) -> List[int]:
        """LLM tokens of `name`'s items in each step sample."""
        first = self._first[name]
        prefix = [0] + list(accumulate(self.item_tokens[name]))
        return [prefix[b] - prefix[a] for a, b in zip(first, first[1:])]

    def llm_indices(self, dp_rank: int) -> List[List[int]]:
        """Step sample indices of each microbatch of LLM DP shard `dp_rank`: kept, then deferred."""
        return [k + l for k, l in zip(self.kept[dp_rank], self.late[dp_rank])]

    def _shards(self, name: str, mb: int, part: str) -> List[List[int]]:
        """The window's samples per LLM DP shard."""
        dL = self.cfg.parallelism[LANGUAGE].dp
        if name in self.colocated:
            return [[i for m in self.llm_indices(j) for i in m] for j in range(dL)]
        if part == KEPT:
            return [self.kept[j][mb] for j in range(dL)]
        # The deferred window of encoder microbatch mb: samples the LLM runs in microbatch mb + 1.
        return [self.late[j][mb + 1] if mb + 1 < len(self.late[j]) else [] for j in range(dL)]

    def window(self, name: str, mb: int = 0, part: str = KEPT) -> Tuple[object, List[int]]:
        """(the edge's plan of this window, step item ids in window order); colocated edges: mb is 0."""
        key = (name, mb, part)
        if key not in self._cache:
            counts, first = self.item_counts[name], self._first[name]
            shards = self._shards(name, mb, part)
            samples = [i for s in shards for i in s]
            ids = [i for s in samples for i in range(first[s], first[s + 1])]
            tokens = self.tokens(name, ids)
            src = divide_items(tokens, self.cfg.parallelism[name].dp)
            dst = sample_item_bounds([counts[s] for s in samples], [0] + list(accumulate(len(s) for s in shards)))
            # Every rank knows each item's size, so the communicator sends no counts ahead of the rows.
            self._cache[key] = (self.comms[name].plan.for_window(src, dst, tokens), ids)
        return self._cache[key]

    def has_deferred(self, name: str, mb: int) -> bool:
        """Whether encoder microbatch mb hands items of `name` to the next LLM microbatch (the same
        answer on every rank: it depends on the step's data alone)."""
        if name in self.colocated:
            return False
        if (name, mb, DEFERRED) in self._cache:
            return bool(self._cache[(name, mb, DEFERRED)][1])
        counts = self.item_counts[name]  # most windows defer nothing: known without planning them
        return any(counts[s] for shard in self._shards(name, mb, DEFERRED) for s in shard)

    def encoder_item_ids(self, name: str, dp_rank: int, mb: int = 0, part: str = KEPT) -> List[int]:
        """Step item ids encoder DP rank `dp_rank` encodes in a window."""
        plan, ids = self.window(name, mb, part)
        a, b = plan.src_interval(dp_rank)
        return ids[a:b]

    def llm_items(self, name: str, dp_rank: int, mb: int = 0, part: str = KEPT) -> int:
        """How many items of the window LLM DP shard `dp_rank` receives."""
        a, b = self.window(name, mb, part)[0].dst_interval(dp_rank)
        return b - a

    def llm_tokens(self, name: str, dp_rank: int, mb: int = 0, part: str = KEPT) -> int:
        """How many LLM tokens (boundary rows) of the window LLM DP shard `dp_rank` receives."""
        plan, ids = self.window(name, mb, part)
        a, b = plan.dst_interval(dp_rank)
        return sum(self.tokens(name, ids[a:b]))

    def microbatch_sizes(self, dp_rank: int) -> List[int]:
        return [len(m) for m in self.llm_indices(dp_rank)]
