"""Analytical per-layer cost model for one module under (TP, CP).

Each layer is reduced to FLOPs, HBM bytes and collective volumes for one
microbatch on one rank; time is a roofline (compute vs memory bound) plus
the collectives the layer cannot overlap. Modelled collectives:

* TP (Megatron without sequence parallelism): two all-reduces of the layer
  activations in forward and two in backward per transformer layer.
* CP (all-gather ring as in Llama-3 / Cornstarch): K and V of the whole
  sequence gathered in forward, their gradients reduce-scattered in backward.

Layer-type scale factors fitted by least squares against measured timings
(Entrain section 4.4.1) absorb what the roofline misses (kernel launch,
imperfect overlap, non-GEMM kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from mimo.planner.costs import LayerCost
from mimo.planner.hardware import GpuSpec
from mimo.planner.spec import ModuleSpec

COLLECTIVE_LATENCY_S = 10e-6
# FlashAttention's backward recomputes scores and does two more GEMMs.
ATTENTION_BACKWARD_RATIO = 2.5


@dataclass(frozen=True)
class Workload:
    """What one sample asks of each module: LLM tokens and encoder items."""
    seq_length: int
    items_per_sample: Mapping[str, float] = field(default_factory=dict)

    def items(self, encoder: str) -> float:
        return float(self.items_per_sample.get(encoder, 1.0))


@dataclass(frozen=True)
class LayerWork:
    kind: str                 # embedding | transformer | moe | head | patch_embed | projector
    frozen: bool
    fwd_flops: float
    bwd_input_flops: float
    bwd_weight_flops: float
    bytes_moved: float        # HBM traffic of one forward
    fwd_comm_s: float
    bwd_comm_s: float
    params: float             # parameters held by one rank
    activation_bytes: float   # saved for backward, one microbatch


@dataclass
class Calibration:
    """Multiplicative correction per layer type (1.0 when never measured)."""
    scales: dict[str, float] = field(default_factory=dict)

    def scale(self, kind: str) -> float:
        return self.scales.get(kind, 1.0)


def fit_scale(pairs: Iterable[tuple[float, float]]) -> float:
    """Least-squares ``s`` minimising sum (measured - s * predicted)^2."""
    num = den = 0.0
    for predicted, measured in pairs:
        num += predicted * measured
        den += predicted * predicted
    if den == 0.0:
        raise ValueError("no non-zero predictions to calibrate against")
    return num / den


def projector_params(module: ModuleSpec, out: int) -> float:
    """Weights of an encoder's projector into the LLM width ``out``: linear (h -> out), mlp
    (h -> out -> out), patch_merger (m^2 h -> m^2 h -> out over blocks of m^2 patches)."""
    h = module.hidden_size
    if module.projector_kind == "patch_merger":
        m2h = module.native.merge_tokens * h
        return m2h * m2h + m2h * out
    return h * out + (out * out if module.projector_kind == "mlp" else 0)


def projector_flops_per_token(module: ModuleSpec, out: int) -> float:
    """Forward matmul FLOPs of the projector per encoder token (the merger runs once per m^2 patches)."""
    merge = module.native.merge_tokens if module.projector_kind == "patch_merger" else 1
    return 2 * projector_params(module, out) / merge


def _allreduce_s(nbytes: float, group: int, bw: float) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (group - 1) / group * nbytes / bw + COLLECTIVE_LATENCY_S


def _allgather_s(total_bytes: float, group: int, bw: float) -> float:
    if group <= 1 or total_bytes <= 0:
        return 0.0
    return (group - 1) / group * total_bytes / bw + COLLECTIVE_LATENCY_S


class CostModel:
    def __init__(self, gpu: GpuSpec, precision: str = "bf16", calibration: Calibration | None = None):
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"precision: expected bf16 or fp32, got {precision!r}")
        self.gpu = gpu
        self.precision = precision
        self.bpe = 2 if precision == "bf16" else 4
        # fp32 GEMMs run as TF32 at roughly half the bf16 rate.
        self.flops = gpu.effective_flops * (1.0 if precision == "bf16" else 0.5)
        self.calibration = calibration or Calibration()

    # ---- work -----------------------------------------------------------
    def module_work(self, module: ModuleSpec, tp: int, cp: int, samples: float,
                    workload: Workload, projector_out: int | None = None) -> list[LayerWork]:
        """Every layer of a module in execution order, for ``samples`` samples
        of one microbatch on one (TP, CP) rank. ``projector_out`` is the LLM
        hidden size an encoder's projector maps into."""
        if module.is_language:
            seq = workload.seq_length
            tokens = samples * seq
            causal = 0.5
        else:
            tokens = samples * workload.items(module.name) * module.tokens_per_item
            seq = module.keys_per_query   # a native ViT's window layers see less than the whole image
            causal = 1.0
        local = tokens / cp
        gpu, bpe = self.gpu, self.bpe
        tp_bw = gpu.link_bandwidth(tp)
        cp_bw = gpu.link_bandwidth(tp * cp)
        h, f = module.hidden_size, module.ffn_hidden_size
        q, fc1 = module.attention_width, module.mlp_in_width
        kv = module.num_query_groups * module.kv_channels
        layers: list[LayerWork] = []

        if module.is_language:
            v = module.vocab_size
            layers.append(LayerWork(
                "embedding", module.frozen, 0.0, 0.0, 0.0, 2 * local * h * bpe,
                _allreduce_s(local * h * bpe, tp, tp_bw), 0.0, v * h / tp, 0.0))
        else:
            feats = module.input_features
            gemm = 2 * local * feats * h
            layers.append(LayerWork(
                "patch_embed", module.frozen, gemm, 0.0, gemm, local * (feats + h) * bpe,
                0.0, 0.0, feats * h, local * feats * bpe))

        lin_params = h * (q + 2 * kv) + q * h + h * fc1 + f * h
        lin = 2 * local * lin_params
        attn = 4 * local * seq * q * causal
        layer_ar = 2 * _allreduce_s(local * h * bpe, tp, tp_bw)
        kv_bytes = 2 * tokens * kv / tp * bpe
        cp_comm = _allgather_s(kv_bytes, cp, cp_bw)
        transformer = LayerWork(
            "transformer", module.frozen,
            (lin + attn) / tp,
            (lin + ATTENTION_BACKWARD_RATIO * attn) / tp,
            lin / tp,
            lin_params / tp * bpe + local * bpe * (8 * h + (2 * h + 2 * q + 2 * kv + fc1 + f) / tp),
            layer_ar + cp_comm,
            layer_ar + cp_comm,
            (lin_params + 4 * h) / tp,
            local * bpe * (5 * h + (h + q + 2 * kv + fc1 + f) / tp),
        )
        if module.is_moe:
            moe = self._moe_work(module, tp, local, attn, layer_ar + cp_comm)
            layers.extend(moe if m else transformer for m in module.moe_layers)
        else:
            layers.extend([transformer] * module.num_layers)

        if module.is_language:
            v = module.vocab_size
            gemm = 2 * local * h * v / tp
            layers.append(LayerWork(
                "head", module.frozen, gemm + 5 * local * v / tp, gemm, gemm,
                v * h / tp * bpe + 3 * local * v / tp * 4,
                3 * _allreduce_s(local * 4, tp, tp_bw),
                _allreduce_s(local * h * bpe, tp, tp_bw),
                v * h / tp, local * (h * bpe + v / tp * 4)))
        elif module.projector_kind is not None:
            # The projector lands in the LLM's width; it is small, so it runs
            # replicated rather than tensor-parallel.
            out = projector_out or h
            p = projector_flops_per_token(module, out) / 2
            params = projector_params(module, out)
            gemm = 2 * local * p
            layers.append(LayerWork(
                "projector", module.projector_frozen, gemm, gemm, gemm,
                params * bpe + local * (h + out) * bpe, 0.0, 0.0, params, local * (h + out) * bpe))
        return layers

    def _moe_work(self, module: ModuleSpec, tp: int, local: float, attn: float, comm: float) -> LayerWork:
        """A mixture-of-experts layer at ep = etp = 1 (this search does not split experts; the
        layout search in ``layout_search`` does): FLOPs of the ACTIVE parameters (attention,
        router, top-k experts, shared expert), every expert's weights on every rank (megatron-core
        does not split experts over TP: each TP rank runs whole experts on its sequence shard)."""
        h, q, bpe = module.hidden_size, module.attention_width, self.bpe
        kv = module.num_query_groups * module.kv_channels
        attention_params = h * (q + 2 * kv) + q * h
        router, experts, shared = module.moe_mlp_params()
        active = attention_params + router + experts * module.moe_topk / module.num_experts + shared
        lin = 2 * local * active
        gate = 2 if module.gated else 1
        pairs = local * module.moe_topk
        params = (attention_params + shared) / tp + router + experts + 4 * h
        return LayerWork(
            "moe", module.frozen,
            (lin + attn) / tp,
            (lin + ATTENTION_BACKWARD_RATIO * attn) / tp,
            lin / tp,
            params * bpe + local * bpe * (8 * h + (2 * q + 2 * kv) / tp) + 2 * pairs * bpe * (h + (gate + 1) * module.moe_ffn) / tp,
            comm, comm, params,
            local * bpe * (5 * h + (q + 2 * kv) / tp) + pairs * bpe * (2 * h + (gate + 1) * module.moe_ffn) / tp)

    # ---- time -----------------------------------------------------------
    def _roof(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.gpu.memory_bandwidth)

    def layer_cost(self, w: LayerWork) -> LayerCost:
        s = self.calibration.scale(w.kind)
        return LayerCost(
            forward=s * (self._roof(w.fwd_flops, w.bytes_moved) + w.fwd_comm_s),
            backward_input=s * ((self._roof(w.bwd_input_flops, w.bytes_moved) if w.bwd_input_flops else 0.0)
                                + w.bwd_comm_s),
            backward_weight=s * (self._roof(w.bwd_weight_flops, 0.5 * w.bytes_moved) if w.bwd_weight_flops else 0.0),
            frozen=w.frozen,
        )

    def module_costs(self, module: ModuleSpec, tp: int, cp: int, samples: float,
                     workload: Workload, projector_out: int | None = None) -> list[LayerCost]:
        return [self.layer_cost(w)
                for w in self.module_work(module, tp, cp, samples, workload, projector_out)]


@dataclass(frozen=True)
class Measurement:
    """One measured layer timing (seconds, forward + full backward)."""
    module: str
    layer: str          # layer type, e.g. transformer
    tp: int
    cp: int
    samples: float
    seconds: float


def calibrate(model: CostModel, spec_modules: Mapping[str, ModuleSpec], workload: Workload,
              measurements: Sequence[Measurement], projector_out: int | None = None) -> Calibration:
    """Fit one scale factor per layer type from measured timings."""
    raw = CostModel(model.gpu, model.precision)
    pairs: dict[str, list[tuple[float, float]]] = {}
    for m in measurements:
        if m.module not in spec_modules:
            raise ValueError(f"measurement for unknown module {m.module!r}")
        works = raw.module_work(spec_modules[m.module], m.tp, m.cp, m.samples, workload, projector_out)
        match = [w for w in works if w.kind == m.layer]
        if not match:
            raise ValueError(f"module {m.module!r} has no layer of type {m.layer!r}")
        predicted = raw.layer_cost(match[0]).full
        pairs.setdefault(m.layer, []).append((predicted, m.seconds))
    return Calibration({kind: fit_scale(p) for kind, p in pairs.items()})
