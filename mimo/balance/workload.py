"""Per-sample work of each module, estimated from the planner's cost model.

Balancing runs on every training step, so the estimate is a closed form
evaluated with numpy over all samples at once. The planner's per-layer
roofline model is sampled once per model to get:

* encoder: seconds per item (image, clip), forward plus the backward autograd
  really runs (frozen-aware: a frozen tower with a trainable projector pays
  the projector's gradients only). A native-resolution ViT's items each have
  their own size: an image of patch grid (t, h, w) costs
  ``a * patches + b * pairs`` seconds, ``pairs`` its attention (query, key)
  pairs summed over the layers (whole frames on full-attention layers, each
  window on window layers: `mimo.planner.native`). ``a`` (patch embedding,
  the layers' linears, the patch merger) and ``b`` (attention) come from the
  cost model at the reference image's patch count, once with no attention
  and once with every patch seeing every other;
* LLM: ``a * t + b * t**2`` seconds for a sample of ``t`` tokens (text plus
  the items' placeholder tokens). The quadratic term is causal attention,
  which grows with the sample's own length, not with the padded sequence.

All numbers are seconds at TP = CP = 1 on the chosen GPU; only their ratios
matter to the assignment, the simulator scales them to a layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from mimo.planner.cost_model import CostModel, Workload
from mimo.planner.costs import backward_costs, llm_upstream_requires_grad
from mimo.planner.hardware import get_gpu
from mimo.planner.spec import ModelSpec, read_model

# LLM lengths the quadratic is fitted through: long enough that every layer is compute-bound.
_FIT_LENGTHS = (2048.0, 8192.0)

# A LLaVA-1.5-like 7B model: what tools/balance.py assumes without --config.
LLAVA_7B: Mapping[str, Any] = {
    "language": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "ffn_hidden_size": 11008, "vocab_size": 32000},
    "encoders": {"images": {"kind": "vision", "num_layers": 24, "hidden_size": 1024,
                            "num_attention_heads": 16, "ffn_hidden_size": 4096, "image_size": 336,
                            "patch_size": 14, "frozen": True, "projector": {"kind": "mlp", "frozen": False}}},
}


@dataclass(frozen=True)
class ModuleRate:
    """Forward and backward seconds of one unit of work (an item, or the LLM's polynomial)."""
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def forward_share(self) -> float:
        return self.forward / self.total if self.total > 0 else 1.0


# Distinct (encoder, grid) costs kept: about 6 MB of dict entries; image grids alone number far fewer.
_ITEM_COST_ENTRIES = 1 << 16


class WorkloadModel:
    def __init__(self, spec: ModelSpec, gpu: str = "h100", precision: str = "bf16"):
        self.spec = spec
        cm = CostModel(get_gpu(gpu), precision)
        hidden = spec.language.hidden_size
        chains = {}
        self.per_item: dict[str, ModuleRate] = {}
        self.tokens_per_item: dict[str, int] = {}
        # Native-resolution encoders: (seconds per patch, seconds per attention pair) of an item.
        self.native: dict[str, tuple[ModuleRate, ModuleRate]] = {}
        # (encoder, grid) -> seconds: a dataset's images come in a bounded set of grids (the encoder's
        # pixel limits and patch rounding), so each is costed once for the whole run.
        self._item_costs: dict[tuple, float] = {}

        def rate(enc) -> tuple[ModuleRate, list]:
            costs = cm.module_costs(enc, 1, 1, 1.0, Workload(enc.tokens_per_item, {enc.name: 1.0}), hidden)
            return ModuleRate(sum(c.forward for c in costs), sum(backward_costs(costs))), costs

        for enc in spec.encoders:
            # Native: the reference image's cost (records that give token counts only).
            self.per_item[enc.name], chains[enc.name] = rate(enc)
            self.tokens_per_item[enc.name] = enc.llm_tokens_per_item
            if enc.native is not None:
                p = enc.tokens_per_item
                (none, _), (every, _) = (rate(dataclasses.replace(enc, attention_keys=k)) for k in (0.0, float(p)))
                pairs = float(enc.num_layers) * p * p
                self.native[enc.name] = (
                    ModuleRate(none.forward / p, none.backward / p),
                    ModuleRate((every.forward - none.forward) / pairs, (every.backward - none.backward) / pairs))
        upstream = llm_upstream_requires_grad(chains.values())

        def llm(t: float) -> ModuleRate:
            costs = cm.module_costs(spec.language, 1, 1, 1.0, Workload(int(t)))
            return ModuleRate(sum(c.forward for c in costs), sum(backward_costs(costs, upstream)))

        (s1, s2), (c1, c2) = _FIT_LENGTHS, [llm(s) for s in _FIT_LENGTHS]
        # total(t) = a t + b t^2 through both points (b >= 0: attention never speeds a token up).
        b = max(0.0, (c2.total / s2 - c1.total / s1) / (s2 - s1))
        self.llm_linear, self.llm_quadratic = max(0.0, c1.total / s1 - b * s1), b
        self.llm_forward_share = c1.forward_share

    @classmethod
    def from_model(cls, model: Any = None, gpu: str = "h100", precision: str = "bf16") -> "WorkloadModel":
        """From a `model:` section (dict or mimo.config dataclass); None: the LLaVA-1.5-like 7B."""
        return cls(read_model(LLAVA_7B if model is None else model), gpu, precision)

    @property
    def vision(self) -> str | None:
        """The first vision encoder: the one records' ``image_tokens`` feed."""
        return next((e.name for e in self.spec.encoders if e.kind == "vision"), None)

    @property
    def encoder_forward_share(self) -> float:
        rates = list(self.per_item.values())
        total = sum(r.total for r in rates)
        return sum(r.forward for r in rates) / total if total > 0 else 1.0

    def llm(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        return t * (self.llm_linear + self.llm_quadratic * t)

    def llm_documents(self, documents: Sequence[Sequence[int]]) -> np.ndarray:
        """Seconds of LLM work per sequence from the token counts of the documents packed in it
        (``documents[s]``): the linear part grows with all its tokens, attention with each
        document's own length, since a document never attends to another."""
        lengths = np.array([len(d) for d in documents], dtype=np.int64)
        flat = np.fromiter((t for d in documents for t in d), dtype=np.float64, count=int(lengths.sum()))
        return np.bincount(np.repeat(np.arange(len(documents)), lengths), weights=self.llm(flat),
                           minlength=len(documents))

    def encoder(self, items: Mapping[str, np.ndarray]) -> np.ndarray:
        """Seconds of encoder work per sample from its item counts per encoder."""
        out = None
        for name, counts in items.items():
            w = np.asarray(counts, dtype=np.float64) * self.per_item[name].total
            out = w if out is None else out + w
        return np.zeros(0) if out is None else out

    def item_cost(self, name: str, grid: Sequence[int]) -> float:
        """Seconds of one native-resolution image of patch grid (t, h, w) in encoder `name`."""
        per_patch, per_pair = self.native[name]
        t, h, w = (int(x) for x in grid)
        return per_patch.total * t * h * w + per_pair.total * self.spec.module(name).native.pairs((t, h, w))

    def _cached_cost(self, name: str, grid: Sequence[int]) -> float:
        key = (name, tuple(grid))
        cost = self._item_costs.get(key)
        if cost is None:
            if len(self._item_costs) >= _ITEM_COST_ENTRIES:  # video grids (frame counts) are not bounded
                self._item_costs.clear()
            cost = self._item_costs[key] = self.item_cost(name, grid)
        return cost

    def encoder_grids(self, grids: Mapping[str, Sequence[Sequence[Sequence[int]]]]) -> np.ndarray:
        """Seconds of encoder work per sample from its native items' grids (``grids[name][s]``:
        sample s's grids for encoder `name`)."""
        out = None
        for name, per_sample in grids.items():
            w = np.array([sum(self._cached_cost(name, g) for g in gs) for gs in per_sample], dtype=np.float64)
            out = w if out is None else out + w
        return np.zeros(0) if out is None else out

    def from_tokens(self, text_tokens: np.ndarray, image_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(encoder, llm) seconds per sample of records that give token counts only.

        Image tokens are the vision encoder's items times its tokens per item (a native encoder:
        its reference image's LLM tokens); the LLM sees text and image tokens. A model without a
        vision encoder has no encoder work."""
        text = np.asarray(text_tokens, dtype=np.float64)
        image = np.asarray(image_tokens, dtype=np.float64)
        name = self.vision
        enc = (np.zeros_like(image) if name is None
               else self.encoder({name: image / self.tokens_per_item[name]}))
        return enc, self.llm(text + image)
