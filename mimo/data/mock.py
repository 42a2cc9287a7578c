"""Deterministic mock multimodal data.

Sample `i` of the run is a pure function of (data.seed, i): a text stream
with a learnable pattern, 0..k images and 0..k audio clips whose placeholder
runs sit at random positions, and some right padding. The global batch of a
step is therefore identical whatever the layout; layouts only decide which
rank gets which slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

import torch

from mimo.config import MimoConfig

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

    def count(self, name: str) -> int:
        """Items of encoder `name`, without decoding them."""
        counts = getattr(self.items, "counts", None)
        return counts[name] if counts is not None else self.items[name].shape[0]

    def item(self, name: str, k: int):
        """Item k of encoder `name`; lazily decoded items decode just this one."""
        one = getattr(self.items, "item", None)
        return one(name, k) if one is not None else self.items[name][k]


class MockMultimodalDataset:
    def __init__(self, cfg: MimoConfig):
        self.cfg = cfg
        self.seq_length = cfg.data.seq_length
        self.placeholders = cfg.placeholder_ids
        # Text ids avoid the pad id and the placeholder ids (the top of the vocabulary, or an
        # HF model's image_token_id: text stays below the lowest placeholder).
        self.text_low = 1
        self.text_high = min([cfg.model.language.vocab_size - len(self.placeholders)] + list(self.placeholders.values()))
        if self.text_high - self.text_low < 2:
            raise ValueError("model.language.vocab_size leaves no room for text tokens")

    def _item_shape(self, name: str):
        enc = self.cfg.model.encoders[name]
        if enc.kind == "vision":
            return (enc.num_channels, enc.image_size, enc.image_size)
        return (enc.clip_frames, enc.num_mel_bins)

    def _max_items(self, name: str) -> int:
        d = self.cfg.data
        return d.max_images_per_sample if self.cfg.model.encoders[name].kind == "vision" else d.max_audio_per_sample

    def sample(self, index: int) -> Sample:
        g = torch.Generator().manual_seed(self.cfg.data.seed * 1_000_003 + index)
        s = self.seq_length
        # Decide items per modality, dropping items that would not fit (leave room for text).
        runs = []  # (name, length)
        budget = s - max(4, s // 4)
        items = {}
        for name, enc in self.cfg.model.encoders.items():
            want = int(torch.randint(0, self._max_items(name) + 1, (1,), generator=g))
            n = 0
            for _ in range(want):
                if enc.tokens_per_item <= budget:
                    budget -= enc.tokens_per_item
                    runs.append((name, enc.tokens_per_item))
                    n += 1
            items[name] = torch.randn((n,) + self._item_shape(name), generator=g)
        # Shuffle the run order across modalities, then place runs at random text offsets.
        # The k-th run of a modality (left to right) is its k-th item: the packing order.
        order = torch.randperm(len(runs), generator=g).tolist() if runs else []
        length = s - int(torch.randint(0, max(1, s // 8), (1,), generator=g))  # some right padding
        n_text = length - sum(r[1] for r in runs)
        cuts = sorted(torch.randint(0, n_text + 1, (len(runs),), generator=g).tolist())
        text = self._text(n_text, g)
        ids, pos = [], 0
        for k, run_idx in enumerate(order):
            name, ln = runs[run_idx]
            ids.append(text[pos:cuts[k]])
            pos = cuts[k]
            ids.append(torch.full((ln,), self.placeholders[name], dtype=torch.long))
        ids.append(text[pos:])
        ids.append(torch.full((s - length,), PAD_ID, dtype=torch.long))
        return Sample(input_ids=torch.cat(ids), items=items)

    def _text(self, n: int, g: torch.Generator) -> torch.Tensor:
        """An arithmetic progression mod the text vocabulary: predictable from context, so loss falls."""
        span = self.text_high - self.text_low
        start = int(torch.randint(0, span, (1,), generator=g))
        step = int(torch.randint(1, 4, (1,), generator=g))
        return self.text_low + (start + step * torch.arange(n)) % span

    def metrics(self, step: int) -> Dict[str, float]:
        """For the step metrics: mock samples are never bad, and are not packed (right padding only)."""
        ids = torch.stack([s.input_ids for s in self.global_batch(step)])
        return {"skipped_samples": 0, "packing_efficiency": float((ids != PAD_ID).float().mean())}

    def prefetch(self, wanted, pin_memory: bool = False, encoders=None) -> None:
        """Mock samples are generated on demand: nothing to decode ahead."""

    def global_batch(self, step: int) -> List[Sample]:
        g = self.cfg.training.global_batch_size
        return [self.sample(step * g + j) for j in range(g)]
