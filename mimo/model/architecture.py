"""Config-driven architecture options: norms, activations, biases, RoPE, tied embeddings.

The defaults of the config fields reproduce mimo's original models (LayerNorm,
GELU, biases everywhere, RoPE theta 10000, untied embeddings); Hugging Face
models set them from their config.json (mimo.config.hf_arch).
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


# name -> (activation function, gated): swiglu is silu(gate) * up in megatron's gated MLP.
ACTIVATION_FUNCS = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (gelu_tanh, False),
    "quick_gelu": (quick_gelu, False),
    "silu": (F.silu, False),
    "relu": (F.relu, False),
    "swiglu": (F.silu, True),
}


def architecture_kwargs(module_cfg) -> Dict:
    """TransformerConfig arguments for one module's architecture fields."""
    act, gated = ACTIVATION_FUNCS[getattr(module_cfg, "activation", "gelu")]
    bias = getattr(module_cfg, "add_bias_linear", True)
    qkv_bias = getattr(module_cfg, "qkv_bias", None)
    return dict(
        normalization=getattr(module_cfg, "normalization", "LayerNorm"),
        layernorm_epsilon=getattr(module_cfg, "norm_eps", 1e-5),
        activation_func=act,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        add_qkv_bias=bias if qkv_bias is None else qkv_bias,
        kv_channels=getattr(module_cfg, "kv_channels", None),
        # Qwen3's per-head q/k RMSNorm (megatron marks those weights for the TP gradient sum).
        qk_layernorm=bool(getattr(module_cfg, "qk_layernorm", False)),
    )


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Dict[str, float]) -> torch.Tensor:
    """Llama-3 RoPE frequency scaling, with all four parameters from the config
    (megatron's own version fixes three of them)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def gpt_model_kwargs(lang) -> Dict:
    # mrope: megatron's MultimodalRotaryEmbedding, fed [3, b, s] position ids (mimo.data.mrope); its
    # split of the rotary dims (mrope_section) is a TransformerConfig field (`mrope_section`).
    kind = "mrope" if getattr(lang, "position_embedding", "rope") == "mrope" else "rope"
    return dict(share_embeddings_and_output_weights=lang.tie_embeddings, position_embedding_type=kind,
                rotary_base=lang.rope_theta)


def mrope_kwargs(module_cfg) -> Dict:
    """TransformerConfig's `mrope_section` for an M-RoPE LLM (nothing for any other module)."""
    if getattr(module_cfg, "position_embedding", None) != "mrope":
        return {}
    return dict(mrope_section=list(module_cfg.mrope_section))


def finish_llm(model: torch.nn.Module, lang) -> None:
    """Post-construction details megatron's constructor has no argument for."""
    rope = getattr(model, "rotary_pos_emb", None)
    if getattr(model, "position_embedding_type", None) == "mrope":
        # Under context parallelism mimo hands each rank its own tokens' position ids
        # (`shard_microbatch`), so the rotary table is already this rank's; megatron's own CP slice
        # (taken when its rotary module holds a CP group of more than one rank) must not cut it again.
        rope.cp_group = None
    if rope is not None and lang.rope_scaling is not None:
        rope.inv_freq = llama3_inv_freq(rope.inv_freq, lang.rope_scaling)
