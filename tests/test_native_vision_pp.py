"""A pipelined native-resolution ViT (parallelism.images.pp > 1): each stage holds its share of the
layers, picks window or full attention by the GLOBAL layer index, and derives its packed activation
shape, masks and rotary table from the microbatch's grids; the last stage applies the patch merger.
FP32 parity with one rank, and logits against transformers with HF weights loaded into the stages."""

import pytest
import torch

from mimo.runtime import run_on_ranks
from mimo.training.hf_logits import logits_config, merge_logits, _rank_logits
from test_heterogeneous_parity import _merge, _train
from test_native_items import STEPS, _rel, native, qwen_raw
from test_training_parity import assert_same_run


def _per_stage_layer_numbers():
    """The bug the global index prevents: each stage reading full_attention_layers with its own
    layer numbers (restarting at 0 per stage). Applied inside a rank process (a negative control)."""
    import mimo.model.native_vision as nv

    spec = nv.native_layer_spec
    nv.native_layer_spec = lambda attention, full_layers, layer_offset=0, kernel=None: spec(attention, full_layers,
                                                                                         0, kernel)


def _train_per_stage(raw, steps):
    _per_stage_layer_numbers()
    return _train(raw, steps)


def _logits_per_stage(raw, inputs):
    _per_stage_layer_numbers()
    return _rank_logits(raw, inputs)


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, native(), STEPS)[0]


def test_vit_pipeline_on_its_own_ranks_equals_single_rank(reference):
    # The ViT (layer 0 windowed, layer 1 full) at PP2 on ranks 0-1, one layer per stage; the LLM on
    # rank 2. Mock images of several sizes, several windows each: the masks differ per layer.
    raw = native(images=dict(pp=2), language=dict(rank_offset=2))
    got = _merge(run_on_ranks(_train, 3, raw, STEPS, timeout_s=240))
    vit = [k for k in reference["grads"] if k.startswith("images.encoder.block.layers.")]
    assert {k.split(".")[4] for k in vit} == {"0", "1"}  # both stages' layers train
    assert all(reference["grads"][k].abs().sum() > 0 for k in vit)
    assert set(got["grads"]) == set(reference["grads"])
    assert_same_run(reference, got)
    # Negative control: stage 1 numbering its layer 0 (global 1, full) picks the window mask.
    bad = _merge(run_on_ranks(_train_per_stage, 3, raw, STEPS, timeout_s=240))
    with pytest.raises(AssertionError):
        assert_same_run(reference, bad)


def test_vit_pipeline_with_tensor_and_sequence_parallelism_colocated_equals_single_rank(reference):
    # ViT tp2 + sp x pp2 (full recompute) and LLM tp2 x dp2 on the same four ranks: the colocated edge
    # with a pipelined encoder (one chunk of images per LLM microbatch); between the ViT's stages each
    # rank sends its half of the packed patches.
    raw = native(images=dict(tp=2, pp=2, sp=True, recompute="full"), language=dict(tp=2, dp=2))
    got = _merge(run_on_ranks(_train, 4, raw, STEPS, timeout_s=240))
    assert_same_run(reference, got)


@pytest.fixture(scope="module")
def qwen25_vl_two_layers(tmp_path_factory):
    """A tiny random Qwen2.5-VL whose ViT has a window layer (0) then a full-attention layer (1), with
    windows of 2 x 2 merge units; three images of different grids, two of them several windows."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mimo.data.items import grid_tokens
    from test_mrope import IMAGE, tiny_qwen_vl

    config = tiny_qwen_vl("2.5").config.to_dict()  # the shared tiny model's text side and token ids
    config["vision_config"].update(depth=2, fullatt_block_indexes=[1], window_size=56)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).eval()
    vc = model.config.vision_config
    assert (vc.depth, vc.fullatt_block_indexes, vc.window_size) == (2, [1], 56)
    directory = str(tmp_path_factory.mktemp("qwen25_vl_pp") / "hf")
    model.save_pretrained(directory)
    grids = [(1, 4, 6), (1, 6, 2), (1, 2, 4)]  # 2, 2 and 1 windows
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(3, IMAGE - 1, (n,), generator=g).tolist()  # noqa: E731
    image = lambda grid: [IMAGE + 2] + [IMAGE] * grid_tokens(grid, 2) + [IMAGE + 3]  # noqa: E731
    rows = [text(4) + image(grids[0]) + text(3) + image(grids[1]) + text(5), text(2) + image(grids[2]) + text(10)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + text(width - len(r)) for r in rows])
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)
    inputs = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}
    with torch.no_grad():
        ref = model(**inputs, mm_token_type_ids=(ids == IMAGE).long()).logits
    return directory, inputs, ref


def _logits(fn, raw, inputs):
    batch = inputs["input_ids"].shape[0]
    raw = logits_config(raw, batch, inputs["input_ids"].shape[1])
    return merge_logits(run_on_ranks(fn, 3, raw, inputs, timeout_s=240), batch)


def test_qwen25_vl_logits_with_the_vit_pipelined_equal_transformers(qwen25_vl_two_layers):
    # HF weights read into each stage at its layer offset; the stage boundary falls between the
    # window layer and the full one, so only the global layer index picks the right masks.
    directory, inputs, ref = qwen25_vl_two_layers
    raw = qwen_raw(directory, images=dict(pp=2), language=dict(rank_offset=2))
    assert _rel(_logits(_rank_logits, raw, inputs), ref) < 1e-4
    # Negative control: the per-stage layer number makes stage 1's full layer a window layer.
    assert _rel(_logits(_logits_per_stage, raw, inputs), ref) > 1e-3
