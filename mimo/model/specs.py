"""Transformer layer specs built from megatron-core's local (non-TE) modules."""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from mimo.config.kernel import KernelConfig
from mimo.config.validate import grouped_gemm_problem
from mimo.runtime.fusions import active as active_fusions

from .expert_linear import ExpertRowParallelLinear
from .grouped_experts import GroupedExperts
from .norm import TorchNorm
from .sdpa_attention import SDPACoreAttention


def core_attention_class(kind: str, kernel: Optional[Dict[str, int]] = None):
    """The core attention module of `kind`; `kernel`: the bitfield kernels' KernelConfig fields (a
    config's `attention_kernel`), bound to the module."""
    if kind == "sdpa":
        return SDPACoreAttention
    if kind == "bitfield":
        from mimo.attention.core_attention import BitfieldCoreAttention

        if kernel:
            return functools.partial(BitfieldCoreAttention, kernel_config=KernelConfig(**kernel))
        return BitfieldCoreAttention
    raise ValueError(f"unknown attention kind {kind!r} (sdpa | bitfield)")


def mlp_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def encoder_layer_spec(attention: str = "sdpa", kernel: Optional[Dict[str, int]] = None) -> ModuleSpec:
    """Pre-norm transformer layer with bidirectional self-attention (modality encoders)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention_class(attention, kernel),
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=mlp_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def llm_layer_spec(attention: str = "sdpa", normalization: str = "LayerNorm",
                   num_experts: Optional[int] = None, qk_layernorm: bool = False,
                   kernel: Optional[Dict[str, int]] = None) -> ModuleSpec:
    """megatron's local GPT layer with the core attention swapped for ours; with `num_experts` its
    MLP is megatron-core's MoELayer (router, token dispatcher, SequentialMLP experts, shared expert);
    with `qk_layernorm` q and k are normalised per head (Qwen3) by our torch norm."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization,
                                    qk_layernorm=qk_layernorm)
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = core_attention_class(attention, kernel)
    if num_experts:
        spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertRowParallelLinear
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = TorchNorm
    # torch norms that may run sequence parallel (see mimo.model.norm)
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    return spec


def grouped_experts(lang, config) -> bool:
    """Whether an MoE LLM's routed experts run as `GroupedExperts` (docs/moe.md): with
    `moe_grouped_gemm: true` always (the config check vouched for the shapes), with `auto` where this
    process's runtime has torch's grouped GEMM, the weights are bf16 (the dtype its GPU kernel takes)
    and the shapes allow it."""
    if lang.moe_grouped_gemm != "auto":
        return lang.moe_grouped_gemm is True
    fits = grouped_gemm_problem(config.hidden_size, config.moe_ffn_hidden_size,
                                config.expert_tensor_parallel_size, config.add_bias_linear) is None
    return active_fusions().grouped_gemm and fits and bool(config.bf16) and not (config.fp8 or config.fp4)


def llm_block_layer_specs(lang, first_layer: int, count: int, config) -> List[ModuleSpec]:
    """The layer specs of global LLM layers [first_layer, first_layer + count): MoE or dense per
    `lang.moe_layers()` (megatron-core's `moe_layer_freq`); `config` the LLM's TransformerConfig."""
    moe = lang.moe_layers()[first_layer:first_layer + count]
    qk = bool(getattr(lang, "qk_layernorm", False))
    dense = llm_layer_spec(lang.attention, lang.normalization, qk_layernorm=qk, kernel=lang.attention_kernel)
    if not any(moe):
        return [dense] * count
    sparse = llm_layer_spec(lang.attention, lang.normalization, num_experts=lang.num_moe_experts, qk_layernorm=qk,
                            kernel=lang.attention_kernel)
    if grouped_experts(lang, config):
        sparse.submodules.mlp.submodules.experts.module = GroupedExperts
    return [sparse if m else dense for m in moe]
