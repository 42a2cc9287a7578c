"""Step time and peak memory of a whole layout, the way Megatron runs it on GPUs.

This is the planner's model of a *training step* (``layout_search`` uses it to
rank layouts and to cost a given one). It follows what a tuned megatron-core
run does, from first principles and public hardware figures, with no fitted
constants:

* **Compute.** Every transformer layer is its four GEMMs (QKV, attention
  projection, FC1 - gate and up halves when the MLP is gated - and FC2),
  fused attention and the memory-bound elementwise work (layer norms,
  residuals, bias/activation, dropout). A GEMM costs its FLOPs at
  the GPU's achieved large-GEMM rate plus its operand traffic at HBM bandwidth,
  so skinny GEMMs (small hidden sizes cut by TP) are slower per FLOP, as on real
  hardware. Backward is data-gradient + weight-gradient GEMMs and 2.5x the
  attention FLOPs, at fused attention's lower backward rate; frozen-aware:
  gradients autograd skips are not charged (``costs.backward_costs``, exact
  per layer).
* **Tensor parallelism** stays inside a node. Without SP a layer does two
  all-reduces forward and two backward; with SP (``sp``) the same volume as
  all-gather / reduce-scatter (plus the input re-gathers of the backward),
  and the layer-norm / dropout activations and their elementwise work are
  split by TP too. Forward collectives wait; backward ones that megatron-core
  issues asynchronously hide behind the GEMM they overlap (``_tp_backward``).
* **Context parallelism** (Megatron's ring): each rank exchanges its K/V chunk
  ``cp - 1`` times forward and K/V plus their gradients backward, overlapped
  with attention compute; what the attention cannot hide is exposed. When
  ``tp * cp`` exceeds a node the ring crosses InfiniBand. Every extra ring
  step is also an attention call of its own with a softmax correction of the
  partial output (and fp32 gradient accumulation in backward), which is what
  makes CP a loss at short sequences. An encoder that inherits CP (the
  homogeneous baseline) has little attention per item to hide the exchange
  behind, which is what makes that baseline slow at long context.
* **Recompute.** ``selective`` recomputes core attention (with fused
  attention it saves no memory: scores are never stored); ``full`` keeps only
  each layer's input and runs the layer's forward again in backward.
* **Memory** per rank: bf16 weights (2 B/param); trainable parameters add a
  gradient buffer and, divided over the DP x CP group by the distributed
  optimizer, fp32 master weights and Adam's two moments. With
  ``grad_reduce_in_fp32`` (Megatron-LM's bf16 default, and mimo's) the buffer
  is fp32 (4 B) and the optimizer steps its shard in place (12 B); without
  it the buffer is bf16 (2 B) and the optimizer adds an fp32 copy of its
  gradient shard (16 B).
  Activations per layer follow Korthikanti et al. (``10 + 24 / tp`` x
  tokens x hidden bytes at ffn = 4h without SP, ``34 / tp`` with SP),
  generalised to any ffn / GQA width; stage ``i`` of ``p`` holds
  ``min(p - i, M)`` microbatches in 1F1B; the last LLM stage holds the fp32
  logits of one microbatch.
* **Pipeline split.** Layers are split to minimise the slowest stage; where
  that split runs a stage out of memory (early stages hold more 1F1B
  microbatches), the fastest split that fits instead, with layers moved to
  later stages, as a tuned run sets its layer balance.
* **Step.** 1F1B over ``M`` microbatches: the sum of the stage times plus
  ``M - 1`` times the slowest stage. Gradient reduce-scatter (in the gradient
  buffer's dtype) and parameter all-gather (bf16, distributed optimizer)
  overlap the last backward and the first forward; what does not fit is
  exposed; then the Adam step at HBM bandwidth.

Placements:
* ``homogeneous``: every encoder runs whole inside the LLM's first pipeline
  stage on its GPUs, with the LLM's TP, CP and DP (Megatron's baseline); the
  LLM's layers are balanced around it (a shorter first stage, Megatron's
  ``decoder_first_pipeline_num_layers``), as in a tuned run.
* ``colocated``: same GPUs, each encoder with its own TP/DP; the three-phase
  schedule (encoder forward, LLM 1F1B, encoder backward) in windows of the
  LLM's in-flight microbatches.
* ``non-colocated``: encoders on their own GPUs (encoders sharing an island
  add up on the ranks they share), pipelined into the LLM; the step is paced
  by the slowest stage of either. Encoders left on the LLM's GPUs in such a
  layout (a mixed placement) still run colocated.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Mapping

from mimo.planner.cost_model import projector_params
from mimo.planner.costs import LayerCost, backward_costs, output_requires_grad
from mimo.planner.hardware import GpuSpec
from mimo.planner.spec import ModelSpec, ModuleSpec
from mimo.planner.stage_split import StageMemory, partition

RECOMPUTE = ("none", "selective", "full")
PLACEMENTS = ("homogeneous", "colocated", "non-colocated")
ATTENTION_BACKWARD_RATIO = 2.5
# Fragmentation of the caching allocator on top of what tensors hold.
ALLOCATOR_OVERHEAD = 1.05
# HBM bytes per logit of megatron-core's vocab-parallel cross entropy (its
# default, unfused path): forward casts the bf16 logits to fp32 (read 2,
# write 4), takes the max (4), subtracts it (8), exponentiates (8), sums (4)
# and normalises to the softmax it saves (8); backward scales that softmax by
# the incoming gradient in place (8) and casts it back to bf16 (6).
CROSS_ENTROPY_FORWARD_BYTES = 38
CROSS_ENTROPY_BACKWARD_BYTES = 14


@dataclass(frozen=True)
class Par:
    """One module's layout and memory knobs (config ``parallelism.<module>``)."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    recompute: str = "none"
    rank_offset: int = 0
    # Transformer layers per pipeline stage as the config gives them
    # (``stage_layers``); empty: the model's own balanced split.
    stage_layers: tuple[int, ...] = ()
    # Expert parallelism of an MoE LLM (docs/moe.md): a second split of the same tp * cp * dp
    # ranks, etp x ep x expert-DP; it adds no ranks.
    ep: int = 1
    etp: int = 1

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: copies of each expert shard per pipeline stage."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def as_dict(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "etp": self.etp,
                "sp": self.sp, "recompute": self.recompute, "rank_offset": self.rank_offset}


@dataclass(frozen=True)
class Work:
    """What one sample asks of each module: LLM tokens and encoder items."""
    seq_length: int
    items_per_sample: Mapping[str, float] = field(default_factory=dict)

    def items(self, encoder: str) -> float:
        return float(self.items_per_sample.get(encoder, 0.0))


@dataclass
class Chain:
    """A module (or encoders + LLM stage 0) cut into pipeline stages: per
    microbatch forward / backward seconds and memory per stage."""
    forward: list[float]
    backward: list[float]
    weights: list[float]        # parameters held per rank
    trainable: list[float]
    activations: list[float]    # bytes kept per in-flight microbatch
    transient: list[float]      # bytes live once (logits, a recomputed layer)
    sizes: list[int] = field(default_factory=list)  # layers per stage (all modules)
    total: list[float] = field(default_factory=list)  # forward + backward per stage

    def __post_init__(self):
        self.total = [f + b for f, b in zip(self.forward, self.backward)]


@dataclass
class Layers:
    """Modules' layers end to end (pre/post layers folded in): per layer
    forward / backward seconds, weights, trainable weights, activation and
    transient bytes; the first ``lead`` belong to modules before the last."""
    forward: list[float]
    backward: list[float]
    weights: list[float]
    trainable: list[float]
    activations: list[float]
    transient: list[float]
    lead: int
    items: list[float] = field(init=False)

    def __post_init__(self):
        # What ``partition`` splits: the leading modules and the last
        # module's first layer are one item (they stay in stage 0).
        self.items = _lead_item(_sum_lists(self.forward, self.backward), self.lead)

    def cut(self, sizes: list[int]) -> Chain:
        """The chain for ``sizes`` layers of the last module per stage."""
        sizes = list(sizes)
        sizes[0] += self.lead
        return Chain(_stages(self.forward, sizes), _stages(self.backward, sizes), _stages(self.weights, sizes),
                     _stages(self.trainable, sizes), _stages(self.activations, sizes),
                     [max(self.transient[i:j], default=0.0) for i, j in _bounds(sizes)], sizes)


@dataclass
class Estimate:
    placement: str
    step_time: float
    peak_memory: float                    # bytes, max over ranks
    modules: dict[str, float]             # peak bytes per module's ranks
    tokens_per_s: float
    gpus: int
    update_time: float = 0.0              # optimizer traffic + step, inside step_time
    llm_stage_layers: tuple[int, ...] = ()  # the LLM's transformer layers per pipeline stage
    # Layers moved off the balanced split to fit memory: a config must name
    # the split (``stage_layers``) to run and be costed as this estimate.
    llm_split_moved: bool = False


class StepModel:
    def __init__(self, spec: ModelSpec, gpu: GpuSpec, work: Work, global_batch: int,
                 micro_batch: int, precision: str = "bf16", distributed_optimizer: bool = True,
                 grad_reduce_in_fp32: bool = True):
        self.spec, self.gpu, self.work = spec, gpu, work
        self.g, self.m = global_batch, micro_batch
        self.bpe = 2 if precision == "bf16" else 4
        # fp32 GEMMs run as TF32 at about half the bf16 rate.
        scale = 1.0 if precision == "bf16" else 0.5
        self.gemm_flops = gpu.peak_flops * gpu.gemm_efficiency * scale
        self.attn_flops = gpu.peak_flops * gpu.attention_efficiency * scale
        self.attn_backward_flops = self.attn_flops * gpu.attention_backward_rate
        self.hbm = gpu.memory_bandwidth
        self.dist_opt = distributed_optimizer
        # Per trainable bf16 parameter: 2 bytes of weight, the gradient buffer
        # (fp32 with grad_reduce_in_fp32, else bf16) and the optimizer's state,
        # divided over DP x CP by the distributed optimizer: fp32 master and
        # Adam's two moments (12), plus an fp32 copy of the gradient shard when
        # the buffer is bf16 (16). fp32 training: 4 + 4 + the moments (8).
        bf16 = precision == "bf16"
        fp32_grads = grad_reduce_in_fp32 or not bf16
        self.weight_bytes = 2.0 if bf16 else 4.0
        self.grad_bytes = 4.0 if fp32_grads else 2.0
        self.master_bytes = (12.0 if fp32_grads else 16.0) if bf16 else 8.0
        self.llm_upstream = any(not e.frozen or (e.projector_kind is not None and not e.projector_frozen)
                                for e in spec.encoders)
        self._layers: dict[tuple, tuple] = {}
        self._lists: dict[tuple, tuple] = {}
        self._updates: dict[tuple, float] = {}
        self._concats: dict[tuple, Layers] = {}
        # Per split-to-fit key: bytes a stage holds at the very least, and what each layer holds.
        self._stage_floor: dict[tuple, float] = {}
        self._stage_memory: dict[tuple, StageMemory] = {}
        self._chains: dict[tuple, Chain] = {}    # chains live as long as the model,
        self._memory: dict[tuple, float] = {}    # so their ids are stable keys here

    # ---- collectives --------------------------------------------------------
    def _ring(self, nbytes: float, group: int, span: int) -> float:
        """One all-gather or reduce-scatter of ``nbytes`` (the full tensor)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        return (group - 1) / group * nbytes / self.gpu.bus_bandwidth(span) + self.gpu.latency(span)

    def _gemm(self, t: float, k: float, n: float) -> float:
        return 2.0 * t * k * n / self.gemm_flops + self.bpe * (t * k + k * n + t * n) / self.hbm

    def _tp_backward(self, one: float, sp: bool, column_gemms: tuple[float, ...], frozen: bool,
                     rows: int = 2) -> float:
        """Exposed TP communication of a backward pass, as megatron-core's
        tensor-parallel linears run it (``one``: one all-gather or
        reduce-scatter of the layer's activations). With SP, each row-parallel
        linear all-gathers its output gradient before it can start (exposed);
        each column-parallel linear all-gathers its saved input shard while its
        data-gradient GEMM runs and reduce-scatters that gradient while its
        weight-gradient GEMM runs (both asynchronous, so only what the GEMM
        cannot cover is exposed). Without SP, each column-parallel linear
        all-reduces its data gradient behind its weight-gradient GEMM. Frozen
        weights have no weight-gradient GEMM and need no gathered input, so
        the reduce-scatter or all-reduce is exposed whole."""
        if one <= 0:
            return 0.0
        if sp:
            return rows * one + sum(one if frozen else 2 * max(0.0, one - g) for g in column_gemms)
        return sum(2 * one if frozen else max(0.0, 2 * one - g) for g in column_gemms)

    # ---- one module's layers ----------------------------------------------------
    def module_layers(self, mod: ModuleSpec, par: Par, tokens: float, span: float,
                      out_hidden: int) -> tuple[list[LayerCost], list[float], list[float], list[float]]:
        """Per layer (pre, transformer x L, post): cost, params per rank,
        activation bytes per microbatch, transient bytes; for ``tokens`` tokens
        of one microbatch on one DP replica, attending ``span`` keys each."""
        key = (mod.name, par.tp, par.cp, par.sp, par.recompute, par.ep, par.etp, tokens, span, out_hidden)
        if key in self._layers:
            return self._layers[key]
        tp, cp, bpe = par.tp, par.cp, self.bpe
        seq_div = tp if par.sp else 1
        t = tokens / cp
        h, f = mod.hidden_size, mod.ffn_hidden_size
        # q: query / attention-output width (heads x head dim, which need not
        # be h); fc1: the MLP's first output, two ffn-wide halves when gated.
        q, fc1 = mod.attention_width, mod.mlp_in_width
        kv = mod.num_query_groups * mod.kv_channels
        kv_rank = kv / min(tp, mod.num_query_groups)
        tp_one = self._ring(t * h * bpe, tp, tp)

        qkv, fc1_gemm = self._gemm(t, h, (q + 2 * kv) / tp), self._gemm(t, h, fc1 / tp)
        gemm = qkv + self._gemm(t, q / tp, h) + fc1_gemm + self._gemm(t, f / tp, h)
        tp_b = self._tp_backward(tp_one, par.sp, (qkv, fc1_gemm), mod.frozen)
        attn_flops = 4.0 * t * span * q / tp
        attn_f = attn_flops / self.attn_flops
        attn_b = ATTENTION_BACKWARD_RATIO * attn_flops / self.attn_backward_flops
        # The MLP's activation reads fc1 and writes f, forward and backward.
        ew = bpe * t * (8 * h / seq_div + 2 * (fc1 + f) / tp) / self.hbm
        cp_f = cp_b = 0.0
        if cp > 1:
            span_gpus = tp * cp
            chunk = 2 * t * kv_rank * bpe
            one = chunk / self.gpu.bus_bandwidth(span_gpus)
            lat = self.gpu.latency(span_gpus)
            cp_f = max((cp - 1) * one - attn_f, 0.0) + (cp - 1) * lat
            cp_b = max(2 * (cp - 1) * one - attn_b, 0.0) + 2 * (cp - 1) * lat
            # Each extra ring step is its own attention call plus a softmax
            # correction of the partial output (read two, write one), and in
            # backward an fp32 accumulation of dQ and of the travelling dK/dV.
            steps = cp - 1
            cp_f += steps * (3 * t * q / tp * bpe / self.hbm + 4 * self.gpu.kernel_overhead)
            cp_b += steps * ((2 * t * q / tp + 4 * t * kv_rank) * 4 / self.hbm + 6 * self.gpu.kernel_overhead)
        ko = self.gpu.kernel_overhead
        fwd = gemm + attn_f + ew + 4 * tp_one + cp_f + 20 * ko
        bwd_in = gemm + attn_b + 2 * ew + tp_b + cp_b + 20 * ko
        if par.recompute == "selective":
            bwd_in += attn_f
        elif par.recompute == "full":
            bwd_in += fwd
        layer = LayerCost(fwd, bwd_in, gemm + 10 * ko, mod.frozen)
        params = (h * (q + 2 * kv) + q * h + h * fc1 + f * h) / tp + 4 * h
        full_act = t * ((4 * h * bpe + 2 * h) / seq_div + bpe * ((q + 2 * kv) + q + fc1 + f) / tp)
        act = t * h * bpe / seq_div if par.recompute == "full" else full_act
        transient = full_act if par.recompute == "full" else 0.0

        costs, weights, acts, trans = [], [], [], []
        if mod.is_language:
            v = mod.vocab_size
            costs.append(LayerCost(t * h * bpe / self.hbm + tp_one, 0.0, 0.0, mod.frozen))
            weights.append(v * h / tp)
            acts.append(0.0)
            trans.append(0.0)
        else:
            feats = mod.input_features
            g = self._gemm(t, feats, h)
            costs.append(LayerCost(g, 0.0, g, mod.frozen))
            weights.append(feats * h)
            acts.append(t * feats * bpe)
            trans.append(0.0)
        if mod.is_moe:
            moe = self._moe_layer(mod, par, t, attn_f, attn_b, tp_one, cp_f, cp_b)
            layers = [moe if m else (layer, params, act, transient) for m in mod.moe_layers]
            costs += [x[0] for x in layers]
            weights += [x[1] for x in layers]
            acts += [x[2] for x in layers]
            trans += [x[3] for x in layers]
        else:
            costs += [layer] * mod.num_layers
            weights += [params] * mod.num_layers
            acts += [act] * mod.num_layers
            trans += [transient] * mod.num_layers
        if mod.is_language:
            v = mod.vocab_size
            head = self._gemm(t, h, v / tp)
            ce_f = CROSS_ENTROPY_FORWARD_BYTES * t * v / tp / self.hbm
            ce_b = CROSS_ENTROPY_BACKWARD_BYTES * t * v / tp / self.hbm
            costs.append(LayerCost(head + ce_f + tp_one,
                                   head + ce_b + self._tp_backward(tp_one, par.sp, (head,), mod.frozen, rows=0),
                                   head, mod.frozen))
            weights.append(v * h / tp)
            logits = t * v / tp * 4.0
            acts.append(0.0)
            trans.append(logits + t * h * bpe)
        elif mod.projector_kind is not None:
            # Small: it runs replicated, not tensor-parallel.
            p = projector_params(mod, out_hidden)
            if mod.projector_kind == "patch_merger":
                # Blocks of m^2 patches: m^2 h -> m^2 h -> LLM width, once per block.
                m2h, blocks = mod.native.merge_tokens * h, t / mod.native.merge_tokens
                g = self._gemm(blocks, m2h, m2h) + self._gemm(blocks, m2h, out_hidden)
                kept = t * h + blocks * (m2h + out_hidden)
            else:
                g = self._gemm(t, h, out_hidden) + (self._gemm(t, out_hidden, out_hidden)
                                                     if mod.projector_kind == "mlp" else 0.0)
                kept = t * (h + out_hidden)
            costs.append(LayerCost(g, g, g, mod.projector_frozen))
            weights.append(p)
            acts.append(kept * bpe)
            trans.append(0.0)
        result = (costs, weights, acts, trans)
        self._layers[key] = result
        return result

    def _tokens(self, mod: ModuleSpec, samples: float) -> tuple[float, float]:
        """Tokens of ``samples`` samples for this module, and keys per query."""
        if mod.is_language:
            return samples * self.work.seq_length, self.work.seq_length / 2.0
        return samples * self.work.items(mod.name) * mod.tokens_per_item, mod.keys_per_query

    def chain(self, mods: list[tuple[ModuleSpec, Par, float]], pp: int,
              fit: tuple[int, int, int, float] | None = None) -> Chain:
        """Modules in execution order (each with its layout and samples per
        microbatch), concatenated and cut into ``pp`` stages minimising the
        slowest stage (or as the last module's ``stage_layers`` cut it);
        pre/post layers stay with their neighbours. Modules
        before the last one (encoders inside the LLM's first stage, the
        homogeneous baseline) stay whole in stage 0 with at least one LLM
        layer: Megatron can shorten its first stage
        (``decoder_first_pipeline_num_layers``) but not move an encoder.

        ``fit`` = (behind, microbatches, shard, budget bytes), as
        ``chain_memory`` reads them: when the time-balanced split needs more
        than the budget on some stage, the split is the fastest one that
        fits, if any does. Early stages hold more 1F1B microbatches, so this
        moves layers to later stages, the layer balance a tuned run sets
        (``decoder_first_pipeline_num_layers`` / ``..._last_...``) instead
        of running out of memory."""
        key = (tuple((mod.name, par.tp, par.cp, par.sp, par.recompute, par.ep, par.etp, samples)
                     for mod, par, samples in mods),
               pp, mods[-1][1].stage_layers)
        if key not in self._chains:
            self._chains[key] = self._chain(mods, pp)
        balanced = self._chains[key]
        if fit is None or pp == 1 or mods[-1][1].stage_layers:
            return balanced
        behind, mb, shard, budget = fit
        if self.chain_memory(balanced, behind, mb, shard) <= budget:
            return balanced
        # (A hair of slack: stage sums here are prefix-sum differences, which
        # may round above the per-stage sums ``chain_memory`` adds.)
        limit = (budget - self.gpu.reserved_bytes) / ALLOCATOR_OVERHEAD * (1 + 1e-12)
        held = (*key, behind, mb, shard)
        if held not in self._stage_floor:
            # Whatever the split, the stages together hold every layer's state
            # and at least the last stage's count of microbatches of activations.
            least = sum(self.state_bytes(w, tr, shard) for w, tr in zip(balanced.weights, balanced.trainable)) \
                + max(1, min(1 + behind, mb)) * sum(balanced.activations)
            self._stage_floor[held] = least / pp
        if self._stage_floor[held] > limit:
            return balanced
        fitted = (*held, limit)
        if fitted not in self._chains:
            layers = self._concat(mods)
            if held not in self._stage_memory:
                self._stage_memory[held] = self._held(layers, pp, behind, mb, shard)
            sizes = partition(layers.items, pp, self._stage_memory[held], limit)
            self._chains[fitted] = balanced if sizes is None else self._cut(mods, layers, sizes)
        return self._chains[fitted]

    def _moe_layer(self, mod: ModuleSpec, par: Par, t: float, attn_f: float, attn_b: float, tp_one: float,
                   cp_f: float, cp_b: float) -> tuple[LayerCost, float, float, float]:
        """One mixture-of-experts layer on one rank: (cost, params, kept activation bytes per
        microbatch, transient bytes), for ``t`` tokens of the rank's CP chunk (attention's times
        as the dense layer's).

        The attention half is the dense layer's. The MLP half: the router on the rank's tokens
        (its SP shard with TP), each token's ``topk`` (token, expert) pairs sent to the experts'
        ranks and back by an all-to-all over the etp x ep group, forward and backward (on the
        intra-node links when the group fits in a node), the rank's ``E / ep`` experts (each cut by
        etp) on the pairs they receive (balanced routing: as many pairs as the rank sent, times
        etp), and the shared expert as a dense TP-split MLP. FLOPs count the active parameters;
        memory every expert the rank holds."""
        tp, etp, ep, bpe, ko = par.tp, par.etp, par.ep, self.bpe, self.gpu.kernel_overhead
        h, q = mod.hidden_size, mod.attention_width
        kv = mod.num_query_groups * mod.kv_channels
        seq_div = tp if par.sp else 1
        routed = t / seq_div                         # tokens this rank routes
        pairs = routed * mod.moe_topk * etp          # (token, expert) pairs this rank's experts run
        local = mod.num_experts // ep
        per_expert = pairs / local
        gate = 2 if mod.gated else 1
        fe, fs = mod.moe_ffn, mod.moe_shared_ffn
        qkv = self._gemm(t, h, (q + 2 * kv) / tp)
        attention_gemm = qkv + self._gemm(t, q / tp, h)
        expert_gemm = local * (self._gemm(per_expert, h, gate * fe / etp) + self._gemm(per_expert, fe / etp, h))
        shared_fc1 = self._gemm(t, h, gate * fs / tp) if fs else 0.0
        shared_gemm = shared_fc1 + (self._gemm(t, fs / tp, h) if fs else 0.0)
        router = self._gemm(routed, h, mod.num_experts)
        gemm = attention_gemm + router + expert_gemm + shared_gemm
        a2a = self.dispatch_time(routed * mod.moe_topk * h * bpe, etp * ep)
        # Layer norms and residuals on the (SP) tokens, the experts' activations on their pairs,
        # the permute / unpermute copies of the pairs, the shared expert's activation.
        ew = bpe * (8 * t * h / seq_div + 2 * pairs * (gate + 1) * fe / etp + 4 * pairs * h
                    + 2 * t * (gate + 1) * fs / tp) / self.hbm
        tp_b = self._tp_backward(tp_one, par.sp, (qkv,) + ((shared_fc1,) if fs else ()), mod.frozen)
        fwd = gemm + attn_f + ew + 4 * tp_one + cp_f + a2a + (30 + 4 * local) * ko
        bwd_in = gemm + attn_b + 2 * ew + tp_b + cp_b + a2a + (30 + 4 * local) * ko
        if par.recompute == "selective":
            bwd_in += attn_f
        elif par.recompute == "full":
            bwd_in += fwd              # the recomputed forward dispatches its tokens again
        router_p, experts_p, shared_p = mod.moe_mlp_params()
        params = (h * (q + 2 * kv) + q * h + shared_p) / tp + router_p + experts_p / (ep * etp) + 4 * h
        full_act = (t * ((4 * h * bpe + 2 * h) / seq_div + bpe * ((q + 2 * kv) + q + (gate + 1) * fs) / tp)
                    + routed * mod.num_experts * 4 + pairs * bpe * (2 * h + (gate + 1) * fe / etp))
        act = t * h * bpe / seq_div if par.recompute == "full" else full_act
        transient = full_act if par.recompute == "full" else 0.0
        return LayerCost(fwd, bwd_in, gemm + (15 + 2 * local) * ko, mod.frozen), params, act, transient

    def dispatch_time(self, nbytes: float, group: int) -> float:
        """One MoE layer's token dispatch and combine (forward, or the same again backward): two
        all-to-alls of the ``nbytes`` of (token, expert) pairs a rank routes over an expert group of
        ``group`` consecutive ranks, of which (group - 1) / group leave the rank; on the intra-node
        links while the group fits in a node."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        return 2 * ((group - 1) / group * nbytes / self.gpu.bus_bandwidth(group) + self.gpu.latency(group))

    def _expert_state(self, mod: ModuleSpec, par: Par) -> tuple[float, float]:
        """(weights, trainable) to add per MoE layer so that ``state_bytes(..., shard = dp * cp)``
        gives the rank's expert weights their true optimizer shard: megatron's distributed
        optimizer shards expert state over expert DP (tp * cp * dp / (etp * ep)), not over DP x CP.
        With r = (dp * cp) / edp, X local expert params cost X wb + X gb + X mb / edp when
        counted as r X trainable and (1 - r) X gb / wb extra weights. Zero without the
        distributed optimizer (no shard) or for frozen experts."""
        if not (mod.is_moe and self.dist_opt) or mod.frozen:
            return 0.0, 0.0
        local = mod.moe_mlp_params()[1] / (par.ep * par.etp)
        r = par.dp * par.cp / par.edp
        return local * (1 - r) * self.grad_bytes / self.weight_bytes, local * (r - 1)

    def _module_lists(self, mod: ModuleSpec, par: Par, samples: float, upstream: bool):
        """One module's per-layer forward, backward, weights, trainable
        weights, kept activations and transient bytes (pre/post layers folded
        into their neighbours), and whether its output carries a gradient.
        Cached: a layout search reuses each module layout many times."""
        key = (mod.name, par.tp, par.cp, par.sp, par.recompute, par.ep, par.etp, samples, upstream)
        hit = self._lists.get(key)
        if hit is not None:
            return hit
        tokens, span = self._tokens(mod, samples)
        costs, weights, acts, trans = self.module_layers(mod, par, tokens, span, self.spec.language.hidden_size)
        up = upstream or (self.llm_upstream if mod.is_language else False)
        bwd = backward_costs(costs, up)
        fwd = [c.forward for c in costs]
        keep = [a if b > 0 else 0.0 for a, b in zip(acts, bwd)]
        trainable = [0.0 if c.frozen else w for c, w in zip(costs, weights)]
        extra_w, extra_tr = self._expert_state(mod, par)
        if extra_tr:
            weights = list(weights)
            for i, moe in enumerate(mod.moe_layers, start=1):     # costs[0] is the embedding
                if moe:
                    weights[i] += extra_w
                    trainable[i] += extra_tr
        pre, post = 1, 1 if len(costs) > mod.num_layers + 1 else 0
        lists = [_fold(vals, pre, post) for vals in (fwd, bwd, weights, trainable, keep, trans)]
        hit = self._lists[key] = (lists, output_requires_grad(costs, up))
        return hit

    def _concat(self, mods) -> Layers:
        """The modules' layers end to end (cached per module layouts)."""
        key = tuple((mod.name, par.tp, par.cp, par.sp, par.recompute, par.ep, par.etp, samples)
                    for mod, par, samples in mods)
        if key in self._concats:
            return self._concats[key]
        f_all, b_all, w_all, tr_all, a_all, x_all = [], [], [], [], [], []
        upstream = False
        for mod, par, samples in mods:
            lists, upstream = self._module_lists(mod, par, samples, upstream)
            for lst, vals in zip((f_all, b_all, w_all, tr_all, a_all, x_all), lists):
                lst.extend(vals)
        last, last_par = mods[-1][0], mods[-1][1]
        if last.is_language and last.tie_embeddings:
            # The output layer reuses the embedding's weight in one stage;
            # `_chain` gives a pipelined last stage its copy back.
            shared = last.vocab_size * last.hidden_size / last_par.tp
            w_all[-1] -= shared
            if not last.frozen:
                tr_all[-1] -= shared
        layers = self._concats[key] = Layers(f_all, b_all, w_all, tr_all, a_all, x_all,
                                             len(f_all) - last.num_layers)
        return layers

    def _chain(self, mods, pp: int) -> Chain:
        layers = self._concat(mods)
        stage_layers = mods[-1][1].stage_layers
        return self._cut(mods, layers, list(stage_layers) if stage_layers else partition(layers.items, pp))

    @staticmethod
    def _cut(mods, layers: Layers, sizes) -> Chain:
        chain = layers.cut(sizes)
        last, last_par = mods[-1][0], mods[-1][1]
        if last.is_language and last.tie_embeddings and len(chain.weights) > 1:
            # Tied embeddings over several stages: the last stage holds (and steps) a copy.
            shared = last.vocab_size * last.hidden_size / last_par.tp
            chain.weights[-1] += shared
            if not last.frozen:
                chain.trainable[-1] += shared
        return chain

    def _held(self, layers: Layers, pp: int, behind: int, mb: int, shard: int) -> StageMemory:
        """What each partition item holds, for a split that must fit."""
        fixed = [self.state_bytes(w, tr, shard) for w, tr in zip(layers.weights, layers.trainable)]
        return StageMemory(_lead_item(fixed, layers.lead), _lead_item(layers.activations, layers.lead),
                           _lead_item(layers.transient, layers.lead, max),
                           [max(1, min(pp - i + behind, mb)) for i in range(pp)])

    # ---- memory ---------------------------------------------------------------
    def state_bytes(self, weights: float, trainable: float, shard: int) -> float:
        """Weights, gradient buffer and the optimizer's shard of ``weights``
        parameters (``trainable`` of them trained)."""
        opt = self.master_bytes / (shard if self.dist_opt else 1)
        return weights * self.weight_bytes + trainable * (self.grad_bytes + opt)

    def stage_memory(self, ch: Chain, i: int, in_flight: int, shard: int) -> float:
        states = self.state_bytes(ch.weights[i], ch.trainable[i], shard)
        return (states + ch.activations[i] * in_flight + ch.transient[i]) * ALLOCATOR_OVERHEAD \
            + self.gpu.reserved_bytes

    def chain_memory(self, ch: Chain, behind: int, mb: int, shard: int) -> float:
        key = (id(ch), behind, mb, shard)
        if key not in self._memory:
            p = len(ch.forward)
            self._memory[key] = max(self.stage_memory(ch, i, max(1, min(p - i + behind, mb)), shard)
                                    for i in range(p))
        return self._memory[key]

    # ---- time -----------------------------------------------------------------
    def update_time(self, ch: Chain, par: Par) -> float:
        """Exposed distributed-optimizer traffic and the Adam step of the
        busiest stage. Gradients are reduce-scattered in the buffer's dtype
        and bf16 weights all-gathered; as in a tuned run
        (``overlap_grad_reduce`` / ``overlap_param_gather``), the
        reduce-scatter overlaps the last backward and the all-gather the
        first forward; only what they cannot hide is exposed."""
        group = par.dp * par.cp
        span = par.tp * group
        key = (id(ch), group, span)
        if key not in self._updates:
            self._updates[key] = self._update_time(ch, group, span)
        return self._updates[key]

    def _update_time(self, ch: Chain, group: int, span: int) -> float:
        trainable = max(ch.trainable)
        if trainable <= 0:
            return 0.0
        reduce = self._ring(self.grad_bytes * trainable, group, span)
        if self.dist_opt:
            gather = self._ring(self.weight_bytes * trainable, group, span)
            exposed = max(0.0, reduce - ch.backward[-1]) + max(0.0, gather - ch.forward[0])
            shard = group
        else:
            exposed = max(0.0, 2 * reduce - ch.backward[-1])    # all-reduce
            shard = 1
        # Adam reads and writes its state and writes the bf16 weights back.
        adam = trainable / shard * (2 * self.master_bytes + self.weight_bytes) / self.hbm
        return exposed + adam

    def _p2p(self, nbytes: float, span: int) -> float:
        return nbytes / self.gpu.bus_bandwidth(span) + self.gpu.latency(span)

    def pipeline(self, stages: list[float], mb: int, hop: float) -> float:
        return sum(stages) + (mb - 1) * max(stages) + 2 * (len(stages) - 1) * hop

    def _llm_hop(self, par: Par) -> float:
        act = self.m * self.work.seq_length / par.cp * self.spec.language.hidden_size * self.bpe
        return self._p2p(act / (par.tp if par.sp else 1), 2 * par.tp * par.cp * par.dp)

    # ---- placements ---------------------------------------------------------------
    def evaluate(self, placement: str, pars: Mapping[str, Par], fit_memory: bool = True) -> Estimate:
        """``homogeneous`` builds Megatron's baseline from the LLM's layout
        (its layers split as a tuned run splits them, to fit memory where
        needed); otherwise the encoders' own rank ranges say where each one
        runs, and ``fit_memory`` says whether the LLM's split may move
        layers to fit memory (a search, which writes the split it costed
        into the config) or not (a config costed as written)."""
        if placement == "homogeneous":
            return self.homogeneous(pars)
        return self.heterogeneous(pars, fit_memory)

    def _estimate(self, placement, step, modules, gpus, update, llm_stages, moved=False) -> Estimate:
        return Estimate(placement, step, max(modules.values()), modules,
                        self.g * self.work.seq_length / step, gpus, update, tuple(llm_stages), moved)

    def homogeneous(self, pars: Mapping[str, Par]) -> Estimate:
        lp = pars["language"]
        mb = self.g // (self.m * lp.dp)
        mods = [(e, Par(lp.tp, lp.cp, 1, lp.dp, pars[e.name].sp, pars[e.name].recompute), self.m)
                for e in self.spec.encoders]
        ch = self.chain(mods + [(self.spec.language, lp, self.m)], lp.pp,
                        (0, mb, lp.dp * lp.cp, self.gpu.memory_bytes))
        update = self.update_time(ch, lp)
        step = self.pipeline(ch.total, mb, self._llm_hop(lp)) + update
        mem = self.chain_memory(ch, 0, mb, lp.dp * lp.cp)
        encoder_layers = sum(e.num_layers for e in self.spec.encoders)
        llm_stages = [ch.sizes[0] - encoder_layers, *ch.sizes[1:]]
        return self._estimate("homogeneous", step, {n: mem for n in pars}, lp.size, update, llm_stages)

    def llm_chain(self, lp: Par, others: float = 0.0, fit_memory: bool = True) -> Chain:
        """The LLM's stages on its ranks; with ``fit_memory``, split to fit
        the GPU's memory beside ``others`` bytes (colocated encoders) where
        the balanced split does not."""
        mb = self.g // (self.m * lp.dp)
        fit = (0, mb, lp.dp * lp.cp, self.gpu.memory_bytes - others) if fit_memory else None
        return self.chain([(self.spec.language, lp, self.m)], lp.pp, fit)

    def encoder_chain(self, e: ModuleSpec, par: Par, samples: float) -> Chain:
        return self.chain([(e, par, samples)], par.pp)

    def heterogeneous(self, pars: Mapping[str, Par], fit_memory: bool = True) -> Estimate:
        """Encoders on the LLM's ranks run colocated (three phases around the
        LLM's 1F1B); the others run on their islands (encoders sharing a rank
        range), pipelined into the LLM. Any island makes the placement
        ``non-colocated`` (with colocated encoders too, a mixed placement)."""
        lp = pars["language"]
        mb = self.g // (self.m * lp.dp)
        on_llm, islands = [], {}
        for e in self.spec.encoders:
            ep = pars[e.name]
            if ep.rank_offset == lp.rank_offset and ep.size == lp.size:
                on_llm.append(e)
            else:
                islands.setdefault(ep.ranks, []).append(e)
        placement = "non-colocated" if islands else "colocated"
        phases, enc_updates, enc_mem = self._colocated_encoders(on_llm, pars, lp, mb)
        llm = self.llm_chain(lp, enc_mem, fit_memory)
        # The LLM's ranks update the LLM, then their colocated encoders.
        update = self.update_time(llm, lp) + enc_updates
        llm_mem = self.chain_memory(llm, 0, mb, lp.dp * lp.cp) + enc_mem
        modules = {"language": llm_mem, **{e.name: llm_mem for e in on_llm}}
        stages = list(llm.total)
        fill = sum(llm.total)
        for island, encs in islands.items():
            fill_e, island_stages, mem, u = self._island(encs, pars, lp, mb)
            fill = max(fill, fill_e + sum(llm.total))
            stages += island_stages
            update = max(update, u)
            for e in encs:
                modules[e.name] = mem
        step = fill + (mb - 1) * max(stages) + 2 * (lp.pp - 1) * self._llm_hop(lp) + phases + update
        # Layouts leave no rank idle (``layout_rule_errors``): the last rank used is the GPU count.
        gpus = max(r.stop for r in (lp.ranks, *islands))
        moved = llm.sizes != self.llm_chain(lp, fit_memory=False).sizes
        return self._estimate(placement, step, modules, gpus, update, llm.sizes, moved)

    def _busiest(self, e: ModuleSpec, samples: float, dp: int, windows: float = 1.0) -> float:
        """Samples' worth of items per window on an encoder's busiest DP rank,
        when ``windows`` windows of ``samples`` samples each have their items
        dealt over the ``dp`` ranks together: items go whole (an image is not
        cut), so the busiest rank holds the ceiling of its share."""
        per_sample = self.work.items(e.name)
        if per_sample <= 0:
            return samples / dp
        return math.ceil(samples * windows * per_sample / dp - 1e-9) / (windows * per_sample)

    def _colocated_encoders(self, encs, pars, lp: Par, mb: int) -> tuple[float, float, float]:
        """Time the encoder phases of the three-phase schedule add to the
        step, the encoders' updates, and their memory on the LLM's ranks."""
        window = min(lp.pp, mb)
        step = update = mem = 0.0
        for e in encs:
            ep = pars[e.name]
            # The step's items, one window of LLM microbatches at a time, on
            # the encoder's busiest DP rank (mimo deals the whole step's items
            # over the encoder's ranks at once).
            samples = self._busiest(e, window * self.m * lp.dp, ep.dp, mb / window)
            ch = self.encoder_chain(e, ep, samples)
            hop = self._p2p(samples * self._tokens(e, 1)[0] * e.hidden_size * self.bpe, 2 * ep.tp * ep.dp)
            # Each window: the encoder's forward, later its backward, through
            # its own pipeline (one chunk, so no overlap between its stages).
            step += mb / window * (sum(ch.forward) + sum(ch.backward) + 2 * (ep.pp - 1) * hop)
            update += self.update_time(ch, ep)
            mem += self.chain_memory(ch, 0, 1, ep.dp * ep.cp) - self.gpu.reserved_bytes
        return step, update, mem

    def _island(self, encs, pars, lp: Par, mb: int) -> tuple[float, list[float], float, float]:
        """One island's pipeline fill, its stage times (encoders sharing it
        add up on the ranks they share: with depths p_e under the island's
        deepest P, island stage i runs stage i * p_e // P of each), its peak
        memory and its slowest update."""
        depth = max(pars[e.name].pp for e in encs)
        # Each LLM microbatch's items, dealt over the encoder's DP ranks.
        samples = {e.name: self._busiest(e, self.m * lp.dp, pars[e.name].dp) for e in encs}
        chains = [(e, self.encoder_chain(e, pars[e.name], samples[e.name])) for e in encs]
        stages = [sum(c.total[i * pars[e.name].pp // depth] for e, c in chains) for i in range(depth)]
        size = len(pars[encs[0].name].ranks)
        boundary = sum(self._p2p(samples[e.name] * self.work.items(e.name) * e.llm_tokens_per_item
                                 * self.spec.language.hidden_size * self.bpe, 2 * size + lp.size)
                       for e in encs)
        mem = sum(self.chain_memory(c, lp.pp, mb, pars[e.name].dp * pars[e.name].cp)
                  - self.gpu.reserved_bytes for e, c in chains) + self.gpu.reserved_bytes
        update = max(self.update_time(c, pars[e.name]) for e, c in chains)
        return sum(stages) + 2 * boundary, stages, mem, update


# ---- helpers ----------------------------------------------------------------------
def _fold(values, pre: int, post: int) -> list[float]:
    core = list(values[pre:len(values) - post])
    core[0] += sum(values[:pre])
    if post:
        core[-1] += sum(values[len(values) - post:])
    return core


def _lead_item(values, lead: int, join=sum) -> list[float]:
    """``values`` with the first ``lead + 1`` entries joined into one item."""
    return [join(values[:lead + 1])] + list(values[lead + 1:])


def _sum_lists(a, b) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def _bounds(sizes):
    i = 0
    for s in sizes:
        yield i, i + s
        i += s


def _stages(values, sizes) -> list[float]:
    if len(sizes) == 1:
        return [sum(values)]
    return [sum(values[i:j]) for i, j in _bounds(sizes)]
