"""Qwen2-VL / Qwen2.5-VL config import (model.hf) and the native-resolution / M-RoPE rules.

The import is checked against transformers itself: every derived field against the modules of
the HF model built (tiny, random, offline) from the same config.json, for the layout transformers
5 saves (text_config) and the flat one of the hub's files."""

import copy
import json

import pytest
import torch

from mimo.config import ConfigError, load_config
from tiny import tiny

HIDDEN = 64
TEXT = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=300, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_theta=500000.0, bos_token_id=0, eos_token_id=1)
IMAGE_TOKEN = 297


def _write(directory, config, preprocessor=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return str(directory)


def qwen25_flat(tie=True):
    """Qwen2.5-VL as the hub's config.json lays it out: text fields at the top level, M-RoPE in
    rope_scaling {"type": "mrope"}, in_chans, tied embeddings (the 3B model)."""
    return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], **TEXT,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "tie_word_embeddings": tie,
            "image_token_id": IMAGE_TOKEN,
            "vision_config": {"depth": 3, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 40,
                              "num_heads": 2, "in_chans": 3, "out_hidden_size": HIDDEN, "patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                              "fullatt_block_indexes": [0, 2], "tokens_per_second": 2}}


def qwen2_flat():
    """Qwen2-VL as the hub lays it out (embed_dim, mlp_ratio, vision hidden_size = the LLM's)."""
    return {"model_type": "qwen2_vl", **TEXT, "rope_scaling": {"type": "mrope", "rope_type": "default",
                                                              "mrope_section": [4, 2, 2]},
            "image_token_id": IMAGE_TOKEN,
            "vision_config": {"depth": 2, "embed_dim": 32, "mlp_ratio": 3, "num_heads": 4, "in_chans": 3,
                              "hidden_size": HIDDEN, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "hidden_act": "quick_gelu", "model_type": "qwen2_vl"}}


def saved_by_transformers(directory, flat):
    """The same model saved by transformers 5 (text_config / rope_parameters layout)."""
    from transformers import AutoConfig

    src = _write(directory / "src", flat)
    AutoConfig.from_pretrained(src).save_pretrained(str(directory / "saved"))
    saved = json.loads((directory / "saved" / "config.json").read_text())
    assert "text_config" in saved and "rope_parameters" in saved["text_config"]
    return str(directory / "saved")


def raw_config(directory, seq=2048, **images):
    model = {"hf": directory}
    if images:
        model["encoders"] = {"images": images}
    return {"model": model, "parallelism": {"language": {}, "images": {}}, "training": {"global_batch_size": 1},
            "data": {"seq_length": seq}}


def errors(raw, world_size=None):
    try:
        load_config(raw, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def hf_model(directory):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    hc = AutoConfig.from_pretrained(directory)
    cls = Qwen2_5_VLForConditionalGeneration if hc.model_type == "qwen2_5_vl" else Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    return cls(hc).eval()


LAYOUTS = ["qwen2_5_vl flat", "qwen2_5_vl saved", "qwen2_vl flat", "qwen2_vl saved"]


@pytest.fixture(params=LAYOUTS)
def qwen_dir(request, tmp_path):
    kind, layout = request.param.split()
    flat = qwen25_flat() if kind == "qwen2_5_vl" else qwen2_flat()
    return kind, (_write(tmp_path / "flat", flat) if layout == "flat" else saved_by_transformers(tmp_path, flat))


def test_fields_match_the_model_transformers_builds(qwen_dir):
    kind, directory = qwen_dir
    cfg = load_config(raw_config(directory))
    lang, enc = cfg.model.language, cfg.model.encoders["images"]
    m = hf_model(directory)
    text, visual = m.model.language_model, m.model.visual
    attn, mlp, norm = text.layers[0].self_attn, text.layers[0].mlp, text.layers[0].input_layernorm
    head_dim = attn.head_dim
    # LLM: Qwen2 blocks with M-RoPE.
    assert lang.num_layers == len(text.layers) and lang.hidden_size == text.embed_tokens.embedding_dim
    assert lang.num_attention_heads * head_dim == attn.q_proj.out_features
    assert lang.num_query_groups * head_dim == attn.k_proj.out_features
    assert (lang.kv_channels or lang.hidden_size // lang.num_attention_heads) == head_dim
    assert lang.ffn_hidden_size == mlp.gate_proj.out_features and lang.vocab_size == text.embed_tokens.num_embeddings
    assert lang.norm_eps == norm.variance_epsilon and lang.normalization == "RMSNorm"
    assert lang.qkv_bias == (attn.q_proj.bias is not None) and lang.add_bias_linear == (attn.o_proj.bias is not None)
    assert (lang.position_embedding, lang.mrope_section) == ("mrope", list(text.rotary_emb.mrope_section))
    inv_freq = 1.0 / lang.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.allclose(text.rotary_emb.inv_freq, inv_freq, rtol=1e-6)
    assert lang.tie_embeddings == (m.lm_head.weight.data_ptr() == text.embed_tokens.weight.data_ptr())
    assert lang.tie_embeddings == (kind == "qwen2_5_vl")
    # ViT: Conv3d patches (no bias), blocks, 2-D rotary, patch merger into the LLM width.
    conv, block = visual.patch_embed.proj, visual.blocks[0]
    assert (enc.kind, enc.resolution, enc.position_embedding) == ("vision", "native", "rope2d")
    assert enc.num_layers == len(visual.blocks) and enc.hidden_size == conv.out_channels
    assert tuple(conv.kernel_size) == (enc.temporal_patch_size, enc.patch_size, enc.patch_size)
    assert enc.num_channels == conv.in_channels and enc.patch_bias == (conv.bias is not None)
    assert enc.num_attention_heads == block.attn.num_heads and enc.spatial_merge_size == visual.spatial_merge_size
    assert enc.norm_eps == getattr(block.norm1, "variance_epsilon", getattr(block.norm1, "eps", None))
    assert enc.normalization in type(block.norm1).__name__ and enc.normalization in type(visual.merger.ln_q).__name__
    assert visual.merger.mlp[-1].out_features == lang.hidden_size
    assert (enc.projector.kind, enc.projector.activation) == ("patch_merger", "gelu")
    assert type(visual.merger.mlp[1]) is torch.nn.GELU and visual.merger.mlp[1].approximate == "none"
    assert (enc.class_token, enc.pre_norm, enc.final_norm, enc.image_size) == (False, False, False, None)
    assert enc.placeholder_id == m.config.image_token_id == IMAGE_TOKEN
    if kind == "qwen2_5_vl":
        assert enc.ffn_hidden_size == block.mlp.gate_proj.out_features and enc.activation == "swiglu"
        assert type(block.mlp.act_fn).__name__ == "SiLUActivation" and block.mlp.gate_proj.bias is not None
        assert (enc.window_size, enc.full_attention_layers) == (visual.window_size, list(visual.fullatt_block_indexes))
    else:
        assert enc.ffn_hidden_size == block.mlp.fc1.out_features and enc.activation == "quick_gelu"
        assert type(block.mlp.act).__name__ == "QuickGELUActivation"
        assert enc.window_size == 0 and enc.full_attention_layers is None
    # No preprocessor_config.json: the processor's defaults.
    assert (enc.min_pixels, enc.max_pixels) == (56 * 56, 28 * 28 * 1280)


PREPROCESSORS = [
    ({}, (56 * 56, 28 * 28 * 1280)),
    ({"min_pixels": 1000, "max_pixels": 150000}, (1000, 150000)),
    ({"size": {"shortest_edge": 2000, "longest_edge": 100000}}, (2000, 100000)),
    ({"size": {"shortest_edge": 2000, "longest_edge": 100000}, "max_pixels": 90000}, (2000, 90000)),
]


@pytest.mark.parametrize("extra,pixels", PREPROCESSORS)
def test_pixel_bounds_come_from_preprocessor_config(tmp_path, extra, pixels):
    from transformers import AutoImageProcessor

    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
           "merge_size": 2, **extra}
    directory = _write(tmp_path / "q", qwen25_flat(), pre)
    size = AutoImageProcessor.from_pretrained(directory).size
    assert (size["shortest_edge"], size["longest_edge"]) == pixels       # what transformers resolves
    enc = load_config(raw_config(directory)).model.encoders["images"]
    assert (enc.min_pixels, enc.max_pixels) == pixels


def test_pixel_bounds_of_a_processor_transformers_5_saved(tmp_path):
    """transformers 5 saves a processor as processor_config.json with the image processor's settings in
    its `image_processor` entry, and reads that entry before any preprocessor_config.json: so does
    mimo. Before, mimo read preprocessor_config.json only, and took the defaults (and CLIP's mean / std)
    where transformers took 784 / 12544 and 0.5."""
    from transformers import AutoImageProcessor

    directory = _write(tmp_path / "q", qwen25_flat())
    nested = {"image_processor": {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14,
                                  "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                                  "image_std": [0.5] * 3, "size": {"shortest_edge": 784, "longest_edge": 12544}},
              "processor_class": "Qwen2_5_VLProcessor"}
    (tmp_path / "q" / "processor_config.json").write_text(json.dumps(nested))
    # A stale preprocessor_config.json beside it: transformers does not read it, and neither may mimo.
    (tmp_path / "q" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 1003520}))
    hf = AutoImageProcessor.from_pretrained(directory)
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (784, 12544)
    enc = load_config(raw_config(directory)).model.encoders["images"]
    assert (enc.min_pixels, enc.max_pixels) == (784, 12544)
    from mimo.config.hf_files import qwen_processor_settings

    settings = qwen_processor_settings(directory)
    assert settings["image_mean"] == list(hf.image_mean) and settings["file"] == "processor_config.json: image_processor"
    # The nested patch size must agree with the ViT too, and the message names where it was read.
    nested["image_processor"]["patch_size"] = 16
    (tmp_path / "q" / "processor_config.json").write_text(json.dumps(nested))
    assert errors(raw_config(directory)) == [("model.hf", "processor_config.json: image_processor patch_size (16) "
                                                          "disagrees with config.json vision_config (14)")]


def test_yaml_may_lower_max_pixels_but_not_change_the_architecture(tmp_path):
    directory = _write(tmp_path / "q", qwen25_flat())
    cfg = load_config(raw_config(directory, max_pixels=28 * 28 * 64, min_pixels=28 * 28 * 4))
    assert (cfg.model.encoders["images"].min_pixels, cfg.model.encoders["images"].max_pixels) == (3136, 50176)
    source = f"{directory}/config.json"
    assert errors(raw_config(directory, max_pixels=50176, window_size=56)) == [
        ("model.encoders.images.window_size", f"56 disagrees with {source} (112)")]
    assert errors(raw_config(directory, max_pixels=50176, projector={"kind": "mlp"})) == [
        ("model.encoders.images.projector.kind", f"'mlp' disagrees with {source} ('patch_merger')")]
    raw = raw_config(directory, max_pixels=50176)
    raw["model"]["language"] = {"mrope_section": [3, 3, 2]}
    assert errors(raw) == [("model.language.mrope_section", f"[3, 3, 2] disagrees with {source} ([2, 3, 3])")]
    raw["model"]["language"] = {"mrope_section": [2, 3, 3], "position_embedding": "mrope"}   # agreeing: fine
    assert errors(raw) == []


def test_default_max_pixels_must_fit_the_sequence(tmp_path):
    """An image at the processor's max_pixels (1280 tokens) does not fit 256 tokens: one error
    naming max_pixels with the bound that fits; that bound passes, one merge block more fails."""
    directory = _write(tmp_path / "q", qwen25_flat())
    assert errors(raw_config(directory, seq=256)) == [
        ("model.encoders.images.max_pixels", "an image of 1003520 pixels is 1280 tokens (max_pixels / 28^2), which "
                                             "does not fit in data.seq_length (256); use max_pixels <= 199920")]
    assert errors(raw_config(directory, seq=256, max_pixels=199920)) == []
    assert [p for p, _ in errors(raw_config(directory, seq=256, max_pixels=199920 + 784))] == [
        "model.encoders.images.max_pixels"]


@pytest.mark.parametrize("change,needle", [
    (lambda c: c.update(model_type="idefics3"),
     "multimodal model type 'idefics3' is not supported (supported: llava, qwen2_5_vl, qwen2_vl)"),
    (lambda c: c["vision_config"].update(out_hidden_size=48),
     "vision_config.out_hidden_size (48) must equal the LLM's hidden_size (64)"),
    (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision hidden_act 'gelu' is not supported"),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 2.0}), "RoPE type 'yarn' is not supported"),
    (lambda c: c["vision_config"].update(rope_parameters={"rope_theta": 5000.0, "rope_type": "axial"}),
     "vision rope_theta 5000.0 is not supported"),
    (lambda c: c["vision_config"].update(patch_size=[14, 16]), "vision_config.patch_size [14, 16] is not supported"),
])
def test_unsupported_hf_configs_are_one_error(tmp_path, change, needle):
    config = qwen25_flat()
    change(config)
    probs = errors(raw_config(_write(tmp_path / "q", config)))
    assert len(probs) == 1 and probs[0][0] == "model.hf" and needle in probs[0][1], probs


def test_processor_patch_size_must_match_the_vit(tmp_path):
    directory = _write(tmp_path / "q", qwen25_flat(), {"patch_size": 16, "merge_size": 2})
    assert errors(raw_config(directory)) == [
        ("model.hf", "preprocessor_config.json patch_size (16) disagrees with config.json vision_config (14)")]


# -- validation of hand-written native / M-RoPE configs -------------------------------------------


def native():
    """tiny() with a native-resolution images encoder (patch 4, merge 2: 8-pixel merge blocks) and
    an M-RoPE LLM (head dim 32 / 4 = 8: four rotary pairs)."""
    raw = tiny()
    raw["model"]["language"].update(position_embedding="mrope", mrope_section=[2, 1, 1])
    raw["model"]["encoders"]["images"] = dict(
        kind="vision", num_layers=2, hidden_size=16, num_attention_heads=2, patch_size=4, resolution="native",
        spatial_merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=8 * 8 * 16,
        position_embedding="rope2d", projector={"kind": "patch_merger"}, window_size=16, full_attention_layers=[1],
        normalization="RMSNorm", activation="swiglu")
    return raw


def with_(raw, path, value, delete=False):
    raw = copy.deepcopy(raw)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if delete:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return raw


def test_native_config_is_valid():
    assert errors(native(), world_size=1) == []
    assert errors(tiny(), world_size=1) == []


I = "model.encoders.images"


@pytest.mark.parametrize("path,value,field", [
    (f"{I}.resolution", "dynamic", f"{I}.resolution"),
    (f"{I}.position_embedding", "sincos", f"{I}.position_embedding"),
    (f"{I}.normalization", "BatchNorm", f"{I}.normalization"),
    (f"{I}.patch_size", None, f"{I}.patch_size"),
    (f"{I}.spatial_merge_size", 0, f"{I}.spatial_merge_size"),
    (f"{I}.temporal_patch_size", 0, f"{I}.temporal_patch_size"),
    (f"{I}.min_pixels", 2000, f"{I}.min_pixels"),                     # above max_pixels (1024)
    (f"{I}.window_size", 12, f"{I}.window_size"),                     # not whole 8-pixel merge blocks
    (f"{I}.window_size", -8, f"{I}.window_size"),
    (f"{I}.full_attention_layers", [2], f"{I}.full_attention_layers[0]"),    # num_layers = 2
    (f"{I}.full_attention_layers", [-1], f"{I}.full_attention_layers[0]"),
    (f"{I}.full_attention_layers", [1, 1], f"{I}.full_attention_layers"),
    (f"{I}.full_attention_layers", "all", f"{I}.full_attention_layers"),
    (f"{I}.projector", {"kind": "mlp"}, f"{I}.projector.kind"),
    (f"{I}.position_embedding", "learned", f"{I}.position_embedding"),
    (f"{I}.image_size", 8, f"{I}.image_size"),
    (f"{I}.class_token", True, f"{I}.class_token"),
    (f"{I}.hidden_size", 12, f"{I}.num_attention_heads"),             # head dim 6: rope2d needs a multiple of 4
    (f"{I}.max_pixels", 8 * 8 * 48, f"{I}.max_pixels"),               # 48 tokens >= data.seq_length 48
    ("model.language.mrope_section", [2, 1, 2], "model.language.mrope_section"),   # sums to 5, head_dim / 2 = 4
    ("model.language.mrope_section", [4], "model.language.mrope_section"),
    ("model.language.mrope_section", [4, 0, 0], "model.language.mrope_section"),
    ("model.language.mrope_section", None, "model.language.mrope_section"),
    ("model.language.rope_scaling", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}, "model.language.rope_scaling"),
    ("model.encoders.audio.resolution", "native", "model.encoders.audio.resolution"),
])
def test_native_rule_names_the_field(path, value, field):
    probs = errors(with_(native(), path, value))
    assert [p for p, _ in probs] == [field], probs


def test_unknown_position_embedding_is_named():
    probs = errors(with_(native(), "model.language.position_embedding", "alibi"))
    assert probs[0] == ("model.language.position_embedding", "must be one of rope, mrope, got 'alibi'"), probs


@pytest.mark.parametrize("path,value,field", [
    (f"{I}.position_embedding", "rope2d", f"{I}.position_embedding"),
    (f"{I}.projector", {"kind": "patch_merger"}, f"{I}.projector.kind"),
    (f"{I}.window_size", 8, f"{I}.window_size"),
    (f"{I}.full_attention_layers", [0], f"{I}.full_attention_layers"),
    ("model.language.mrope_section", [2, 1, 1], "model.language.mrope_section"),   # position_embedding rope
])
def test_native_only_fields_refused_on_fixed_encoders(path, value, field):
    probs = errors(with_(tiny(), path, value))
    assert [p for p, _ in probs] == [field], probs


def test_full_attention_layers_need_windows():
    probs = errors(with_(native(), f"{I}.window_size", 0))
    assert [p for p, _ in probs] == [f"{I}.full_attention_layers"], probs
    assert errors(with_(with_(native(), f"{I}.window_size", 0), f"{I}.full_attention_layers", [])) == []


def test_native_encoder_has_no_fixed_token_count_and_layouts_do_not_trip_on_it():
    cfg = load_config(native())
    with pytest.raises(ValueError, match="native vision encoder has no fixed tokens per image"):
        cfg.model.encoders["images"].tokens_per_item
    # Sequence parallelism and TP over the native encoder: checked without asking tokens_per_item.
    raw = with_(with_(native(), "parallelism.images.tp", 2), "parallelism.images.sp", True)
    raw["parallelism"]["language"] = raw["parallelism"]["audio"] = {"rank_offset": 0, "tp": 2}
    assert errors(raw, world_size=2) == []


def test_no_bad_native_value_causes_a_traceback():
    """Every native / M-RoPE field replaced by every kind of bad value: ConfigError or success."""
    bad_values = [0, -1, "x", None, [1], {"a": 1}, 1.5, True, 10 ** 6, [0, "a"]]
    base = native()
    paths = [f"{I}.{k}" for k in base["model"]["encoders"]["images"]] + [
        "model.language.position_embedding", "model.language.mrope_section"]
    for path in paths:
        for value in bad_values:
            try:
                load_config(with_(base, path, value), world_size=1)
            except ConfigError as exc:
                assert exc.problems and all(isinstance(p, str) and r for p, r in exc.problems)


def test_real_data_checks_the_native_processor_settings(tmp_path):
    """With real data the image processor's files are checked too: for a native encoder its
    preprocessor_config.json statistics (not a fixed image size, which a native ViT has none of)."""
    records = tmp_path / "train.json"
    records.write_text("[]")
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
           "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    good = _write(tmp_path / "good", qwen25_flat(), pre)
    raw = raw_config(good)
    raw["data"].update(kind="llava", path=str(records))
    assert [p for p, _ in errors(raw)] == ["data.tokenizer"]       # the directory holds no tokenizer
    bad = _write(tmp_path / "bad", qwen25_flat(), {**pre, "image_std": [0.5, 0.5]})
    raw["model"]["hf"] = bad
    assert [p for p, _ in errors(raw)] == ["model.encoders.images", "data.tokenizer"]


def test_sequence_parallel_native_vit_needs_tp_dividing_a_merge_block(tmp_path):
    """A native ViT's images hold whole 2 x 2 merge blocks (36 patches for an 84 x 84 image), which
    splits over tp 2 or 4 but not 8: refused at the check (before: at the first step with such an image)."""
    config = qwen25_flat()
    config["vision_config"]["num_heads"] = 8  # (so that tp 8 divides the heads)
    directory = _write(tmp_path / "q", config)
    raw = raw_config(directory)
    for tp, ok in ((2, True), (4, True), (8, False)):
        raw["parallelism"] = {"language": {"dp": tp}, "images": {"tp": tp, "sp": True}}
        raw["training"]["global_batch_size"] = tp
        got = errors(raw)
        assert (got == []) == ok, (tp, got)
    assert got == [("parallelism.images.sp", "needs tp (8) dividing spatial_merge_size^2 (4): an image holds a multiple "
                                             "of 4 patches, which 8 shards may not split (use tp <= 4 dividing it, or "
                                             "sp: false)")]
    raw["parallelism"]["images"]["sp"] = False
    assert errors(raw) == []


@pytest.mark.parametrize("flat", [qwen25_flat, qwen2_flat])
def test_key_value_heads_left_out_are_transformers_default(tmp_path, flat):
    """A config.json without num_key_value_heads: transformers' Qwen-VL text model takes its own default
    (8), where mimo took the query heads (before: 16 here, a model of another shape)."""
    from transformers import AutoConfig

    from mimo.config.hf_arch import multimodal_fields

    config = flat()
    del config["num_key_value_heads"]
    directory = _write(tmp_path / "q", config)
    want = AutoConfig.from_pretrained(directory).text_config.num_key_value_heads
    assert want == 8 != config["num_attention_heads"]
    assert multimodal_fields(config, "model.hf", directory)[0]["num_query_groups"] == want
