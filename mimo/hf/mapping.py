"""Which Hugging Face tensors make each mimo parameter, and how.

Every mimo parameter of an HF-backed module is one `Entry`: its full
(TP = 1, PP = 1, global layer index) name, the HF tensor names it is made of
and how they combine:

* `copy`: one HF tensor, same shape.
* `qkv`: q_proj, k_proj, v_proj -> megatron's fused linear_qkv, whose rows
  are grouped per query group: [q heads of group 0, k of group 0, v of
  group 0, q heads of group 1, ...] (GQA-aware; a TP rank holds whole groups).
* `glu`: gate_proj, up_proj -> megatron's fused linear_fc1 [gate; up] (a TP
  rank holds [gate_t; up_t]).
* `packed_qkv`: one HF tensor [q; k; v] (Qwen-VL's vision `attn.qkv`, all q
  heads, then all k, then all v) -> the same per-group layout as `qkv`.

An MoE LLM's routed experts are entries by global expert index
(`decoder.layers.L.mlp.experts.local_experts.<global>.linear_fc1.weight`, a
`glu` of the HF expert's gate and up projections); a rank holding experts from
`offset` on reads the entry of `offset + local index` (`load_hf_part`).

HF names are written without their checkpoint prefix (`layers.0.mlp...`);
`Source` finds the prefix the directory actually uses (transformers has saved
LLaVA as `language_model.model.` and as `model.language_model.`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from mimo.config import LANGUAGE, MimoConfig
from mimo.config.hf_arch import read_hf_config

Shape = Tuple[int, ...]

# Roles of HF tensor groups, each with the prefixes a checkpoint may put before the names.
PREFIXES = {
    "llm": ("language_model.model.", "model.language_model.", "model.", ""),
    "lm_head": ("language_model.", "model.", ""),
    "vision": ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
               "model.vision_tower.", "vision_model.", ""),
    "projector": ("multi_modal_projector.", "model.multi_modal_projector."),
    "whisper": ("model.encoder.", "encoder.", ""),
    # Qwen2-VL / Qwen2.5-VL vision tower and its patch merger (save_pretrained writes `visual.`).
    "qwen_visual": ("visual.", "model.visual."),
}
# A tensor whose presence identifies the prefix of a role.
PROBES = {"llm": "embed_tokens.weight", "lm_head": "lm_head.weight", "vision": "embeddings.patch_embedding.weight",
          "projector": "linear_1.weight", "whisper": "conv1.weight",
          "qwen_visual": "patch_embed.proj.weight"}


@dataclass
class Entry:
    mimo: str                    # full mimo parameter name inside its module
    kind: str                    # copy | qkv | glu | packed_qkv
    role: str                    # key of PREFIXES
    hf: Tuple[str, ...]          # HF names (without prefix)
    shapes: Tuple[Shape, ...]    # expected HF shapes
    # qkv and packed_qkv only: (heads, groups, head_dim)
    heads: Optional[Tuple[int, int, int]] = None


def _copy(mimo: str, role: str, hf: str, shape: Shape) -> Entry:
    return Entry(mimo, "copy", role, (hf,), (tuple(shape),))


def _qkv(mimo: str, role: str, names: Tuple[str, str, str], heads: int, groups: int, d: int, hidden: Optional[int]
         ) -> Entry:
    """hidden None: the biases."""
    rows = (heads * d, groups * d, groups * d)
    shapes = tuple((r,) if hidden is None else (r, hidden) for r in rows)
    return Entry(mimo, "qkv", role, names, shapes, (heads, groups, d))


def _glu_mlp(m: str, p: str, f: int, h: int, names=("gate_proj", "up_proj", "down_proj")) -> List[Entry]:
    """A gated MLP: HF gate / up / down projections -> megatron's linear_fc1 [gate; up] and linear_fc2."""
    gate, up, down = names
    return [Entry(m + "linear_fc1.weight", "glu", "llm", (p + gate + ".weight", p + up + ".weight"), ((f, h), (f, h))),
            _copy(m + "linear_fc2.weight", "llm", p + down + ".weight", (h, f))]


def _moe_layer_entries(lang, m: str, p: str, mixtral: bool) -> List[Entry]:
    """One MoE layer: the router, every routed expert by its global index (megatron's SequentialMLP
    names it `local_experts.<index>`; a rank holding experts from `offset` on reads the entries of
    `offset + local index`), and Qwen2-MoE's shared expert and its sigmoid gate.

    On disk transformers writes one tensor per expert: `mlp.experts.N.{gate,up,down}_proj`
    (Qwen-MoE), `block_sparse_moe.experts.N.w1/w3/w2` (Mixtral: gate, up, down)."""
    h, n = lang.hidden_size, lang.num_moe_experts
    f = lang.moe_ffn_hidden_size or lang.ffn_hidden_size
    block, names = (p + "block_sparse_moe.", ("w1", "w3", "w2")) if mixtral else (p + "mlp.", None)
    out = [_copy(m + "mlp.router.weight", "llm", block + "gate.weight", (n, h))]
    for e in range(n):
        out += _glu_mlp(f"{m}mlp.experts.local_experts.{e}.", f"{block}experts.{e}.", f, h,
                        *([names] if names else []))
    shared = lang.moe_shared_expert_intermediate_size
    if shared:
        out += _glu_mlp(m + "mlp.shared_experts.", block + "shared_expert.", shared, h)
        if lang.moe_shared_expert_gate:
            out.append(_copy(m + "mlp.shared_experts.gate_weight", "llm", block + "shared_expert_gate.weight", (1, h)))
    return out


def language_entries(cfg: MimoConfig, hf_type: Optional[str] = None) -> List[Entry]:
    """`hf_type`: the HF text model's model_type (names differ between MoE families)."""
    lang = cfg.model.language
    h, v, f = lang.hidden_size, lang.vocab_size, lang.ffn_hidden_size
    heads, groups = lang.num_attention_heads, lang.num_query_groups
    d = lang.kv_channels or h // heads
    out = [_copy("embedding.word_embeddings.weight", "llm", "embed_tokens.weight", (v, h))]
    moe = lang.moe_layers()
    for i in range(lang.num_layers):
        m, p = f"decoder.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        out += [
            _copy(m + "input_layernorm.weight", "llm", p + "input_layernorm.weight", (h,)),
            _qkv(m + "self_attention.linear_qkv.weight", "llm",
                 (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), heads, groups, d, h),
            _copy(m + "self_attention.linear_proj.weight", "llm", att + "o_proj.weight", (h, heads * d)),
            _copy(m + "pre_mlp_layernorm.weight", "llm", p + "post_attention_layernorm.weight", (h,)),
        ]
        if moe[i]:
            out += _moe_layer_entries(lang, m, p, hf_type == "mixtral")
        else:
            out += _glu_mlp(m + "mlp.", p + "mlp.", f, h)
        if getattr(lang, "qk_layernorm", False):
            out += [_copy(m + "self_attention.q_layernorm.weight", "llm", att + "q_norm.weight", (d,)),
                    _copy(m + "self_attention.k_layernorm.weight", "llm", att + "k_norm.weight", (d,))]
        if lang.qkv_bias:
            out.append(_qkv(m + "self_attention.linear_qkv.bias", "llm",
                            (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"), heads, groups, d, None))
    out.append(_copy("decoder.final_layernorm.weight", "llm", "norm.weight", (h,)))
    if not lang.tie_embeddings:
        out.append(_copy("output_layer.weight", "lm_head", "lm_head.weight", (v, h)))
    return out


def _tower_layers(enc, role: str, names: Dict[str, str]) -> List[Entry]:
    """Pre-norm encoder layers (CLIP, SigLIP and Whisper share the shape, not the names)."""
    h, f, heads = enc.hidden_size, enc.ffn_hidden_size, enc.num_attention_heads
    d = h // heads
    out = []
    for i in range(enc.num_layers):
        m, p = f"encoder.block.layers.{i}.", names["layer"].format(i=i)
        att = p + names["attn"]
        out += [
            _copy(m + "input_layernorm.weight", role, p + names["ln1"] + ".weight", (h,)),
            _copy(m + "input_layernorm.bias", role, p + names["ln1"] + ".bias", (h,)),
            _qkv(m + "self_attention.linear_qkv.weight", role,
                 (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), heads, heads, d, h),
            _copy(m + "self_attention.linear_proj.weight", role, att + "out_proj.weight", (h, h)),
            _copy(m + "self_attention.linear_proj.bias", role, att + "out_proj.bias", (h,)),
            _copy(m + "pre_mlp_layernorm.weight", role, p + names["ln2"] + ".weight", (h,)),
            _copy(m + "pre_mlp_layernorm.bias", role, p + names["ln2"] + ".bias", (h,)),
            _copy(m + "mlp.linear_fc1.weight", role, p + names["fc"] + "fc1.weight", (f, h)),
            _copy(m + "mlp.linear_fc1.bias", role, p + names["fc"] + "fc1.bias", (f,)),
            _copy(m + "mlp.linear_fc2.weight", role, p + names["fc"] + "fc2.weight", (h, f)),
            _copy(m + "mlp.linear_fc2.bias", role, p + names["fc"] + "fc2.bias", (h,)),
        ]
        qkv_bias = (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias")
        if names.get("no_k_bias"):
            # Whisper's k_proj has no bias. Adding one to every key shifts a query's
            # scores by a constant, which softmax ignores: it stays zero (and gets
            # zero gradient), so exporting drops it.
            qkv_bias = (qkv_bias[0], None, qkv_bias[2])
        out.append(_qkv(m + "self_attention.linear_qkv.bias", role, qkv_bias, heads, heads, d, None))
    return out


def vision_entries(cfg: MimoConfig, name: str) -> List[Entry]:
    enc = cfg.model.encoders[name]
    h, c, p = enc.hidden_size, enc.num_channels, enc.patch_size
    tokens = enc.tokens_per_item + (1 if enc.class_token else 0)
    out = [_copy("encoder.patch_embed.weight", "vision", "embeddings.patch_embedding.weight", (h, c, p, p)),
           _copy("encoder.position_embeddings", "vision", "embeddings.position_embedding.weight", (tokens, h))]
    if enc.patch_bias:
        out.append(_copy("encoder.patch_embed.bias", "vision", "embeddings.patch_embedding.bias", (h,)))
    if enc.class_token:
        out.append(_copy("encoder.class_embedding", "vision", "embeddings.class_embedding", (h,)))
    if enc.pre_norm:
        out += [_copy("encoder.pre_norm.weight", "vision", "pre_layrnorm.weight", (h,)),
                _copy("encoder.pre_norm.bias", "vision", "pre_layrnorm.bias", (h,))]
    out += _tower_layers(enc, "vision", {"layer": "encoder.layers.{i}.", "attn": "self_attn.", "ln1": "layer_norm1",
                                         "ln2": "layer_norm2", "fc": "mlp."})
    return out


def projector_entries(cfg: MimoConfig, name: str) -> List[Entry]:
    enc, hl = cfg.model.encoders[name], cfg.model.language.hidden_size
    return [_copy("projector.encoder.linear_fc1.weight", "projector", "linear_1.weight", (hl, enc.hidden_size)),
            _copy("projector.encoder.linear_fc1.bias", "projector", "linear_1.bias", (hl,)),
            _copy("projector.encoder.linear_fc2.weight", "projector", "linear_2.weight", (hl, hl)),
            _copy("projector.encoder.linear_fc2.bias", "projector", "linear_2.bias", (hl,))]


def whisper_entries(cfg: MimoConfig, name: str) -> List[Entry]:
    enc = cfg.model.encoders[name]
    h, mels = enc.hidden_size, enc.num_mel_bins
    out = [_copy("encoder.conv1.weight", "whisper", "conv1.weight", (h, mels, 3)),
           _copy("encoder.conv1.bias", "whisper", "conv1.bias", (h,)),
           _copy("encoder.conv2.weight", "whisper", "conv2.weight", (h, h, 3)),
           _copy("encoder.conv2.bias", "whisper", "conv2.bias", (h,)),
           _copy("encoder.position_embeddings", "whisper", "embed_positions.weight", (enc.tokens_per_item, h))]
    out += _tower_layers(enc, "whisper", {"layer": "layers.{i}.", "attn": "self_attn.", "ln1": "self_attn_layer_norm",
                                          "ln2": "final_layer_norm", "fc": "", "no_k_bias": True})
    out += [_copy("encoder.block.final_layernorm.weight", "whisper", "layer_norm.weight", (h,)),
            _copy("encoder.block.final_layernorm.bias", "whisper", "layer_norm.bias", (h,))]
    return out


def native_vision_entries(enc) -> List[Entry]:
    """Qwen2-VL / Qwen2.5-VL vision tower -> mimo.model.native_vision.NativeVisionEncoder.

    Qwen2.5-VL (activation swiglu): RMSNorm, gated MLP gate/up/down_proj with
    biases; Qwen2-VL: LayerNorm, fc1/fc2. Both: fused attn.qkv with bias.
    `enc` is the encoder's EncoderConfig.
    """
    h, f, heads = enc.hidden_size, enc.ffn_hidden_size, enc.num_attention_heads
    d, r = h // heads, "qwen_visual"
    patch = (h, enc.num_channels, enc.temporal_patch_size, enc.patch_size, enc.patch_size)
    out = [_copy("encoder.patch_embed.weight", r, "patch_embed.proj.weight", patch)]
    layernorm = enc.normalization == "LayerNorm"
    for i in range(enc.num_layers):
        m, p = f"encoder.block.layers.{i}.", f"blocks.{i}."
        out += [Entry(m + "self_attention.linear_qkv.weight", "packed_qkv", r, (p + "attn.qkv.weight",),
                      ((3 * h, h),), (heads, heads, d)),
                Entry(m + "self_attention.linear_qkv.bias", "packed_qkv", r, (p + "attn.qkv.bias",), ((3 * h,),),
                      (heads, heads, d)),
                _copy(m + "self_attention.linear_proj.weight", r, p + "attn.proj.weight", (h, h)),
                _copy(m + "self_attention.linear_proj.bias", r, p + "attn.proj.bias", (h,))]
        for mimo_norm, hf_norm in (("input_layernorm", "norm1"), ("pre_mlp_layernorm", "norm2")):
            out.append(_copy(m + mimo_norm + ".weight", r, p + hf_norm + ".weight", (h,)))
            if layernorm:
                out.append(_copy(m + mimo_norm + ".bias", r, p + hf_norm + ".bias", (h,)))
        if enc.activation == "swiglu":
            for part in ("weight", "bias"):
                shape = (f, h) if part == "weight" else (f,)
                out.append(Entry(m + "mlp.linear_fc1." + part, "glu", r,
                                 (p + "mlp.gate_proj." + part, p + "mlp.up_proj." + part), (shape, shape)))
            out += [_copy(m + "mlp.linear_fc2.weight", r, p + "mlp.down_proj.weight", (h, f)),
                    _copy(m + "mlp.linear_fc2.bias", r, p + "mlp.down_proj.bias", (h,))]
        else:
            out += [_copy(m + "mlp.linear_fc1.weight", r, p + "mlp.fc1.weight", (f, h)),
                    _copy(m + "mlp.linear_fc1.bias", r, p + "mlp.fc1.bias", (f,)),
                    _copy(m + "mlp.linear_fc2.weight", r, p + "mlp.fc2.weight", (h, f)),
                    _copy(m + "mlp.linear_fc2.bias", r, p + "mlp.fc2.bias", (h,))]
    return out


def patch_merger_entries(enc, llm_hidden: int) -> List[Entry]:
    """Qwen2-VL's `merger` (ln_q, mlp.0, mlp.2) -> mimo.model.native_vision.PatchMerger."""
    h, hl, r = enc.hidden_size, llm_hidden, "qwen_visual"
    w = h * enc.spatial_merge_size ** 2
    out = [_copy("projector.norm.weight", r, "merger.ln_q.weight", (h,))]
    if enc.normalization == "LayerNorm":
        out.append(_copy("projector.norm.bias", r, "merger.ln_q.bias", (h,)))
    return out + [_copy("projector.linear_fc1.weight", r, "merger.mlp.0.weight", (w, w)),
                  _copy("projector.linear_fc1.bias", r, "merger.mlp.0.bias", (w,)),
                  _copy("projector.linear_fc2.weight", r, "merger.mlp.2.weight", (hl, w)),
                  _copy("projector.linear_fc2.bias", r, "merger.mlp.2.bias", (hl,))]


@dataclass
class HFModule:
    """One mimo module backed by an HF directory: the entries it loads from there."""
    module: str
    directory: str
    entries: List[Entry]
    # Whether every parameter of the module comes from HF (else the rest keeps mimo's init).
    complete: bool


def _text_type(directory: str) -> Optional[str]:
    """model_type of the directory's causal LM (a LLaVA directory's text_config)."""
    hc = read_hf_config(directory, "model.hf")
    tc = hc.get("text_config") if isinstance(hc.get("text_config"), dict) else hc
    return tc.get("model_type")


def hf_modules(cfg: MimoConfig) -> Dict[str, HFModule]:
    """The modules of `cfg` whose weights come from Hugging Face directories."""
    out: Dict[str, HFModule] = {}
    lang_dir = cfg.model.language.hf or cfg.model.hf
    if lang_dir:
        out[LANGUAGE] = HFModule(LANGUAGE, lang_dir, language_entries(
            cfg, _text_type(lang_dir) if cfg.model.language.is_moe else None), True)
    for name, enc in cfg.model.encoders.items():
        if enc.kind == "vision" and enc.resolution == "native":
            # The Qwen-VL tower and its merger live in one directory, the whole model's or the tower's.
            if enc.hf or cfg.model.hf:
                out[name] = HFModule(name, enc.hf or cfg.model.hf,
                                     native_vision_entries(enc)
                                     + patch_merger_entries(enc, cfg.model.language.hidden_size), True)
        elif enc.hf:
            entries = vision_entries(cfg, name) if enc.kind == "vision" else whisper_entries(cfg, name)
            out[name] = HFModule(name, enc.hf, entries, False)
        elif cfg.model.hf and name == "images":
            out[name] = HFModule(name, cfg.model.hf, vision_entries(cfg, name) + projector_entries(cfg, name), True)
    return out
