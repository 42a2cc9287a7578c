"""Architecture fields from a Hugging Face `config.json` (no weights, no transformers import).

`resolve_hf(raw)` fills the YAML fields of every module that names an HF
directory (`model.hf`, `model.language.hf`, `model.encoders.<name>.hf`) from
that directory's config.json. A field the YAML also gives must agree, else it
is a config problem naming the field, so a typo cannot silently build a model
the weights do not fit. The exceptions are preprocessing choices the weights
do not fix (a native-resolution encoder's min_pixels / max_pixels): the YAML
may override those.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Tuple

Problem = Tuple[str, str]

LLM_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3_moe", "mixtral")
# Mixture-of-experts causal LMs (docs/moe.md): their routed experts become megatron-core MoE layers.
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
VISION_TYPES = ("clip", "clip_vision_model", "siglip", "siglip_vision_model")
AUDIO_TYPES = ("whisper",)
LLAVA_TYPES = ("llava",)
# Qwen2-VL / Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration).
QWEN_VL_TYPES = ("qwen2_5_vl", "qwen2_vl")
MULTIMODAL_TYPES = LLAVA_TYPES + QWEN_VL_TYPES
# The encoder a multimodal directory fills (model.hf -> language, images + projector).
LLAVA_ENCODER = "images"
# transformers' Qwen2-VL defaults where a config.json leaves a field out.
QWEN_VL_TEXT_THETA = 1000000.0
QWEN_VL_MROPE_SECTION = [16, 24, 24]
QWEN_VL_VISION_THETA = 10000.0
QWEN_VL_IMAGE_TOKEN = 151655

_ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}


class HFConfigProblem(ValueError):
    """An HF config mimo cannot use; `field` is the dotted YAML path it is reported under."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


def read_hf_config(directory: str, field: str) -> Dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFConfigProblem(field, f"no such directory: {directory}")
    if not os.path.isfile(path):
        raise HFConfigProblem(field, f"no config.json in {directory}")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise HFConfigProblem(field, f"{path}: unreadable ({exc})")
    if not isinstance(config, dict):
        raise HFConfigProblem(field, f"{path}: expected a JSON object, got {type(config).__name__}")
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        # Its tensors have the shapes of the real weights, but hold quantized values and scales that
        # the import would copy as they are: refused, not silently trained from.
        raise HFConfigProblem(field, f"{path}: quantization_config ({method or 'quantized'} weights) is not "
                                     "supported; use the checkpoint in bf16, fp16 or fp32")
    return config


def _unsupported(field: str, kind: str, model_type, supported) -> HFConfigProblem:
    return HFConfigProblem(field, f"{kind} model type {model_type!r} is not supported "
                                  f"(supported: {', '.join(supported)})")


def _rope(tc: Dict[str, Any], field: str) -> Dict[str, Any]:
    """RoPE theta and Llama-3 scaling, from transformers 5 `rope_parameters` or the older keys."""
    params = dict(tc.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = tc.get("rope_theta", 10000.0)
    scaling = tc.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out = {"rope_theta": float(params["rope_theta"]), "rope_scaling": None}
    if rope_type == "llama3":
        out["rope_scaling"] = {k: float(params[k]) for k in
                               ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    elif rope_type != "default":
        raise HFConfigProblem(field, f"RoPE type {rope_type!r} is not supported (supported: default, llama3)")
    return out


def default_kv_heads(model_type: str, heads: int) -> int:
    """transformers' key/value head count for a config that names none: its model type's own default
    (Qwen2: 32, Mistral and the Qwen-VL text models: 8), or the query heads where the type falls back
    to them (Llama)."""
    from transformers import AutoConfig

    return int(AutoConfig.for_model(model_type, num_attention_heads=heads).num_key_value_heads or heads)


def language_fields(tc: Dict[str, Any], field: str) -> Dict[str, Any]:
    mt = tc.get("model_type")
    if mt not in LLM_TYPES:
        raise _unsupported(field, "language", mt, LLM_TYPES)
    if tc.get("hidden_act", "silu") != "silu":
        raise HFConfigProblem(field, f"hidden_act {tc.get('hidden_act')!r} is not supported (supported: silu)")
    if mt == "llama" and (tc.get("attention_bias") or tc.get("mlp_bias")):
        raise HFConfigProblem(field, "Llama with attention_bias or mlp_bias is not supported")
    heads = tc["num_attention_heads"]
    out = {
        "num_layers": tc["num_hidden_layers"],
        "hidden_size": tc["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": tc.get("num_key_value_heads") or default_kv_heads(mt, heads),
        "ffn_hidden_size": tc["intermediate_size"],
        "vocab_size": tc["vocab_size"],
        "max_sequence_length": tc["max_position_embeddings"],
        "normalization": "RMSNorm",
        "norm_eps": float(tc.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "add_bias_linear": False,
        "qkv_bias": mt == "qwen2" or (mt == "qwen2_moe" and bool(tc.get("qkv_bias", True))),
        "tie_embeddings": bool(tc.get("tie_word_embeddings", False)),
    }
    if mt == "qwen3_moe":
        if tc.get("attention_bias"):
            raise HFConfigProblem(field, "qwen3_moe with attention_bias is not supported")
        out["qk_layernorm"] = True  # q_norm / k_norm: RMSNorm over each head's channels
    if mt in MOE_TYPES:
        out.update(moe_fields(tc, field))
    head_dim = tc.get("head_dim")
    if head_dim and head_dim != tc["hidden_size"] // heads:
        out["kv_channels"] = head_dim
    out.update(_rope(tc, field))
    return out


# The architecture keys of an MoE config.json that transformers fills in when they are missing: a
# trimmed or hand-written config must build the model transformers builds from it (the training-only
# router_aux_loss_coef is not among them: a missing one stays 0 here).
MOE_ARCHITECTURE_KEYS = ("num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                         "shared_expert_intermediate_size", "moe_intermediate_size", "intermediate_size")


def architecture_defaults(model_type: str) -> Dict[str, Any]:
    """transformers' own defaults for the MoE architecture keys of `model_type`."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    return {k: defaults[k] for k in MOE_ARCHITECTURE_KEYS if k in defaults}


def moe_fields(tc: Dict[str, Any], field: str) -> Dict[str, Any]:
    """The mixture-of-experts fields of a Qwen2-MoE, Qwen3-MoE or Mixtral config.

    transformers' routers softmax over all experts and take the top k; with `norm_topk_prob`
    (Qwen3-MoE's usual setting; Mixtral always) they renormalise those k, which equals megatron's
    top-k of the logits followed by a softmax over the k (`moe_router_pre_softmax: false`);
    without it the k probabilities stay as they are (megatron's `moe_router_pre_softmax: true`).
    """
    mt = tc["model_type"]
    tc = {**architecture_defaults(mt), **tc}
    n = tc.get("num_experts") or tc.get("num_local_experts")
    if not n:
        raise HFConfigProblem(field, f"{mt} config.json has no num_experts")
    layers = tc["num_hidden_layers"]
    if mt == "mixtral":
        width, renorm, pattern = tc["intermediate_size"], True, [1] * layers
    else:
        width, renorm = tc["moe_intermediate_size"], bool(tc.get("norm_topk_prob", False))
        # transformers: layer i is MoE unless listed in mlp_only_layers, and when (i + 1) % step == 0.
        dense, step = set(tc.get("mlp_only_layers") or []), tc.get("decoder_sparse_step", 1) or 1
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise HFConfigProblem(field, f"{mt} config.json makes no layer a mixture-of-experts layer")
    if int(tc["num_experts_per_tok"]) == 1 and renorm:
        # transformers renormalises the one chosen expert's probability to 1.0, which megatron-core's
        # router cannot express (its top-1 keeps the probability over all experts).
        raise HFConfigProblem(field, f"{mt} with num_experts_per_tok 1 and renormalised top-k weights "
                                     "(norm_topk_prob, or Mixtral's router) is not supported")
    out = {
        "num_moe_experts": int(n),
        "moe_router_topk": int(tc["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(width),
        "moe_router_pre_softmax": not renorm,
        "moe_layer_freq": 1 if all(pattern) else pattern,
        # A training choice the weights do not fix: the YAML may override it.
        "moe_aux_loss_coeff": float(tc.get("router_aux_loss_coef", 0.0) or 0.0),
        "_overridable": ("moe_aux_loss_coeff",),
    }
    if mt == "qwen2_moe" and tc.get("shared_expert_intermediate_size"):
        out["moe_shared_expert_intermediate_size"] = int(tc["shared_expert_intermediate_size"])
        out["moe_shared_expert_gate"] = True
    if mt == "mixtral" and tc.get("router_jitter_noise"):
        raise HFConfigProblem(field, "mixtral with router_jitter_noise is not supported")
    return out


def sliding_window(tc: Dict[str, Any]):
    """The attention window transformers applies to some layer of this LLM config, or None.

    Read from transformers' own config of the model type, which fills the defaults a config.json
    leaves out (Qwen's `sliding_window` is 4096 when absent) and decides which layers slide: its
    `layer_types` where the type has them (Qwen2: the layers from `max_window_layers` on; Qwen2-MoE:
    every other layer below it), else every layer (Mistral, Mixtral, Qwen3-MoE), and only with
    `use_sliding_window` for the Qwen types. Llama has none.
    """
    from transformers import AutoConfig

    mt = tc.get("model_type")
    if mt not in ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe"):
        return None
    keys = {k: v for k, v in tc.items() if k in ("sliding_window", "use_sliding_window", "max_window_layers",
                                                   "layer_types", "num_hidden_layers")}
    cfg = AutoConfig.for_model(mt, **keys)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def _check_window(tc: Dict[str, Any], raw: Dict[str, Any], field: str, problems: List[Problem]) -> None:
    """mimo has no sliding-window attention: it is exact only while no sequence is longer than the
    window (then the window never hides a token); a longer data.seq_length is a config error."""
    window = sliding_window(tc)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    seq = data.get("seq_length", 128)
    if window is not None and isinstance(seq, int) and seq > window:
        problems.append(("data.seq_length", f"{seq} is longer than the sliding_window ({window}) of {field}; mimo "
                                            f"attends over whole sequences, so use data.seq_length <= {window}"))


def vision_fields(vc: Dict[str, Any], field: str, feature_layer: Any, strategy: str) -> Dict[str, Any]:
    mt = vc.get("model_type")
    if mt in ("clip", "siglip"):
        vc, mt = vc["vision_config"], vc["vision_config"].get("model_type", mt + "_vision_model")
    if mt not in VISION_TYPES:
        raise _unsupported(field, "vision", mt, VISION_TYPES)
    clip = mt.startswith("clip")
    if not isinstance(feature_layer, int):
        raise HFConfigProblem(field, f"vision_feature_layer {feature_layer!r} is not supported (a single layer index)")
    layers = vc["num_hidden_layers"]
    used = layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= used <= layers:
        raise HFConfigProblem(field, f"vision_feature_layer {feature_layer} selects no transformer layer")
    # `default` drops the first token (CLIP's class token); `full` keeps every token (SigLIP has no
    # class token). The two other combinations change the token count and are refused.
    want = "default" if clip else "full"
    if strategy != want:
        raise HFConfigProblem(field, f"vision_feature_select_strategy {strategy!r} with {mt} is not supported "
                                     f"(supported: {want})")
    act = vc.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise HFConfigProblem(field, f"vision hidden_act {act!r} is not supported")
    return {
        "kind": "vision",
        "num_layers": used,
        "hidden_size": vc["hidden_size"],
        "num_attention_heads": vc["num_attention_heads"],
        "ffn_hidden_size": vc["intermediate_size"],
        "image_size": vc["image_size"],
        "patch_size": vc["patch_size"],
        "num_channels": vc.get("num_channels", 3),
        "norm_eps": float(vc.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
        "activation": _ACTIVATIONS[act],
        "class_token": clip,
        "pre_norm": clip,
        # LLaVA's features are a layer's output, before any post-layernorm.
        "final_norm": False,
        "patch_bias": not clip,
        "_notes": {"num_layers": f"the {used} of {layers} tower layers up to vision_feature_layer {feature_layer}"},
    }


def audio_fields(wc: Dict[str, Any], field: str) -> Dict[str, Any]:
    mt = wc.get("model_type")
    if mt not in AUDIO_TYPES:
        raise _unsupported(field, "audio", mt, AUDIO_TYPES)
    act = wc.get("activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise HFConfigProblem(field, f"activation_function {act!r} is not supported")
    return {
        "kind": "audio",
        "num_layers": wc["encoder_layers"],
        "hidden_size": wc["d_model"],
        "num_attention_heads": wc["encoder_attention_heads"],
        "ffn_hidden_size": wc["encoder_ffn_dim"],
        "num_mel_bins": wc["num_mel_bins"],
        # Two convolutions, the second with stride 2: two frames per token.
        "clip_frames": 2 * wc["max_source_positions"],
        "frames_per_token": 2,
        "frontend": "conv",
        "norm_eps": 1e-5,
        "activation": _ACTIVATIONS[act],
        "class_token": False,
        "pre_norm": False,
        "final_norm": True,
    }


def llava_fields(lc: Dict[str, Any], field: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(language fields, `images` encoder fields) of a LLaVA config."""
    if lc.get("model_type") not in LLAVA_TYPES:
        raise _unsupported(field, "multimodal", lc.get("model_type"), MULTIMODAL_TYPES)
    tc = dict(lc["text_config"])
    # transformers' LlavaConfig ties when either flag says so (pre-v5 saves kept it in text_config).
    tc["tie_word_embeddings"] = bool(lc.get("tie_word_embeddings") or tc.get("tie_word_embeddings"))
    lang = language_fields(tc, field)
    enc = vision_fields(lc["vision_config"], field, lc.get("vision_feature_layer", -2),
                        lc.get("vision_feature_select_strategy", "default"))
    act = lc.get("projector_hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise HFConfigProblem(field, f"projector_hidden_act {act!r} is not supported")
    if not lc.get("multimodal_projector_bias", True):
        raise HFConfigProblem(field, "multimodal_projector_bias: false is not supported")
    token = lc.get("image_token_id", lc.get("image_token_index"))
    if token is None:
        raise HFConfigProblem(field, "config.json has no image_token_id")
    enc["placeholder_id"] = token
    enc["projector"] = {"kind": "mlp", "activation": _ACTIVATIONS[act]}
    return lang, enc


def qwen_vl_text_config(hc: Dict[str, Any], field: str) -> Tuple[Dict[str, Any], List[int]]:
    """(a Qwen2 LLM config, mrope_section) from a Qwen2(.5)-VL config.

    The text fields sit in `text_config` (transformers 5 saves) or at the top level (the hub's
    files); transformers reads the top level only when there is no `text_config`, and so does
    this. The M-RoPE section comes from `rope_scaling` (hub) or `rope_parameters` (transformers
    5), marked {"type": "mrope"} and/or {"rope_type": "default"}; without one, transformers
    uses [16, 24, 24]. Tied embeddings: the top-level flag, or text_config's (pre-v5 saves)."""
    nested = hc.get("text_config")
    tc = dict(nested) if isinstance(nested, dict) else {k: v for k, v in hc.items() if k != "vision_config"}
    # transformers: a rope_scaling entry replaces rope_parameters; theta defaults to 1e6 here.
    params = dict(tc.get("rope_scaling") or tc.get("rope_parameters") or {})
    kinds = {params.get("type"), params.get("rope_type")} - {None, "default", "mrope"}
    if kinds:
        raise HFConfigProblem(field, f"RoPE type {sorted(kinds)[0]!r} is not supported with {hc.get('model_type')} "
                                     "(supported: mrope)")
    section = params.get("mrope_section", QWEN_VL_MROPE_SECTION)
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(x, int) for x in section):
        raise HFConfigProblem(field, f"mrope_section must be three integers (time, height, width), got {section!r}")
    if not tc.get("num_key_value_heads") and isinstance(tc.get("num_attention_heads"), int):
        # The default of the Qwen-VL text model (8), not Qwen2's (32), which the type becomes below.
        tc["num_key_value_heads"] = default_kv_heads(f"{hc.get('model_type')}_text", tc["num_attention_heads"])
    tc.update(model_type="qwen2", rope_scaling=None,
              rope_parameters={"rope_theta": params.get("rope_theta", tc.get("rope_theta", QWEN_VL_TEXT_THETA))},
              tie_word_embeddings=bool(hc.get("tie_word_embeddings") or tc.get("tie_word_embeddings")))
    tc.setdefault("rms_norm_eps", 1e-5)         # Qwen2VLTextConfig's default
    return tc, list(section)


def _one_size(vc: Dict[str, Any], key: str, default: int, field: str) -> int:
    value = vc.get(key, default)
    if isinstance(value, (list, tuple)):        # transformers allows [n, n]; mimo's patches are square
        if len(set(value)) != 1:
            raise HFConfigProblem(field, f"vision_config.{key} {value!r} is not supported (one size for both sides)")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise HFConfigProblem(field, f"vision_config.{key} must be an integer, got {value!r}")
    return value


def qwen_vision_fields(mt: str, vc: Dict[str, Any], text_hidden: int, field: str) -> Dict[str, Any]:
    """The native-resolution `images` encoder of a Qwen2-VL (mt qwen2_vl) or Qwen2.5-VL vision_config.

    Both: Conv3d patch embedding without bias, 2-D rotary positions (theta 10000), norms with
    eps 1e-6, and a patch merger (norm, spatial_merge_size^2 patches concatenated, Linear,
    GELU, Linear) whose output width must be the LLM's. Qwen2.5-VL: RMSNorm, gated SiLU MLP
    (swiglu) of intermediate_size, window attention except on fullatt_block_indexes. Qwen2-VL:
    LayerNorm, a plain MLP of mlp_ratio * embed_dim with hidden_act (quick_gelu), no windows."""
    theta = (vc.get("rope_parameters") or {}).get("rope_theta", QWEN_VL_VISION_THETA)
    if theta != QWEN_VL_VISION_THETA:
        raise HFConfigProblem(field, f"vision rope_theta {theta!r} is not supported (supported: 10000)")
    out = {
        "kind": "vision",
        "resolution": "native",
        "position_embedding": "rope2d",
        "num_layers": vc["depth"],
        "num_attention_heads": vc["num_heads"],
        "patch_size": _one_size(vc, "patch_size", 14, field),
        "temporal_patch_size": _one_size(vc, "temporal_patch_size", 2, field),
        "spatial_merge_size": _one_size(vc, "spatial_merge_size", 2, field),
        # transformers 5 reads in_channels; the hub's older files say in_chans.
        "num_channels": vc.get("in_channels", vc.get("in_chans", 3)),
        "norm_eps": 1e-6,
        "class_token": False,
        "pre_norm": False,
        # The norm after the last block is the patch merger's (projector kind patch_merger).
        "final_norm": False,
        "patch_bias": False,
        "projector": {"kind": "patch_merger", "activation": "gelu"},
    }
    if mt == "qwen2_5_vl":
        act, merged = vc.get("hidden_act", "silu"), vc.get("out_hidden_size")
        if act != "silu":
            raise HFConfigProblem(field, f"vision hidden_act {act!r} is not supported with qwen2_5_vl "
                                         "(supported: silu, the gated MLP)")
        out.update(hidden_size=vc["hidden_size"], ffn_hidden_size=vc["intermediate_size"], normalization="RMSNorm",
                   activation="swiglu", window_size=vc.get("window_size", 112),
                   full_attention_layers=list(vc.get("fullatt_block_indexes", [7, 15, 23, 31])))
        merged_key = "vision_config.out_hidden_size"
    else:
        act, merged = vc.get("hidden_act", "quick_gelu"), vc.get("hidden_size")
        if act not in _ACTIVATIONS:
            raise HFConfigProblem(field, f"vision hidden_act {act!r} is not supported")
        out.update(hidden_size=vc["embed_dim"], ffn_hidden_size=int(vc["embed_dim"] * vc.get("mlp_ratio", 4)),
                   normalization="LayerNorm", activation=_ACTIVATIONS[act], window_size=0)
        merged_key = "vision_config.hidden_size"
    if merged != text_hidden:
        raise HFConfigProblem(field, f"{merged_key} ({merged}) must equal the LLM's hidden_size ({text_hidden}): "
                                     "the patch merger feeds the LLM directly")
    return out


def _processor_pixels(directory: str, enc: Dict[str, Any], field: str) -> Dict[str, Any]:
    """min_pixels / max_pixels of the directory's image processor; its patch sizes must be the ViT's."""
    from .hf_files import qwen_processor_settings

    try:
        pc = qwen_processor_settings(directory)
    except (OSError, ValueError, RecursionError) as exc:
        raise HFConfigProblem(field, f"the image processor settings in {directory}: unreadable ({exc})")
    for key, ours in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                      ("merge_size", "spatial_merge_size")):
        if pc[key] is not None and pc[key] != enc[ours]:
            raise HFConfigProblem(field, f"{pc['file']} {key} ({pc[key]}) disagrees with "
                                         f"config.json vision_config ({enc[ours]})")
    return {"min_pixels": pc["min_pixels"], "max_pixels": pc["max_pixels"]}


def qwen_vl_fields(hc: Dict[str, Any], field: str, directory: str) -> Tuple[Dict[str, Any], Dict[str, Any],
                                                                           Dict[str, Any]]:
    """(language fields, `images` encoder fields, the LLM's config as Qwen2's) of a Qwen2-VL /
    Qwen2.5-VL directory."""
    mt = hc.get("model_type")
    tc, section = qwen_vl_text_config(hc, field)
    lang = language_fields(tc, field)
    lang.update(position_embedding="mrope", mrope_section=section)
    vc = hc.get("vision_config")
    if not isinstance(vc, dict):
        raise HFConfigProblem(field, "config.json has no vision_config")
    enc = qwen_vision_fields(mt, vc, lang["hidden_size"], field)
    enc["placeholder_id"] = hc.get("image_token_id", QWEN_VL_IMAGE_TOKEN)
    enc.update(_processor_pixels(directory, enc, field))
    enc["_overridable"] = ("min_pixels", "max_pixels")
    return lang, enc, tc


def multimodal_fields(hc: Dict[str, Any], field: str, directory: str):
    """(language fields, `images` fields, the LLM's config for the sliding-window check) of a
    model.hf directory."""
    mt = hc.get("model_type")
    if mt in QWEN_VL_TYPES:
        lang, enc, text_config = qwen_vl_fields(hc, field, directory)
    else:
        lang, enc = llava_fields(hc, field)
        text_config = hc.get("text_config") or {}
    # transformers' LLaVA and Qwen-VL attend causally over image tokens too; a training choice
    # (the YAML may say bidirectional), but only causal computes the imported model's logits.
    lang.update(modality_attention="causal", _overridable=tuple(lang.get("_overridable", ())) + ("modality_attention",))
    return lang, enc, text_config


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _fill(section: Dict[str, Any], fields: Dict[str, Any], path: str, source: str,
          problems: List[Problem]) -> None:
    """Write `fields` into the raw YAML `section`; a value the YAML already gives must agree."""
    notes = fields.get("_notes", {})
    overridable = fields.get("_overridable", ())
    for key, value in fields.items():
        if key in ("_notes", "_overridable"):
            continue
        if isinstance(value, dict) and isinstance(section.get(key), dict) and key == "projector":
            _fill(section[key], value, f"{path}.{key}", source, problems)
            continue
        if key in overridable and section.get(key) is not None:
            continue    # a preprocessing choice, not architecture: the YAML's value stands
        if key in section and section[key] is not None and not _same(section[key], value):
            note = f": {notes[key]}" if key in notes else ""
            problems.append((f"{path}.{key}", f"{section[key]!r} disagrees with {source} ({value!r}{note})"))
        else:
            section[key] = value


def resolve_hf(raw: Dict[str, Any]) -> List[Problem]:
    """Fill HF-derived fields into `raw` (in place); returns the problems found."""
    problems: List[Problem] = []
    model = raw.get("model")
    if not isinstance(model, dict):
        return problems
    jobs = []
    if model.get("hf") is not None:
        jobs.append(("model.hf", model["hf"], "multimodal", None))
    lang = model.get("language")
    if isinstance(lang, dict) and lang.get("hf") is not None:
        jobs.append(("model.language.hf", lang["hf"], "language", None))
    encoders = model.get("encoders")
    if isinstance(encoders, dict):
        for name, enc in encoders.items():
            if isinstance(enc, dict) and enc.get("hf") is not None:
                jobs.append((f"model.encoders.{name}.hf", enc["hf"], enc.get("kind", "vision"), name))
    for field, directory, what, name in jobs:
        if not isinstance(directory, str):
            problems.append((field, f"must be a string, got {directory!r}"))
            continue
        source = os.path.join(directory, "config.json")
        try:
            hc = read_hf_config(directory, field)
            if what == "multimodal":
                lang_f, enc_f, text_config = multimodal_fields(hc, field, directory)
                _check_window(text_config, raw, field, problems)
                model.setdefault("language", {})
                model.setdefault("encoders", {})
                bad = [sec for sec in ("language", "encoders") if not isinstance(model[sec], dict)]
                for sec in bad:
                    problems.append((f"model.{sec}", f"must be a mapping, got {model[sec]!r}"))
                if bad:
                    continue
                model["encoders"].setdefault(LLAVA_ENCODER, {})
                _fill(model["language"], lang_f, "model.language", source, problems)
                enc = model["encoders"][LLAVA_ENCODER]
                if isinstance(enc, dict):
                    enc.setdefault("projector", {})
                    _fill(enc, enc_f, f"model.encoders.{LLAVA_ENCODER}", source, problems)
            elif what == "language":
                _fill(lang, language_fields(hc, field), "model.language", source, problems)
                _check_window(hc, raw, field, problems)
            elif what == "vision":
                _fill(encoders[name], vision_fields(hc, field, -2 if "clip" in str(hc.get("model_type")) else -1,
                                                    "default" if "clip" in str(hc.get("model_type")) else "full"),
                      f"model.encoders.{name}", source, problems)
            elif what == "audio":
                _fill(encoders[name], audio_fields(hc, field), f"model.encoders.{name}", source, problems)
            else:
                problems.append((f"model.encoders.{name}.kind",
                                 f"expected vision or audio for an hf encoder, got {what!r}"))
        except HFConfigProblem as exc:
            problems.append((exc.field, exc.reason))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # A config.json of the wrong shape (a list where a mapping belongs,
            # text where a number does): name the file, not the Python error.
            problems.append((field, f"{source}: missing or malformed entry ({exc})"))
    return problems
