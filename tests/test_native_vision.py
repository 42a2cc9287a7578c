"""Native-resolution vision (Qwen2.5-VL / Qwen2-VL ViT + patch merger) against transformers.

Tiny random HF models are built and saved here; mimo's NativeVisionEncoder and
PatchMerger load their visual weights through mimo.hf's mapping and must give
`model.visual(pixel_values, grid_thw)`'s merged embeddings (FP32, 1e-4) for
three images of different sizes, each cut into several windows, and a two-frame clip: at 1 rank and
at TP2 (+ sequence parallelism, + activation recompute) on 2 gloo ranks, with
bitfield and sdpa attention. Negative control: every layer full-attention.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo.config.schema import EncoderConfig, ParallelConfig, ProjectorConfig
from mimo.hf.convert import split_entry
from mimo.hf.load import load_hf_part, read_shard
from mimo.hf.mapping import HFModule, native_vision_entries, patch_merger_entries
from mimo.hf.source import Source
from mimo.model.multimodal import EncoderWithProjector
from mimo.model.native_vision import NativeVisionEncoder, layer_masks
from mimo.model.projector import build_projector
from mimo.model.transformer_config import transformer_config
from mimo.runtime import megatron_scope, run_on_ranks, select_runtime
from mimo.topology import Layout

TOL = 1e-4
LLM_HIDDEN = 24
# (t, h, w) in patches; with patch 4, merge 2 and window_size 16 a window is 2 x 2 merge units,
# so these images hold 2, 4 and 6 windows (the last row/column of windows cut short); the last item
# has two frames (a video clip), each its own window and its own full-attention segment.
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 6, 10), (2, 4, 4)]
PATCH, TEMPORAL, MERGE, WINDOW = 4, 2, 2, 16


def _text():
    return dict(hidden_size=LLM_HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(text_config=_text(), image_token_id=60, vision_config=dict(
        depth=4, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=LLM_HIDDEN, patch_size=PATCH,
        temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=WINDOW, fullatt_block_indexes=[1, 3]))
    return _save(Qwen2_5_VLForConditionalGeneration(cfg), tmp_path_factory.mktemp("qwen25"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(text_config=_text(), image_token_id=60, vision_config=dict(
        depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=LLM_HIDDEN, patch_size=PATCH,
        temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE))
    return _save(Qwen2VLForConditionalGeneration(cfg), tmp_path_factory.mktemp("qwen2"))


def _save(model, directory):
    """Random weights of visible size (HF initialises some to zeros / ones), saved; the directory and
    the merged embeddings of transformers' visual tower on the test's images."""
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory))
    patches, _ = _inputs()
    with torch.no_grad():
        ref = model.model.visual(patches, grid_thw=torch.tensor(GRIDS)).pooler_output
    return str(directory), ref


def _inputs():
    n = sum(t * h * w for t, h, w in GRIDS)
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3 * TEMPORAL * PATCH * PATCH, generator=g), list(GRIDS)


def _encoder_cfg(qwen25: bool, attention: str, all_full: bool = False) -> EncoderConfig:
    arch = (dict(num_layers=4, ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
                 window_size=0 if all_full else WINDOW, full_attention_layers=[1, 3]) if qwen25 else
            dict(num_layers=2, ffn_hidden_size=64, normalization="LayerNorm", activation="quick_gelu"))
    return EncoderConfig(kind="vision", hidden_size=32, num_attention_heads=4, norm_eps=1e-6, attention=attention,
                         resolution="native", patch_size=PATCH, temporal_patch_size=TEMPORAL,
                         spatial_merge_size=MERGE, position_embedding="rope2d",
                         projector=ProjectorConfig(kind="patch_merger"), **arch)


def _groups():
    pgs = ProcessGroupCollection()
    for key in ("tp", "cp", "pp", "dp", "tp_cp", "dp_cp", "tp_dp_cp", "mp", "embd", "pos_embd"):
        setattr(pgs, key, dist.group.WORLD)  # every rank is one TP group
    return pgs


def _build(enc: EncoderConfig, directory: str, sp=False, recompute="none") -> EncoderWithProjector:
    tp, rank = dist.get_world_size(), dist.get_rank()
    pgs, layout = _groups(), Layout(tp=tp)
    ecfg = transformer_config(enc, layout, "fp32", par=ParallelConfig(tp=tp, sp=sp, recompute=recompute))
    lang = EncoderConfig(kind="vision", num_layers=1, hidden_size=LLM_HIDDEN, num_attention_heads=2)
    lcfg = transformer_config(lang, layout, "fp32")
    module = EncoderWithProjector(NativeVisionEncoder(ecfg, enc, pgs),
                                  build_projector(lcfg, enc.hidden_size, "patch_merger", pgs.tp, encoder_cfg=enc))
    entries = native_vision_entries(enc) + patch_merger_entries(enc, LLM_HIDDEN)
    load_hf_part(module, HFModule("images", directory, entries, True), Source(directory), 0, rank, tp)
    assert module.encoder.block.layers[0].self_attention.linear_qkv.weight.shape[0] == 3 * enc.hidden_size // tp
    return module


def _merged(enc, directory, sp=False, recompute="none", train=False):
    """Merged embeddings; in training mode (where megatron recomputes) also the patch embedding's
    gradient of a square loss."""
    module = _build(enc, directory, sp, recompute)
    assert module.encoder.config.recompute_granularity == (None if recompute == "none" else recompute)
    patches, grids = _inputs()
    module.train(train)
    with torch.set_grad_enabled(train):
        out = module.projector(module.encoder(patches, grids))
    if not train:
        return out, None
    out.square().sum().backward()
    return out.detach(), module.encoder.patch_embed.weight.grad


def _runs(enc, directory, runs):
    with megatron_scope(select_runtime("cpu")):  # megatron's sequence-parallel buffers on a CPU rank
        return [_merged(enc, directory, **kw) for kw in runs]


def rel(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_window_ids_follow_hf_get_window_index():
    """Each window of HF's get_vision_window_index (a run of merge units in its permutation) is
    exactly one of our window ids, and full layers see one image each."""
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor(GRIDS), MERGE, WINDOW, PATCH)
    masks = layer_masks(GRIDS, MERGE, WINDOW // PATCH // MERGE)
    window = masks[1, 1, 0].reshape(-1, MERGE * MERGE)[:, 0]  # one id per merge unit
    hf_groups = [set(index[a // 4:b // 4].tolist()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ours = [set(torch.nonzero(window == w).flatten().tolist()) for w in window.unique()]
    assert sorted(map(sorted, hf_groups)) == sorted(map(sorted, ours)) and len(ours) == 2 + 4 + 6 + 2
    assert masks[0, 1, 0].unique_consecutive().tolist() == [0, 1, 2, 3, 4]  # one id per frame
    assert (masks[:, 0] == 1).all()  # every token bidirectional (bit TEXT)


@pytest.mark.parametrize("attention", ["bitfield", "sdpa"])
def test_qwen25_single_rank_and_all_full_attention_negative_control(qwen25, attention):
    directory, ref = qwen25
    (got, _), = run_on_ranks(_runs, 1, _encoder_cfg(True, attention), directory, [{}])[0]
    (full, _), = run_on_ranks(_runs, 1, _encoder_cfg(True, attention, all_full=True), directory, [{}])[0]
    assert got.shape == ref.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, LLM_HIDDEN)
    assert rel(got, ref) < TOL
    assert rel(full, ref) > 100 * TOL  # windows matter: the model is not checked by luck


def test_qwen25_bitfield_kernels_in_triton_interpreter(qwen25, monkeypatch):
    """The bitfield kernels (what CUDA runs) rather than the dense reference, on the window ids."""
    directory, ref = qwen25
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (got, _), = run_on_ranks(_runs, 1, _encoder_cfg(True, "bitfield"), directory, [{}])[0]
    assert rel(got, ref) < TOL


def test_qwen25_tp2_sp_and_recompute(qwen25):
    """TP2 with bitfield attention; TP2 + SP (bitfield and sdpa); TP2 + SP training with full and
    with selective recompute, whose patch-embedding gradients (replicated over TP) must equal the
    gradient without recompute."""
    directory, ref = qwen25
    train = [dict(sp=True, train=True, recompute=r) for r in ("none", "full", "selective")]
    bitfield = run_on_ranks(_runs, 2, _encoder_cfg(True, "bitfield"), directory, [{}, dict(sp=True)] + train)
    sdpa = run_on_ranks(_runs, 2, _encoder_cfg(True, "sdpa"), directory, [dict(sp=True)])
    for rank in (0, 1):
        for got, _ in bitfield[rank] + sdpa[rank]:
            assert rel(got, ref) < TOL
        (_, grad), (_, g_full), (_, g_sel) = bitfield[rank][2:]
        assert grad.abs().max() > 0 and rel(g_full, grad) < 1e-6 and rel(g_sel, grad) < 1e-6
    assert rel(bitfield[0][2][1], bitfield[1][2][1]) < 1e-6


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_vl_no_windows(qwen2, tp):
    directory, ref = qwen2
    runs = [{}] if tp == 1 else [{}, dict(sp=True)]
    outs = run_on_ranks(_runs, tp, _encoder_cfg(False, "bitfield"), directory, runs)
    for rank_outs in outs:
        for got, _ in rank_outs:
            assert rel(got, ref) < TOL


def test_export_writes_the_packed_qkv_back_exactly(qwen25):
    """Import then export (mimo.hf.convert.split_entry) of every tower and merger tensor is the identity."""
    directory, _ = qwen25
    src, enc = Source(directory), _encoder_cfg(True, "bitfield")
    entries = native_vision_entries(enc) + patch_merger_entries(enc, LLM_HIDDEN)
    assert any(e.kind == "packed_qkv" for e in entries) and any(e.kind == "glu" for e in entries)
    for entry in entries:
        src.check(entry)
        full = read_shard(src, entry, torch.nn.Parameter(torch.empty(0)), 0, 1)
        for key, tensor in split_entry(entry, full, src).items():
            assert torch.equal(tensor, src.read(key)), key
    qkv = next(e for e in entries if e.kind == "packed_qkv")
    fused = read_shard(src, qkv, torch.nn.Parameter(torch.empty(0)), 0, 1)
    assert not torch.equal(fused, src.read(src.key(qkv.role, qkv.hf[0])))  # megatron's order is not HF's


def test_bad_input_is_a_value_error(qwen2):
    directory, _ = qwen2
    with pytest.raises(Exception, match="h and w"):
        run_on_ranks(_bad, 1, _encoder_cfg(False, "sdpa"), directory, [(1, 4, 5)])
    with pytest.raises(Exception, match="patches must be"):
        run_on_ranks(_bad, 1, _encoder_cfg(False, "sdpa"), directory, [(1, 4, 4)])


def _bad(enc, directory, grids):
    with megatron_scope(select_runtime("cpu")):
        module = _build(enc, directory)
        patches, _ = _inputs()
        module.encoder(patches, grids)
