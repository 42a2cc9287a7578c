"""Model FLOPs of one training step: one formula per module kind.

Counted: matrix multiplies only, 2 FLOPs per multiply-add; norms, activations,
softmax, biases, rotary embedding and embedding lookups are left out (they are
a few percent at most). With n positions through a layer (hidden h, heads a,
query groups g, head dim d = h / a, FFN width f):

* dense transformer layer, forward: 2 n h (a d + 2 g d)  (QKV)  +  2 n a d h  (output
  projection)  +  4 n h f  (MLP, two matrices), or 6 n h f for a gated MLP (activation swiglu:
  gate, up and down matrices; Llama / Qwen2 LLMs, the Qwen2.5-VL ViT); d is kv_channels when set;
* mixture-of-experts layer (`num_moe_experts`, the layers `moe_layers()` marks), forward: the same
  attention, then the ACTIVE parameters of its MLP: the router 2 n h E, the top-k routed experts
  k (4 or 6) n h f_e and the shared expert (4 or 6) n h f_s. The other experts' weights cost
  memory (the planner counts them), not FLOPs;
* attention core, forward: 4 P a d, where P is the number of (query, key) pairs the
  mask allows: s (s + 1) / 2 per sample for causal SDPA, the real count of the
  bitfield mask for `attention: bitfield` (modality tokens see their whole span,
  padding sees nothing), t^2 per item for an encoder (bidirectional over its t tokens);
* embeddings / LM head: lookups are free; the LM head is 2 n h V over every position;
* encoder stem: vision patch embedding 2 t (C p^2) h_e, audio frame embedding
  2 t (frames_per_token mel) h_e per item;
* projector: mlp 2 t (h_e h + h h), linear 2 t h_e h per item (h: the LLM's width).

Every position of the LLM counts, padding included: the LLM computes it.

Who counts: each rank counts only its own share of the step, on the host, from
what it already holds (`microbatch_work` of each LLM microbatch when it is
made, `rank_work` over them): the LLM's first-stage TP-rank-0 / CP-rank-0 rank
of each LLM DP replica counts that replica's samples, their tokens, attention
pairs and encoder items. `mimo.training.metrics.reduce_step` sums the shares
inside the step's one existing all-reduce. `step_work` (a whole global batch at
once) is the oracle the tests compare the sum with.

Backward counts what autograd actually runs. Walking a module's parts from its
input (stem, layers, head / projector): a part's weight gradient (= its forward
matmul FLOPs) runs when the part trains; its input gradient (= its forward
matmul FLOPs, plus twice the attention core) runs when anything before it trains
(an earlier part, or an upstream module for the LLM). A trainable transformer
stack always has a trainable part before it (patch / frame embedding, token
embedding), so its attention backward is always counted. A frozen encoder under a trainable projector so
costs forward only; a frozen LLM under trainable projectors still pays its
input gradients.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from mimo.attention.mask import CAUSAL, LOW
from mimo.config import LANGUAGE, MimoConfig
from mimo.data import PAD_ID
from mimo.data.items import grid_patches, is_native, sample_grids
from mimo.model import attention_mask
from mimo.planner.native import native_attention_pairs  # one count for FLOPs, balance and planner

# Dense bf16 peak of one device, TFLOPS (datasheet, no sparsity), matched against the CUDA device name.
PEAK_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),   # SXM
    ("H200", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_name: Optional[str], override: Optional[float] = None) -> Optional[float]:
    """`training.peak_tflops` if set, else the table's entry for the device; None when unknown (CPU)."""
    if override is not None:
        return override
    if not device_name:
        return None
    name = device_name.upper()
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops
    return None


@dataclass
class StepWork:
    """What a step's global batch asks of the model."""

    samples: int
    positions: int                # LLM sequence positions, padding included
    tokens: int                   # non-padding positions
    items: Dict[str, int]         # encoder -> images / clips in the step
    llm_attention_pairs: int      # (query, key) pairs the LLM's mask allows, summed over samples
    # Native-resolution encoders only (items of their own sizes): encoder -> patches of the step's
    # items, and (query, key) attention pairs summed over the items and the encoder's layers.
    encoder_patches: Dict[str, int] = field(default_factory=dict)
    encoder_pairs: Dict[str, int] = field(default_factory=dict)

    def __add__(self, other: "StepWork") -> "StepWork":
        def add(a: Dict[str, int], b: Dict[str, int]) -> Dict[str, int]:
            return {n: a.get(n, 0) + b.get(n, 0) for n in {**a, **b}}
        return StepWork(self.samples + other.samples, self.positions + other.positions, self.tokens + other.tokens,
                        add(self.items, other.items), self.llm_attention_pairs + other.llm_attention_pairs,
                        add(self.encoder_patches, other.encoder_patches), add(self.encoder_pairs, other.encoder_pairs))


def no_work(cfg: MimoConfig) -> StepWork:
    return StepWork(0, 0, 0, {n: 0 for n in cfg.model.encoders}, 0)


def attention_pairs(bits: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> int:
    """Allowed (query, key) pairs of a bitfield mask [b, s] (positions = index order); with
    `document_ids` [b, s] only pairs within one document count, as the mask's documents allow."""
    if document_ids is None:
        document_ids = torch.zeros_like(bits)
    # Stable sort by document: each document becomes one contiguous run that
    # keeps its positions' order, so causal counts stay prefix sums.
    order = torch.sort(document_ids, dim=1, stable=True).indices
    bits, docs = bits.gather(1, order), document_ids.gather(1, order)
    start = torch.ones_like(docs, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    run = torch.cumsum(start.to(torch.int64), dim=1) - 1            # document run of each position
    low = bits & LOW
    total = 0
    for value in torch.unique(bits).tolist():
        if value == 0:
            continue
        queries = bits == value
        v_low = value & LOW
        if value & CAUSAL:
            visible = ((low & v_low) != 0).to(torch.int64)
            seen = torch.cumsum(visible, dim=1)
            # Keys seen before the run began (non-decreasing, so cummax carries the run's start).
            before = torch.cummax(torch.where(start, seen - visible, 0), dim=1).values
            total += int(((seen - before) * queries).sum())
        else:
            visible = (low == v_low).to(torch.int64)
            per_run = torch.zeros_like(visible).scatter_add_(1, run, visible)
            total += int((per_run.gather(1, run) * queries).sum())
    return total


def step_work(cfg: MimoConfig, samples: Sequence) -> StepWork:
    """StepWork of a global batch (a list of `mimo.data` samples with `input_ids` [s] and `items`), at once.

    The training loop does not call this (it sums per-rank shares, `rank_work`); tests use it as the oracle."""
    ids = torch.stack([s.input_ids for s in samples])
    items = {n: sum(s.count(n) for s in samples if n in s.items) for n in cfg.model.encoders}  # no decoding
    lang = cfg.model.language
    b, seq = ids.shape
    docs = [s.document_ids for s in samples]
    docs = None if any(d is None for d in docs) else torch.stack(docs)
    # Real data marks padding by a negative document id (token id 0 may be a real token).
    tokens = int((ids != PAD_ID).sum()) if docs is None else int((docs >= 0).sum())
    if lang.attention == "bitfield":
        mask = attention_mask(cfg, ids, docs)     # the model's own mask, packed documents apart
        pairs = attention_pairs(mask.bits, mask.document_ids)
    else:
        pairs = b * seq * (seq + 1) // 2
    grids = {n: [g for s in samples for g in sample_grids(s, n)] for n, e in cfg.model.encoders.items() if is_native(e)}
    return StepWork(samples=b, positions=b * seq, tokens=tokens, items=items,
                    llm_attention_pairs=pairs, **native_work(cfg, grids))


def microbatch_work(cfg: MimoConfig, input_ids: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                    item_counts: Optional[Mapping[str, torch.Tensor]] = None, mask=None,
                    item_grids: Optional[Mapping[str, torch.Tensor]] = None) -> StepWork:
    """StepWork of one LLM microbatch from its HOST tensors: `input_ids` [b, s], `document_ids` [b, s]
    (packed real data; negative = padding), `item_counts` encoder -> per-sample item counts [b] (the
    collated `{encoder}_counts`), `mask` the microbatch's bitfield mask when already built
    (`mimo.model.attention_mask`; built here otherwise), `item_grids` native-resolution encoder -> its
    items' grids [n, 3] (the collated `{encoder}_grids`). Host tensors only: nothing waits for a device."""
    lang = cfg.model.language
    b, seq = input_ids.shape
    tokens = int((input_ids != PAD_ID).sum()) if document_ids is None else int((document_ids >= 0).sum())
    counts = item_counts or {}
    items = {n: int(counts[n].sum()) if n in counts else 0 for n in cfg.model.encoders}
    if lang.attention == "bitfield":
        if mask is None:
            mask = attention_mask(cfg, input_ids, document_ids)
        pairs = attention_pairs(mask.bits, mask.document_ids)
    else:
        pairs = b * seq * (seq + 1) // 2
    grids = {n: [tuple(g) for g in item_grids[n].tolist()] for n in (item_grids or {})}
    return StepWork(samples=b, positions=b * seq, tokens=tokens, items=items, llm_attention_pairs=pairs,
                    **native_work(cfg, grids))


def native_work(cfg: MimoConfig, grids: Mapping[str, Sequence]) -> Dict[str, Dict[str, int]]:
    """StepWork's native-resolution fields from each native encoder's item grids (t, h, w)."""
    return {"encoder_patches": {n: sum(grid_patches(g) for g in gs) for n, gs in grids.items()},
            "encoder_pairs": {n: sum(native_attention_pairs(cfg.model.encoders[n], g) for g in gs)
                              for n, gs in grids.items()}}


def count_later(cfg: MimoConfig, host: Mapping[str, torch.Tensor], mask=None) -> Callable[[], StepWork]:
    """What an LLM microbatch keeps (`batch["work"]`) for the step's FLOP count: a call that counts it
    (`microbatch_work`) on the host, made only on the ranks that report it (`rank_work`). It holds the
    host ids, document ids, item counts and mask, not the microbatch's other host tensors (pixels)."""
    return functools.partial(microbatch_work, cfg, host["input_ids"], host.get("document_ids"),
                             {n: host[f"{n}_counts"] for n in cfg.model.encoders if f"{n}_counts" in host}, mask,
                             {n: host[f"{n}_grids"] for n in cfg.model.encoders if f"{n}_grids" in host})


@dataclass
class RankWork:
    """One rank's share of the step's work: the samples of LLM DP replica `dp_rank`."""

    dp_rank: int
    work: StepWork


def reports_work(llm_coords: Optional[Mapping[str, int]]) -> bool:
    """Whether a rank with these LLM grid coordinates (None: it holds no LLM stage) counts its LLM DP
    replica's share: the first pipeline stage's TP-rank-0, CP-rank-0 rank, one per replica."""
    return llm_coords is not None and llm_coords["pp"] == 0 and llm_coords["tp"] == 0 and llm_coords["cp"] == 0


def rank_work(cfg: MimoConfig, llm_coords: Optional[Mapping[str, int]], llm_batches: Sequence[Mapping]) -> \
        Optional[RankWork]:
    """This rank's share of the step's work (None when it reports none, `reports_work`): the sum over
    its LLM microbatches (`llm_batches`, each with `"work"`: a StepWork or `count_later`'s call).
    Host work grows with this rank's own microbatches, not with the global batch."""
    if not reports_work(llm_coords):
        return None
    total = no_work(cfg)
    for b in llm_batches:
        w = b["work"]
        total = total + (w() if callable(w) else w)
    return RankWork(llm_coords["dp"], total)


def layer_linear_flops(hidden: int, heads: int, groups: int, ffn: int, gated: bool = False,
                       head_dim: Optional[int] = None) -> int:
    """Forward matmul FLOPs of one dense transformer layer, per position (`gated`: the MLP's
    first linear is two ffn-wide halves, gate and up, as swiglu runs it; `head_dim`: kv_channels,
    default hidden / heads)."""
    d = head_dim or hidden // heads
    return 2 * hidden * (heads * d + 2 * groups * d) + 2 * heads * d * hidden + (6 if gated else 4) * hidden * ffn


def moe_mlp_flops(hidden: int, experts: int, topk: int, expert_ffn: int, shared_ffn: int = 0,
                  gated: bool = False) -> int:
    """Forward matmul FLOPs of one mixture-of-experts MLP, per position: the ACTIVE parameters only,
    the router (hidden -> experts), the `topk` routed experts' MLPs (each `expert_ffn` wide) and the
    shared expert (`shared_ffn` wide, 0: none), each MLP two matrices or three when `gated`. The
    experts a token is not routed to cost it nothing; a shared expert's sigmoid gate (hidden -> 1)
    is left out like biases."""
    mlp = (6 if gated else 4) * hidden
    return 2 * hidden * experts + topk * mlp * expert_ffn + mlp * shared_ffn


def llm_layers_linear_flops(lang) -> int:
    """Forward matmul FLOPs per position summed over the LLM's layers: dense layers as
    `layer_linear_flops`, mixture-of-experts layers (`lang.moe_layers()`) with the same attention
    and `moe_mlp_flops` in place of the dense MLP."""
    gated = is_gated(lang)
    dense = layer_linear_flops(lang.hidden_size, lang.num_attention_heads, lang.num_query_groups,
                               lang.ffn_hidden_size, gated, getattr(lang, "kv_channels", None))
    if not getattr(lang, "is_moe", False):
        return lang.num_layers * dense
    attention = layer_linear_flops(lang.hidden_size, lang.num_attention_heads, lang.num_query_groups, 0,
                                   gated, getattr(lang, "kv_channels", None))
    moe = attention + moe_mlp_flops(lang.hidden_size, lang.num_moe_experts, lang.moe_router_topk,
                                    lang.moe_ffn_hidden_size or lang.ffn_hidden_size,
                                    lang.moe_shared_expert_intermediate_size, gated)
    return sum(moe if m else dense for m in lang.moe_layers())


def attention_width(module) -> int:
    """Heads times head dim (kv_channels when set): the width QK^T and PV run at."""
    return module.num_attention_heads * (getattr(module, "kv_channels", None)
                                         or module.hidden_size // module.num_attention_heads)


def is_gated(module) -> bool:
    """Whether a module config's MLP is gated (swiglu: silu(gate) * up, three matrices)."""
    return getattr(module, "activation", None) == "swiglu"


def attention_core_flops(pairs: int, hidden: int) -> int:
    """Forward FLOPs of QK^T and PV over `pairs` allowed pairs (all heads: a d = hidden)."""
    return 4 * pairs * hidden


@dataclass
class Part:
    linear: float     # forward matmul FLOPs
    attention: float  # forward attention-core FLOPs
    trains: bool


@dataclass
class ModuleFlops:
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def walk(parts: List[Part], upstream_trains: bool) -> ModuleFlops:
    """Forward and the backward autograd runs, over a module's parts in input order."""
    fwd = bwd = 0.0
    before = upstream_trains
    for p in parts:
        fwd += p.linear + p.attention
        if p.trains:
            bwd += p.linear  # weight gradients
        if before:
            bwd += p.linear + 2 * p.attention  # input gradients (attention: dQ, dK, dV)
        before = before or p.trains
    return ModuleFlops(fwd, bwd)


def encoder_trains(cfg: MimoConfig, name: str) -> bool:
    enc = cfg.model.encoders[name]
    return not (enc.frozen and enc.projector.frozen)


def module_flops(cfg: MimoConfig, work: StepWork) -> Dict[str, ModuleFlops]:
    """Forward and backward FLOPs of the step, per module (encoders include their projector)."""
    out: Dict[str, ModuleFlops] = {}
    h_llm = cfg.model.language.hidden_size
    for name, enc in cfg.model.encoders.items():
        if is_native(enc):
            out[name] = native_encoder_flops(cfg, enc, work.encoder_patches.get(name, 0),
                                             work.encoder_pairs.get(name, 0))
            continue
        t, n = enc.tokens_per_item, work.items.get(name, 0)
        if enc.kind == "vision":
            stem_in = enc.num_channels * enc.patch_size ** 2
        else:
            stem_in = enc.frames_per_token * enc.num_mel_bins
        he = enc.hidden_size
        proj = he * h_llm + h_llm * h_llm if enc.projector.kind == "mlp" else he * h_llm
        layer = layer_linear_flops(he, enc.num_attention_heads, enc.num_attention_heads, enc.ffn_hidden_size,
                                   is_gated(enc))
        parts = [Part(2 * n * t * stem_in * he, 0, not enc.frozen),
                 Part(enc.num_layers * n * t * layer, enc.num_layers * attention_core_flops(n * t * t, he),
                      not enc.frozen),
                 Part(2 * n * t * proj, 0, not enc.projector.frozen)]
        out[name] = walk(parts, upstream_trains=False)
    lang = cfg.model.language
    h, P = lang.hidden_size, work.positions
    trains = not lang.frozen
    parts = [Part(0, 0, trains),  # embedding lookup: free, but its weights want gradients
             Part(P * llm_layers_linear_flops(lang),
                  lang.num_layers * attention_core_flops(work.llm_attention_pairs, attention_width(lang)),
                  trains),
             Part(2 * P * h * lang.vocab_size, 0, trains)]
    upstream = any(encoder_trains(cfg, n) for n in cfg.model.encoders)
    out[LANGUAGE] = walk(parts, upstream)
    return out


def native_encoder_flops(cfg: MimoConfig, enc, patches: int, pairs: int) -> ModuleFlops:
    """A native-resolution ViT with its patch merger over `patches` patches: the patch embedding
    (2 (C T p^2) h_e per patch), the layers (`pairs`: attention pairs summed over layers), and the
    merger's two linears on patches / m^2 rows (m^2 h_e -> m^2 h_e -> h)."""
    he, h_llm, m2 = enc.hidden_size, cfg.model.language.hidden_size, enc.spatial_merge_size ** 2
    stem_in = enc.num_channels * enc.temporal_patch_size * enc.patch_size ** 2
    layer = layer_linear_flops(he, enc.num_attention_heads, enc.num_attention_heads, enc.ffn_hidden_size,
                               is_gated(enc))
    merged = patches // m2
    parts = [Part(2 * patches * stem_in * he, 0, not enc.frozen),
             Part(enc.num_layers * patches * layer, attention_core_flops(pairs, he), not enc.frozen),
             Part(2 * merged * (m2 * he * m2 * he + m2 * he * h_llm), 0, not enc.projector.frozen)]
    return walk(parts, upstream_trains=False)


def step_flops(cfg: MimoConfig, work: StepWork) -> float:
    return sum(m.total for m in module_flops(cfg, work).values())
