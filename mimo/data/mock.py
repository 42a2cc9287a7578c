"""Deterministic mock multimodal data.

Sample `i` of the run is a pure function of (data.seed, i): a text stream
with a learnable pattern, 0..k images and 0..k audio clips whose placeholder
runs sit at random positions, and some right padding. The token ids and each
item's random inputs have generators of their own and are made only when a rank
asks for them, so planning a step costs neither tokens nor pixels. The global batch of a
step is therefore identical whatever the layout; layouts only decide which
rank gets which slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from mimo.config import MimoConfig

from .items import LazyItems, PackedItems, grid_patches, grid_tokens, is_native, patch_width
from .native_images import native_grid

PAD_ID = 0


@dataclass
class Sample:
    input_ids: torch.Tensor          # [s] long
    items: Mapping[str, torch.Tensor]   # encoder name -> [n, ...] raw inputs (n may be 0); may decode lazily
    # Real data: which tokens are loss targets, which document (packed sample) each
    # token belongs to (-1: padding) and its position inside that document.
    # None (mock data): every text token after the first is a target, one document.
    targets: Optional[torch.Tensor] = None       # [s] bool
    document_ids: Optional[torch.Tensor] = None  # [s] long
    position_ids: Optional[torch.Tensor] = None  # [s] long
    # Native-resolution encoders: encoder name -> each item's patch grid (t, h, w), known from the
    # media header; their `items[name]` are the items' patches packed [Σ t*h*w, C*T*P*P].
    grids: Optional[Dict[str, List[Tuple[int, int, int]]]] = None

    def token_count(self, pad_id: int = PAD_ID) -> int:
        """Tokens that are not padding (real data marks padding by a negative document id)."""
        if self.document_ids is not None:
            return int((self.document_ids >= 0).sum())
        return int((self.input_ids != pad_id).sum())

    def document_tokens(self, pad_id: int = PAD_ID) -> List[int]:
        """Tokens of each document packed in the sequence (one entry when nothing is packed):
        attention never crosses documents, so its cost grows with each one's own length."""
        if self.document_ids is not None:
            ids = self.document_ids[self.document_ids >= 0]
            return [n for n in torch.bincount(ids).tolist() if n] if ids.numel() else []
        return [self.token_count(pad_id)]

    def loss_count(self, placeholder_ids: Mapping[str, int]) -> int:
        """Positions that carry a loss (this sample's share of the `loss_mask` sum `collate` gives)."""
        if self.targets is None:  # mock data: text after the first token, neither padding nor placeholder
            placeholders = torch.tensor(sorted(placeholder_ids.values()), dtype=torch.long)
            return int(((self.input_ids[1:] != PAD_ID) & ~torch.isin(self.input_ids[1:], placeholders)).sum())
        return int((self.targets[1:] & (self.document_ids[1:] == self.document_ids[:-1])).sum())

    def count(self, name: str) -> int:
        """Items of encoder `name`, without decoding them."""
        if self.grids is not None and name in self.grids:
            return len(self.grids[name])
        counts = getattr(self.items, "counts", None)
        return counts[name] if counts is not None else self.items[name].shape[0]

    def item(self, name: str, k: int):
        """Item k of encoder `name`; lazily decoded items decode just this one (native items: its
        patches [t*h*w, C*T*P*P])."""
        one = getattr(self.items, "item", None)
        if one is not None:
            return one(name, k)
        if self.grids is not None and name in self.grids:
            return PackedItems(self.items[name], self.grids[name]).item(k)
        return self.items[name][k]


class MockSample(Sample):
    """A mock sequence. What planning reads of every sequence of a step (its length, its loss
    positions, its items' counts) is known from its layout; its token ids are made on first use, so
    a rank makes those of the sequences it trains on only."""

    def __init__(self, index: int, seq_length: int, length: int, runs: List[Tuple[int, int]], cuts: List[int],
                 text_range: Tuple[int, int], text_seed: int, items, grids):
        # runs: (placeholder id, tokens) left to right; cuts: the text tokens before each run. The
        # text has a generator of its own: the same ids whenever, and on whichever thread, made.
        self.index, self.seq_length, self.length, self.runs, self.cuts = index, seq_length, length, runs, cuts
        self.text_range, self.text_seed, self._ids = text_range, text_seed, None
        self.items, self.grids = items, grids
        self.targets = self.document_ids = self.position_ids = None  # every text token after the first

    def __repr__(self) -> str:  # the dataclass's would make the tokens
        return f"MockSample({self.index})"

    def token_count(self, pad_id: int = PAD_ID) -> int:
        return self.length  # text ids start at 1 and placeholders sit above them: none is padding

    def document_tokens(self, pad_id: int = PAD_ID) -> List[int]:
        return [self.length]

    def loss_count(self, placeholder_ids: Optional[Mapping[str, int]] = None) -> int:
        """Positions 1 .. length-1 that are not a placeholder of `placeholder_ids` (None: every run's):
        a placeholder at position 0 (a first run with no text before it) is not among them anyway."""
        ids = None if placeholder_ids is None else set(placeholder_ids.values())
        counted = [ids is None or token in ids for token, _ in self.runs]
        dropped = sum(n for (_, n), c in zip(self.runs, counted) if c)
        at_zero = 1 if self.runs and self.cuts[0] == 0 and counted[0] else 0
        return self.length - 1 - dropped + at_zero

    @property
    def input_ids(self) -> torch.Tensor:
        if self._ids is None:
            n_text = self.length - sum(n for _, n in self.runs)
            text = _text(n_text, torch.Generator().manual_seed(self.text_seed), *self.text_range)
            ids, pos = [], 0
            for (token, n), cut in zip(self.runs, self.cuts):
                ids += [text[pos:cut], torch.full((n,), token, dtype=torch.long)]
                pos = cut
            ids += [text[pos:], torch.full((self.seq_length - self.length,), PAD_ID, dtype=torch.long)]
            self._ids = torch.cat(ids)
        return self._ids


def _text(n: int, g: torch.Generator, low: int, high: int) -> torch.Tensor:
    """An arithmetic progression mod the text vocabulary [low, high): predictable from context, so
    loss falls."""
    span = high - low
    start = int(torch.randint(0, span, (1,), generator=g))
    step = int(torch.randint(1, 4, (1,), generator=g))
    return low + (start + step * torch.arange(n)) % span


class MockMultimodalDataset:
    def __init__(self, cfg: MimoConfig):
        self.cfg = cfg
        self.seq_length = cfg.data.seq_length
        self.placeholders = cfg.placeholder_ids
        text = cfg.mock_text_ids  # the config check refuses fewer than 2
        self.text_low, self.text_high = text.start, text.stop
        # index -> non-padding length of the samples made lately (the step metrics' packing figure,
        # without making a step's samples, pixels included, once more); a few steps' worth kept.
        self._lengths: Dict[int, int] = {}

    def _item_shape(self, name: str):
        enc = self.cfg.model.encoders[name]
        if enc.kind == "vision":
            return (enc.num_channels, enc.image_size, enc.image_size)
        return (enc.clip_frames, enc.num_mel_bins)

    def _max_items(self, name: str) -> int:
        d = self.cfg.data
        return d.max_images_per_sample if self.cfg.model.encoders[name].kind == "vision" else d.max_audio_per_sample

    def sample(self, index: int) -> Sample:
        """Sample `index`: its layout now; its token ids (`MockSample`) and its items' raw inputs
        (`LazyItems`) only when asked for, so a rank that plans a step makes only what it trains on
        and encodes."""
        g = torch.Generator().manual_seed(self._seed(index))
        s = self.seq_length
        # Decide items per modality, dropping items that would not fit (leave room for text).
        runs = []  # (name, length)
        budget = s - max(4, s // 4)
        counts, grids = {}, {}
        for name, enc in self.cfg.model.encoders.items():
            want = int(torch.randint(0, self._max_items(name) + 1, (1,), generator=g))
            if is_native(enc):
                grids[name], budget = self._native_grids(name, enc, want, budget, runs, g)
                counts[name] = len(grids[name])
                continue
            n = 0
            for _ in range(want):
                if enc.tokens_per_item <= budget:
                    budget -= enc.tokens_per_item
                    runs.append((name, enc.tokens_per_item))
                    n += 1
            counts[name] = n
        # Shuffle the run order across modalities, then place runs at random text offsets.
        # The k-th run of a modality (left to right) is its k-th item: the packing order.
        order = torch.randperm(len(runs), generator=g).tolist() if runs else []
        # Within a modality the runs keep item order (native-resolution items differ in length, and
        # their grids are listed in order of appearance); only the modalities interleave at random.
        in_item_order = {}
        for i, (name, _) in enumerate(runs):
            in_item_order.setdefault(name, []).append(i)
        order = [in_item_order[runs[i][0]].pop(0) for i in order]
        length = s - int(torch.randint(0, max(1, s // 8), (1,), generator=g))  # some right padding
        n_text = length - sum(r[1] for r in runs)
        cuts = sorted(torch.randint(0, n_text + 1, (len(runs),), generator=g).tolist())
        keep = 4 * self.cfg.training.global_batch_size
        if len(self._lengths) > 2 * keep:
            self._lengths = {i: n for i, n in self._lengths.items() if i > index - keep}
        self._lengths[index] = length
        # Each item's inputs are drawn from a generator of its own (sample, encoder, item): the same
        # whichever rank makes it, and whichever other items are made.
        seeds = {name: [self._seed(index, e + 1, k + 1) for k in range(counts[name])]
                 for e, name in enumerate(self.cfg.model.encoders)}
        items = LazyItems(seeds, {name: [None] * n for name, n in counts.items()}, self._item_inputs,
                          {name: self._empty_shape(name) for name in counts}, grids)
        placed = [(self.placeholders[runs[i][0]], runs[i][1]) for i in order]
        return MockSample(index, s, length, placed, cuts, (self.text_low, self.text_high), self._seed(index, 0, 1),
                          items, grids or None)

    def _seed(self, index: int, encoder: int = 0, item: int = 0) -> int:
        """The generator seed of sample `index`'s layout (0, 0), its text (0, 1) or its item `item`
        of encoder `encoder` (both from 1), distinct for every (data.seed, index, encoder, item)."""
        sample = self.cfg.data.seed * 1_000_003 + index
        return ((sample * 64 + encoder) * (1 << 20) + item) % (1 << 63)

    def _empty_shape(self, name: str) -> tuple:
        enc = self.cfg.model.encoders[name]
        return (patch_width(enc),) if is_native(enc) else self._item_shape(name)

    def _item_inputs(self, name: str, seed: int, record: None, grid=None) -> torch.Tensor:
        """One item's random raw inputs: [C, H, W] or [frames, mels]; native images their patches
        [t*h*w, C*T*P*P]."""
        g = torch.Generator().manual_seed(seed)
        shape = (grid_patches(grid), patch_width(self.cfg.model.encoders[name])) if grid is not None \
            else self._item_shape(name)
        return torch.randn(shape, generator=g)

    def _native_grids(self, name: str, enc, want: int, budget: int, runs: List, g: torch.Generator):
        """Up to `want` images of random sizes (each side drawn between sqrt(min_pixels) and
        sqrt(max_pixels), then smart-resized as the HF processor would), those whose placeholder
        run still fits the budget: their grids, and the budget left."""
        lo, hi = max(1, math.isqrt(enc.min_pixels)), max(1, math.isqrt(enc.max_pixels))
        grids = []
        for _ in range(want):
            width, height = (int(v) for v in torch.randint(lo, hi + 1, (2,), generator=g))
            grid = native_grid(width, height, enc)
            tokens = grid_tokens(grid, enc.spatial_merge_size)
            if tokens <= budget:
                budget -= tokens
                runs.append((name, tokens))
                grids.append(grid)
        return grids, budget

    def skipped_samples(self, step: int) -> int:
        """Mock samples are never bad."""
        return 0

    def metrics(self, step: int) -> Dict[str, float]:
        """For the step metrics: mock samples are never bad, and are not packed (right padding only).
        The lengths of the samples this rank made for the step are remembered; only the others are
        made again (the ranks of a homogeneous layout each make their own shard)."""
        g = self.cfg.training.global_batch_size
        indices = range(step * g, (step + 1) * g)
        for i in indices:
            if i not in self._lengths:
                self.sample(i)
        lengths = [self._lengths[i] for i in indices]
        return {"skipped_samples": 0, "packing_efficiency": sum(lengths) / (g * self.seq_length)}

    def prefetch(self, wanted, pin_memory: bool = False, encoders=None) -> None:
        """Mock samples are generated on demand: nothing to decode ahead."""

    def global_batch(self, step: int) -> List[Sample]:
        g = self.cfg.training.global_batch_size
        return [self.sample(step * g + j) for j in range(g)]
