"""Which megatron-core fused kernels this process's runtime can run (docs/training.md, "Fused kernels on CUDA").

`transformer_config` asks `fusion_flags` for the TransformerConfig fusion fields of a module; the
answer depends on the runtime `setup_megatron` activated for this process (`activate`), and is
all-off until one is activated and on CPU ranks, so CPU runs stay exact and unchanged.

* bias-GELU / bias-SwiGLU and bias-dropout-add: megatron's `jit_fuser` functions (torch.compile
  on a GPU) — on for every CUDA runtime. megatron's fused bias-GELU is the tanh approximation of
  GELU: on a GPU a module with `activation: gelu` (exact) computes tanh-GELU (docs/training.md).
* RoPE fusion: Transformer Engine's fused rotary kernel — only where TE is importable (not for
  M-RoPE, whose fused path megatron restricts).
* gradient-accumulation fusion: apex's `fused_weight_gradient_mlp_cuda` extension (what megatron's
  tensor-parallel linears import) — only where it is importable. Not exercised by any run yet (no
  apex on the machines this was built and measured on).
* masked-softmax fusion: apex's `scaled_masked_softmax_cuda` — only where it is importable (mimo's
  own core attention, SDPA or bitfield, does not read it).
* fused Adam / AdamW: torch's single-kernel optimizer step (`fused=True`) for the torch optimizer
  megatron-core builds when neither Transformer Engine nor apex is installed — on every CUDA runtime
  (`mimo.training.optimizer.use_fused_adam`). With TE or apex megatron already uses their fused Adam.
* grouped GEMM for routed experts (`model.language.moe_grouped_gemm: auto`): torch's
  `_grouped_mm` — on CUDA devices of compute capability 9.0 or newer (Hopper, Blackwell), where
  torch ships its grouped kernel.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .device import Runtime


@dataclass(frozen=True)
class FusionSupport:
    """What a runtime can fuse: `jit` megatron's jit_fuser kernels (CUDA), `rope` TE's fused RoPE,
    `grad_accum` the fused weight-gradient accumulation, `masked_softmax` apex's softmax kernels,
    `grouped_gemm` torch's grouped GEMM for routed experts, `fused_adam` torch's fused Adam step."""

    jit: bool = False
    rope: bool = False
    grad_accum: bool = False
    masked_softmax: bool = False
    grouped_gemm: bool = False
    fused_adam: bool = False


NONE = FusionSupport()

_active: FusionSupport = NONE


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _te_rope_available() -> bool:
    try:
        from megatron.core.models.common.embeddings.rope_utils import fused_apply_rotary_pos_emb
    except ImportError:
        return False
    return fused_apply_rotary_pos_emb is not None


def fusion_support(runtime: Runtime) -> FusionSupport:
    """The fusions `runtime` supports: none on CPU; on CUDA the jit_fuser ones, plus the kernels of
    Transformer Engine / apex that this installation has."""
    if not runtime.is_cuda:
        return NONE
    return FusionSupport(jit=True, rope=_te_rope_available(),
                         grad_accum=_importable("fused_weight_gradient_mlp_cuda"),
                         masked_softmax=_importable("scaled_masked_softmax_cuda"),
                         grouped_gemm=_grouped_gemm_available(runtime), fused_adam=True)


def _grouped_gemm_available(runtime: Runtime) -> bool:
    return (hasattr(torch, "_grouped_mm") and torch.cuda.is_available()
            and torch.cuda.get_device_capability(runtime.device) >= (9, 0))


def activate(runtime: Optional[Runtime]) -> None:
    """Make `runtime`'s fusions the ones `fusion_flags` answers with (None: back to all-off)."""
    global _active
    _active = NONE if runtime is None else fusion_support(runtime)


def active() -> FusionSupport:
    return _active


def bias_activation_fusable(activation_func, gated: bool, add_bias_linear: bool, moe: bool = False) -> bool:
    """Whether megatron's MLP has a fused path for this activation: GELU with a bias (not gated;
    tanh-approximated), GELU-gated (GeGLU) or SiLU-gated (SwiGLU). MoE experts keep the unfused
    path (their per-token-scaled variants cover fewer activations)."""
    if moe:
        return False
    if activation_func is F.gelu:
        return gated or add_bias_linear
    return activation_func is F.silu and gated


def fusion_flags(support: FusionSupport, activation_func=F.gelu, gated: bool = False,
                 add_bias_linear: bool = True, mrope: bool = False, moe: bool = False) -> dict:
    """TransformerConfig's fusion fields for one module given what the runtime supports."""
    return dict(
        masked_softmax_fusion=support.masked_softmax,
        bias_activation_fusion=support.jit and bias_activation_fusable(activation_func, gated, add_bias_linear, moe),
        bias_dropout_fusion=support.jit,
        apply_rope_fusion=support.rope and not mrope,
        persist_layer_norm=False,  # apex's persistent LayerNorm kernel; mimo's norms are megatron's own
        gradient_accumulation_fusion=support.grad_accum,
    )
