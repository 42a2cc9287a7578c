"""Training a Qwen2.5-VL (model.hf) on LLaVA-format records whose images have five sizes.

The data path against transformers' own processor (chat template, placeholders, pixels), M-RoPE
positions of packed records against the HF model's get_rope_index, bad media, and FP32 training
parity (losses, first-step gradients, final weights) of two multi-rank layouts with one rank."""

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.parity import merge_ranks, record_run
from mimo.training.state import TIED_COPY
from test_training_parity import assert_same_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_sample_data  # noqa: E402

# Five picture sizes (width x height, none a multiple of 28) -> patch grids (t, h, w) with 28-px merge
# blocks in [28*28, 28*28*6] pixels: 1, 2, 3, 4 and 6 LLM tokens.
SIZES = "30x26,60x25,27x90,50x58,80x60"
GRIDS = {(1, 2, 2), (1, 2, 4), (1, 6, 2), (1, 4, 4), (1, 4, 6)}
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 6
STEPS = 2


def tiny_qwen25_vl():
    """A tiny random Qwen2.5-VL: a window layer and a full-attention layer, tied embeddings, the
    vision token ids of make_sample_data's Qwen-VL tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {k: make_sample_data.QWEN_VL_IDS[t] for k, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1])
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                               tie_word_embeddings=True, **ids)).eval()


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    """(records directory, HF directory): 40 LLaVA records (captions, two-image questions, text only)
    over pictures of five sizes; the model, its tokenizer (Qwen2-VL chat template) and its image
    processor's preprocessor_config.json saved in one HF directory (the records' own directory also
    gets make_sample_data's plain tokenizer, which the configs below never name)."""
    from transformers import Qwen2VLImageProcessorPil

    out = str(tmp_path_factory.mktemp("qwen_llava"))
    assert make_sample_data.main([out, "--records", "40", "--image-sizes", SIZES]) == 0
    hf = os.path.join(out, "hf")
    tiny_qwen25_vl().save_pretrained(hf)
    make_sample_data.make_qwen_vl_tokenizer(hf)
    # Not the processor's default statistics: the pixels below show they are read from the directory.
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=[0.5, 0.4, 0.3],
                             image_std=[0.2, 0.25, 0.3]).save_pretrained(hf)
    return out, hf


def qwen_llava(data, packing=True, **parallelism):
    out, hf = data
    return {"model": {"hf": hf, "language": {"attention": "bitfield"}},
            "parallelism": {"language": {}, "images": {}, **parallelism},
            "data": {"kind": "llava", "path": os.path.join(out, "train.json"), "seq_length": 96,
                     "packing": packing, "seed": 3},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": STEPS, "optimizer": "sgd",
                         "lr": 0.1, "seed": 7}}


def _dataset(raw):
    from mimo.data import build_dataset

    return build_dataset(load_config(raw))


def _processor(hf, monkeypatch):
    """transformers' Qwen2_5_VLProcessor from the HF directory's tokenizer and image processor. Without
    torchvision its video processor cannot be looked up, and the class check that looks it up is
    skipped: images never reach it."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    tok = AutoTokenizer.from_pretrained(hf)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(hf), tokenizer=tok,
                               chat_template=tok.chat_template)


def _hf_conversation(record, root):
    """A LLaVA record as the processor's messages: each `<image>` an image part holding the picture."""
    from PIL import Image

    images = record.get("image", [])
    images = iter([images] if isinstance(images, str) else images)
    role = {"human": "user", "gpt": "assistant"}
    messages = []
    for turn in record["conversations"]:
        parts = []
        for k, text in enumerate(turn["value"].split("<image>")):
            if k:
                parts.append({"type": "image", "image": Image.open(os.path.join(root, next(images))).convert("RGB")})
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({"role": role[turn["from"]], "content": parts})
    return messages


# -- the data path against transformers ------------------------------------------------------------


def test_records_render_as_the_hf_processor_renders_them(qwen_data, monkeypatch):
    out, hf = qwen_data
    raw = qwen_llava(qwen_data)
    ds = _dataset(raw)
    assert ds.encoder.image_text == "<|image_pad|>"  # the template renders image parts itself
    proc = _processor(hf, monkeypatch)
    records = json.load(open(os.path.join(out, "train.json")))
    kinds = set()
    for i, record in enumerate(records[:8]):  # captions, a two-image two-round question, text only
        want = proc.apply_chat_template(_hf_conversation(record, out), tokenize=True, return_dict=True,
                                        return_tensors="pt")
        got = ds.encoder.encode(record, i)
        assert got.input_ids == want["input_ids"][0].tolist(), record["id"]
        grids = want.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)).tolist()
        assert [list(g) for g in got.grids] == grids
        if got.images:
            assert torch.equal(torch.cat([ds.image_loader(p) for p in got.images]), want["pixel_values"])
        # Loss on the answers only: never a vision token, always each answer's <|im_end|>.
        answers = [i for i, keep in zip(got.input_ids, got.targets) if keep]
        assert not set(answers) & set(make_sample_data.QWEN_VL_IDS.values())
        assert answers.count(ds.encoder.tok.convert_tokens_to_ids("<|im_end|>")) == len(record["conversations"]) // 2
        kinds.add(len(got.images))
    assert kinds == {0, 1, 2}
    # Negative control: the same template fed plain text with `<image>` tags (image parts off) loses
    # <|vision_start|> / <|vision_end|> around each run, and the ids no longer match.
    plain = copy.copy(ds.encoder)
    plain.image_text, plain._image_piece, plain._tags = None, "<image>", re.compile("(<image>|<audio>)")
    want = proc.apply_chat_template(_hf_conversation(records[0], out), tokenize=True, return_dict=True)
    assert plain.encode(records[0], 0).input_ids != list(want["input_ids"][0])


def test_packed_steps_mix_sizes_and_positions_restart_per_record_as_get_rope_index(qwen_data):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mimo.data import collate
    from mimo.data.mrope import microbatch_mrope_position_ids

    raw = qwen_llava(qwen_data)
    cfg = load_config(raw)
    ds = _dataset(raw)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_data[1]).eval()
    image = cfg.placeholder_ids["images"]
    seen = set()
    for step in range(STEPS):
        samples = [ds.sample(step * 8 + j) for j in range(8)]
        grids = {tuple(g) for s in samples for g in s.grids["images"]}
        assert len(grids) >= 3, grids  # several sizes in every step
        seen |= grids
        assert max(len(r) for r in ds.plan(step).record_ids) > 1  # packed: several records per sequence
        host = collate(samples, cfg.placeholder_ids, False)
        pos = microbatch_mrope_position_ids(cfg, host)
        for b, s in enumerate(samples):
            docs = s.document_ids
            k = 0
            for d in range(int(docs.max()) + 1):
                ids = s.input_ids[docs == d]
                n = int(((ids == image).long().diff(prepend=torch.tensor([0])) == 1).sum())  # images of doc d
                g = torch.tensor(s.grids["images"][k:k + n]).reshape(-1, 3)
                want, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=(ids == image).long()[None],
                                                     image_grid_thw=g if n else None)
                assert torch.equal(pos[:, b][:, docs == d], want[:, 0]), (step, b, d)
                k += n
            assert (pos[:, b][:, docs < 0] == 0).all()
    assert seen == GRIDS


def _one_image_record(qwen_data, tmp_path, name: str, on_bad_record: str) -> dict:
    """The Qwen-VL config on one record `name` whose image is tmp_path/NAME.png, one sample a step."""
    records = [{"id": name, "image": str(tmp_path / f"{name}.png"), "conversations": [
        {"from": "human", "value": "<image>\nwhat shape is this ?"}, {"from": "gpt", "value": "a red square ."}]}]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(records))
    raw = qwen_llava(qwen_data, packing=False)
    raw["data"].update(path=str(path), on_bad_record=on_bad_record, shuffle=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    return raw


def test_an_image_beyond_the_aspect_limit_is_a_bad_record_naming_it(qwen_data, tmp_path):
    """The processor refuses aspect ratios beyond 200:1: the record's error names the image and its
    size (before: only the ratio, `absolute aspect ratio must be smaller than 200, got 332.3...`)."""
    from PIL import Image

    from mimo.data.llava import DataError

    Image.new("RGB", (997, 3), (200, 30, 30)).save(tmp_path / "thin.png")
    raw = _one_image_record(qwen_data, tmp_path, "thin", "error")
    with pytest.raises(DataError, match=r"record 'thin': image .*thin.png \(997 x 3 pixels\): absolute aspect ratio "
                                        r"must be smaller than 200"):
        _dataset(raw).sample(0)


def test_truncated_image_under_skip_is_zeros_of_its_header_size(qwen_data, tmp_path, capfd):
    from PIL import Image

    from mimo.data.items import grid_patches

    out, _ = qwen_data
    Image.new("RGB", (80, 60), (200, 30, 30)).save(tmp_path / "cut.png")
    whole = (tmp_path / "cut.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])  # header intact, pixels cut off
    raw = _one_image_record(qwen_data, tmp_path, "cut", "skip")
    ds = _dataset(raw)
    s = ds.sample(0)
    assert s.grids["images"] == [(1, 4, 6)]  # from the header: 80 x 60 pixels
    item = s.item("images", 0)
    assert item.shape == (grid_patches((1, 4, 6)), 3 * 2 * 14 * 14) and not item.any()
    assert ds.bad_media["images"] == 1 and "record 'cut'" in capfd.readouterr().err
    raw["data"]["on_bad_record"] = "error"
    from mimo.data.llava_dataset import MediaError

    with pytest.raises(MediaError, match="record 'cut'"):
        _dataset(raw).sample(0).item("images", 0)


# -- FP32 training parity --------------------------------------------------------------------------


def _rotate_images(records, root):
    """Every picture replaced by the next one of the same size: the same grids and token counts (the
    step's plan agrees with the other ranks), other pixels."""
    from PIL import Image

    paths = sorted({p for r in records for p in ([r["image"]] if isinstance(r.get("image"), str) else
                                                   r.get("image", []))})
    by_size = {}
    for p in paths:
        with Image.open(os.path.join(root, p)) as img:
            by_size.setdefault(img.size, []).append(p)
    nxt = {g[k]: g[(k + 1) % len(g)] for g in by_size.values() for k in range(len(g))}
    for r in records:
        if isinstance(r.get("image"), str):
            r["image"] = nxt[r["image"]]
        elif "image" in r:
            r["image"] = [nxt[p] for p in r["image"]]


def _train(raw, steps, wrong_images_on_rank=None):
    import torch.distributed as dist

    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    if wrong_images_on_rank == dist.get_rank():  # negative control: this rank reads other pictures
        _rotate_images(trainer.dataset.records, os.path.dirname(raw["data"]["path"]))
    return record_run(trainer, steps)


@pytest.fixture(scope="module")
def reference(qwen_data):
    return run_on_ranks(_train, 1, qwen_llava(qwen_data), STEPS, timeout_s=240)[0]


def test_noncolocated_llm_pp2_vit_dp2_equals_single_rank(qwen_data, reference):
    # LLM PP2 on ranks 0-1 (tied embeddings across the stages), the ViT DP2 on ranks 2-3.
    got = merge_ranks(run_on_ranks(_train, 4, qwen_llava(qwen_data, language=dict(pp=2),
                                                         images=dict(dp=2, rank_offset=2)), STEPS, timeout_s=300))
    vit = [k for k in reference["grads"] if k.startswith("images.encoder.")]
    assert vit and all(reference["grads"][k].abs().sum() > 0 for k in vit)  # the ViT trains
    # PP > 1: the last stage steps a tied copy of the embedding, bit for bit the embedding itself.
    emb = "language.embedding.word_embeddings.weight"
    for state in ("params", "grads"):
        assert torch.equal(got[state].pop(emb + TIED_COPY), got[state][emb])
    assert set(got["params"]) == set(reference["params"])
    assert_same_run(reference, got)


def test_colocated_tp2_equals_single_rank_and_a_rank_reading_other_pictures_does_not(qwen_data, reference):
    raw = qwen_llava(qwen_data, language=dict(tp=2), images=dict(tp=2))
    got = merge_ranks(run_on_ranks(_train, 2, raw, STEPS, timeout_s=300))
    assert_same_run(reference, got)
    # Negative control: rank 1 reads each picture's same-size neighbour (same plan, other pixels).
    bad = run_on_ranks(_train, 2, raw, 1, 1, timeout_s=300)
    with pytest.raises(AssertionError):
        assert_same_run({**reference, "losses": reference["losses"][:1], "params": {}}, merge_ranks(bad))


# -- the demo config ---------------------------------------------------------------------------------


def test_demo_config_checks_once_its_data_exists(tmp_path):
    config = os.path.join(ROOT, "examples", "configs", "cpu_qwen_vl_demo.yaml")
    data = str(tmp_path / "sample_qwen_vl")
    assert make_sample_data.main([data, "--records", "8", "--qwen-vl"]) == 0
    sets = [f"data.path={data}/train.json", f"data.image_root={data}", f"data.tokenizer={data}/tokenizer"]
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", config, *sum((["--set", s] for s in sets), [])],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    from mimo.data import build_dataset

    cfg = load_config(config, sets)
    ds = build_dataset(cfg)
    assert ds.encoder.image_text == "<|image_pad|>" and cfg.placeholder_ids["images"] == 120
    sizes = {tuple(g) for j in range(cfg.training.global_batch_size) for g in ds.sample(j).grids["images"]}
    assert len(sizes) >= 3
