"""Ragged items: native-resolution images, each its own number of patches and LLM tokens, through the
trainer's windows, boundaries, FLOP count and inputs; FP32 parity of a heterogeneous layout."""

import copy

import pytest
import torch

from mimo.balance.assignment import contiguous
from mimo.config import load_config
from mimo.data import MockMultimodalDataset, collate
from mimo.data.items import PackedItems, divide_items, grid_tokens, sample_item_tokens, step_item_tokens
from mimo.data.mock import Sample
from mimo.runtime import run_on_ranks
from mimo.training.flops import RankWork, microbatch_work, native_attention_pairs, step_flops, step_work
from mimo.training.metrics import pack_work, unpack_work
from mimo.training.hf_logits import split_inputs
from mimo.training.windows import StepWindows
from test_heterogeneous_parity import _merge, _train
from test_training_parity import assert_same_run
from tiny import TINY

STEPS = 2


def native(**parallelism):
    """TINY's LLM with one native-resolution ViT (Qwen2.5-VL style: RMSNorm, gated MLP, windows)."""
    raw = copy.deepcopy(TINY)
    raw["model"]["encoders"] = {"images": dict(
        kind="vision", resolution="native", num_layers=2, hidden_size=16, num_attention_heads=2, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, min_pixels=16, max_pixels=144, position_embedding="rope2d",
        normalization="RMSNorm", activation="swiglu", window_size=8, full_attention_layers=[1],
        projector={"kind": "patch_merger"})}
    raw["parallelism"] = {"language": {}, "images": {}, **parallelism}
    return raw


class _Window:
    """What a window asks of the edge's plan (a stand-in for `EdgePlan.for_window`'s result)."""

    def __init__(self, src, dst, tokens):
        self.src, self.dst, self.tokens = src, dst, tokens

    def __iter__(self):
        return iter((self.src, self.dst, self.tokens))

    def src_interval(self, i):
        return self.src[i], self.src[i + 1]

    def dst_interval(self, j):
        return self.dst[j], self.dst[j + 1]


class _Plan:
    def for_window(self, src, dst, tokens):
        return _Window(src, dst, tokens)


class _Comm:
    plan = _Plan()


def _windows(cfg, samples):
    counts = {n: [s.count(n) for s in samples] for n in cfg.model.encoders}
    return StepWindows(cfg, {"images": _Comm()}, counts, [], contiguous(len(samples), 1, 1),
                       step_item_tokens(cfg, samples))


def _sample(grids, merge=2):
    """A sample whose input_ids hold one placeholder run per image (id 127: TINY's top id)."""
    runs = [torch.full((grid_tokens(g, merge),), 127) for g in grids]
    ids = torch.cat([torch.tensor([5])] + runs + [torch.tensor([6])])
    patches = torch.zeros(sum(t * h * w for t, h, w in grids), 24)
    return Sample(input_ids=ids, items={"images": patches}, grids={"images": list(grids)})


# -- item sizes and windows ------------------------------------------------------------------------


def test_item_tokens_come_from_grids_and_fixed_encoders_keep_their_count():
    cfg = load_config(native())
    s = _sample([(1, 2, 2), (1, 4, 6), (2, 2, 4)])
    assert sample_item_tokens(cfg.model.encoders["images"], s, "images") == [1, 6, 4]
    fixed = load_config(copy.deepcopy(TINY))
    mock = MockMultimodalDataset(fixed).sample(0)
    n = mock.count("images")
    assert sample_item_tokens(fixed.model.encoders["images"], mock, "images") == [4] * n  # (8 / 4)^2
    with pytest.raises(ValueError, match=r"Sample.grids\['images'\]"):
        sample_item_tokens(cfg.model.encoders["images"], Sample(input_ids=s.input_ids, items=s.items), "images")


def test_windows_divide_mixed_sizes_by_tokens_and_swapping_two_sizes_changes_the_division():
    cfg = load_config(native(images=dict(dp=2, rank_offset=1)))
    small, big = (1, 2, 2), (1, 6, 6)  # 1 and 9 LLM tokens
    step = [_sample([big, small]), _sample([small, small])]
    (src, dst, tokens), ids = _windows(cfg, step).window("images")
    assert ids == [0, 1, 2, 3] and tokens == [9, 1, 1, 1]
    assert src == divide_items([9, 1, 1, 1], 2) == [0, 1, 4]  # the big image alone on encoder rank 0
    assert dst == [0, 4]
    # Negative control: the same items with two sizes swapped divide differently.
    swapped = [_sample([small, big]), _sample([small, small])]
    (src2, _, tokens2), _ = _windows(cfg, swapped).window("images")
    assert tokens2 == [1, 9, 1, 1] and src2 == [0, 2, 4] and src2 != src
    w = _windows(cfg, step)
    assert w.llm_tokens("images", 0) == 12 and w.sample_tokens("images") == [10, 2]
    assert w.encoder_item_ids("images", 0) == [0] and w.encoder_item_ids("images", 1) == [1, 2, 3]


def test_mock_native_samples_have_runs_of_their_grids_length():
    cfg = load_config(native())
    ds = MockMultimodalDataset(cfg)
    sizes = set()
    for i in range(12):
        s = ds.sample(i)
        tokens = sample_item_tokens(cfg.model.encoders["images"], s, "images")
        ids = s.input_ids.tolist()
        assert sum(tokens) == ids.count(cfg.placeholder_ids["images"])
        assert s.items["images"].shape == (sum(t * h * w for t, h, w in s.grids["images"]), 24)
        for k, g in enumerate(s.grids["images"]):
            assert s.item("images", k).shape == (g[0] * g[1] * g[2], 24)
        sizes |= set(tokens)
        assert torch.equal(ds.sample(i).items["images"], s.items["images"])  # deterministic
    assert len(sizes) > 1  # the mock draws images of several sizes
    batch = collate([ds.sample(0), ds.sample(3)], cfg.placeholder_ids)
    assert isinstance(batch["images"], PackedItems)
    assert batch["images"].grids == ds.sample(0).grids["images"] + ds.sample(3).grids["images"]
    assert batch["images_grids"].tolist() == [list(g) for g in batch["images"].grids]


def test_flops_count_each_image_by_its_own_patches():
    raw = native()
    raw["training"].update(global_batch_size=2, micro_batch_size=2)  # the step below
    cfg = load_config(raw)
    enc = cfg.model.encoders["images"]
    # Windows of 8 px = 2 merge units: a 6 x 6 patch image (3 x 3 units) has windows 2x2, 2x1, 1x2, 1x1 units.
    window = sum((r * c * 4) ** 2 for r in (2, 1) for c in (2, 1))
    assert native_attention_pairs(enc, (1, 6, 6)) == 36 ** 2 + window  # layer 1 full, layer 0 windowed
    def padded(grids):
        s = _sample(grids)
        s.input_ids = torch.cat([s.input_ids, torch.full((48 - s.input_ids.shape[0],), 7)])
        return s
    samples = [padded([(1, 6, 6), (1, 2, 2)]), padded([(1, 2, 2)])]
    whole = step_work(cfg, samples)
    assert whole.encoder_patches == {"images": 36 + 4 + 4}
    host = collate(samples, cfg.placeholder_ids, False)
    assert microbatch_work(cfg, host["input_ids"], None, {"images": host["images_counts"]}, None,
                           {"images": host["images_grids"]}) == whole
    # The metrics all-reduce carries the native counts (two more slots per native encoder).
    assert unpack_work(cfg, pack_work(cfg, RankWork(0, whole))) == whole
    bigger = step_work(cfg, [padded([(1, 6, 6), (1, 6, 6)]), samples[1]])
    assert step_flops(cfg, bigger) > step_flops(cfg, whole)  # same item count, bigger image: more FLOPs


# -- inputs of tools/hf_logits.py -----------------------------------------------------------------


def test_split_inputs_takes_pixel_values_and_image_grid_thw():
    cfg = load_config(native())
    P = cfg.placeholder_ids["images"]
    grids = [(1, 2, 2), (1, 4, 2), (1, 2, 2), (1, 2, 2)]  # 1, 2, 1 and 1 LLM tokens
    ids = torch.tensor([[5, P, 6, P, P, 7, 0, 0],     # images 0 and 1
                        [5, P, P, 6, 7, 7, 0, 0]])    # images 2 and 3, adjacent runs
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 24)
    out = split_inputs(cfg, {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor(grids)})
    assert out[0].grids["images"] == grids[:2] and out[1].grids["images"] == grids[2:]
    assert torch.equal(torch.cat([out[0].items["images"], out[1].items["images"]]), pixels)
    bad = torch.tensor(grids)
    bad[1, 1] = 8  # image 1 now 4 tokens, its run holds 2
    with pytest.raises(ValueError, match=r"^image_grid_thw: image 1 \(1, 8, 2\) is 4 placeholder tokens"):
        split_inputs(cfg, {"input_ids": ids, "pixel_values": torch.randn(pixels.shape[0] + 8, 24),
                           "image_grid_thw": bad})
    with pytest.raises(ValueError, match="^pixel_values"):
        split_inputs(cfg, {"input_ids": ids, "pixel_values": pixels[1:], "image_grid_thw": torch.tensor(grids)})


# -- FP32 parity ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, native(), STEPS)[0]


def test_heterogeneous_layout_equals_single_rank(reference):
    # LLM on rank 0, the ViT DP2 on ranks 1-2: images of several sizes divided by tokens.
    raw = native(images=dict(dp=2, rank_offset=1))
    got = _merge(run_on_ranks(_train, 3, raw, STEPS, timeout_s=240))
    vit = [k for k in reference["grads"] if k.startswith("images.encoder.")]
    assert vit and all(reference["grads"][k].abs().sum() > 0 for k in vit)  # the ViT trains
    assert set(got["grads"]) == set(reference["grads"])
    assert_same_run(reference, got)


def test_parity_catches_ragged_gradients_sent_back_in_the_wrong_order(reference):
    raw = native(images=dict(dp=2, rank_offset=1))
    got = _merge(run_on_ranks(_train, 3, raw, STEPS, "reverse_boundary_grad", timeout_s=240))
    with pytest.raises(AssertionError):
        assert_same_run(reference, got)


def test_data_parallel_layout_equals_single_rank(reference):
    # Every module DP2 on the same ranks: each rank's microbatches carry their packed images.
    got = run_on_ranks(_train, 2, native(language=dict(dp=2), images=dict(dp=2)), STEPS, timeout_s=240)
    for r in got:
        assert_same_run(reference, r)


def test_colocated_layout_equals_single_rank(reference):
    # Both on ranks 0-1, different layouts (LLM tp2, ViT dp2): the colocated edge moves the whole
    # step at once and the LLM cuts it per microbatch by each sample's image tokens.
    got = _merge(run_on_ranks(_train, 2, native(language=dict(tp=2), images=dict(dp=2)), STEPS, timeout_s=240))
    assert_same_run(reference, got)


def test_vit_tensor_parallel_colocated_equals_single_rank(reference):
    # LLM dp2 fed by a ViT tp2 on the same ranks (fan-out of packed images of several sizes).
    got = _merge(run_on_ranks(_train, 2, native(language=dict(dp=2), images=dict(tp=2)), STEPS, timeout_s=240))
    assert_same_run(reference, got)


# -- real (LLaVA-format) data: each image's run from its header ------------------------------------


@pytest.fixture(scope="module")
def native_data(tmp_path_factory):
    """tools/make_sample_data.py's records, their images redrawn at several sizes (4 to 16 px a side)."""
    import os
    import sys

    from PIL import Image

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools"))
    import make_sample_data

    out = str(tmp_path_factory.mktemp("native_llava"))
    assert make_sample_data.main([out, "--records", "24", "--image-size", "16"]) == 0
    images = sorted(os.listdir(os.path.join(out, "images")))
    for k, name in enumerate(images):
        path = os.path.join(out, "images", name)
        with Image.open(path) as img:
            img.convert("RGB").resize((4 + 4 * (k % 4), 4 + 4 * ((k // 4) % 4))).save(path)
    return out


def native_llava(data_dir, **parallelism):
    import os

    raw = native(**parallelism)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["data"] = {"kind": "llava", "path": os.path.join(data_dir, "train.json"), "seed": 3,
                   "tokenizer": os.path.join(data_dir, "tokenizer"), "seq_length": 48, "packing": True}
    return raw


def test_llava_records_carry_their_images_grids_and_patches(native_data):
    import os

    from PIL import Image

    from mimo.data import build_dataset
    from mimo.data.native_images import image_patches, native_grid

    from mimo.data import llava

    cfg = load_config(native_llava(native_data))
    enc = cfg.model.encoders["images"]
    ds = build_dataset(cfg)
    opened, check = [], llava.check_image
    llava.check_image = lambda p: opened.append(p) or check(p)
    try:
        ds.plan(0)
    finally:
        llava.check_image = check
    # Every rank plans every record: each image header is read once (for its grid), not twice (the
    # plan also reads the record that did not fit the last sequence).
    assert len(opened) == len(set(opened)) >= sum(len(s.items.paths["images"]) for s in ds.plan(0).samples) > 0
    seen = set()
    for j in range(cfg.training.global_batch_size):
        s = ds.sample(j)
        paths = s.items.paths["images"]
        assert len(s.grids["images"]) == len(paths) == s.count("images")
        tokens = sample_item_tokens(enc, s, "images")
        assert sum(tokens) == s.input_ids.tolist().count(cfg.placeholder_ids["images"])
        for k, p in enumerate(paths):
            with Image.open(os.path.join(native_data, p) if not os.path.isabs(p) else p) as img:
                assert s.grids["images"][k] == native_grid(*img.size, enc)
                want, _ = image_patches(img, enc)
            assert torch.equal(s.item("images", k), torch.from_numpy(want))
        seen |= set(tokens)
    assert len(seen) > 1


def test_llava_native_heterogeneous_layout_equals_single_rank(native_data):
    ref = run_on_ranks(_train, 1, native_llava(native_data), 1)[0]
    got = _merge(run_on_ranks(_train, 3, native_llava(native_data, images=dict(dp=2, rank_offset=1)), 1,
                              timeout_s=240))
    assert_same_run(ref, got)


# -- end to end against transformers: a tiny Qwen2.5-VL through tools/hf_logits.py's path ----------


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory):
    """A tiny random Qwen2_5_VLForConditionalGeneration saved offline, and processor-style inputs:
    three images of different grids in two rows (<|vision_start|> run <|vision_end|>)."""
    from test_mrope import IMAGE, tiny_qwen_vl

    model = tiny_qwen_vl("2.5")
    directory = str(tmp_path_factory.mktemp("qwen25_vl") / "hf")
    model.save_pretrained(directory)
    grids = [(1, 4, 6), (1, 6, 2), (1, 2, 4)]  # 6, 3 and 2 LLM tokens
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


def qwen_raw(directory, **parallelism):
    return {"model": {"hf": directory, "encoders": {"images": {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 8}}},
            "parallelism": {"language": {}, "images": {}, **parallelism}, "training": {"global_batch_size": 2}}


def _rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def test_qwen25_vl_logits_equal_transformers_at_one_rank_and_a_heterogeneous_layout(qwen25_vl):
    from mimo.training.hf_logits import hf_logits

    directory, inputs, ref = qwen25_vl
    assert _rel(hf_logits(qwen_raw(directory), inputs), ref) < 1e-4
    # The LLM on rank 0, the ViT DP2 on ranks 1-2 (the 6-token image alone on one of them).
    assert _rel(hf_logits(qwen_raw(directory, images=dict(dp=2, rank_offset=1)), inputs), ref) < 1e-4
    # Negative control: image 0 read as 6 x 4 patches instead of 4 x 6 (same token count).
    swapped = {**inputs, "image_grid_thw": torch.tensor([(1, 6, 4), (1, 6, 2), (1, 2, 4)])}
    assert _rel(hf_logits(qwen_raw(directory), swapped), ref) > 1e-4


def test_hf_logits_tool_reports_a_bad_image_grid_as_one_error_line(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    cfg_path, inputs_path = tmp_path / "native.yaml", tmp_path / "in.pt"
    cfg_path.write_text(yaml.safe_dump(native()))
    P = load_config(native()).placeholder_ids["images"]
    torch.save({"input_ids": torch.tensor([[5, P, P] + [6] * 13]), "pixel_values": torch.randn(16, 24),
                "image_grid_thw": torch.tensor([[1, 4, 4]])}, inputs_path)  # 4 tokens for a run of 2
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "hf_logits.py")
    out = subprocess.run([sys.executable, tool, "--config", str(cfg_path), "--inputs", str(inputs_path),
                          "--out", str(tmp_path / "out.pt")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "image_grid_thw: image 0" in out.stderr
