"""M-RoPE (Qwen2-VL / Qwen2.5-VL) in mimo's LLM, against transformers (FP32, 1e-4).

(a) `mimo.data.mrope.mrope_position_ids` against transformers' `get_rope_index` (several images of
    different grids, text before, between and after; packed documents; bad input), and the
    positions a collated mock microbatch with native-resolution images gets.
(b) mimo's LLM built with position_embedding mrope and loaded from a tiny random
    Qwen2_5_VLForConditionalGeneration checkpoint (its language model), fed 3-D positions with
    image grids: logits equal transformers' at 1 rank, LLM CP2, LLM PP2 and LLM TP2 + SP (gloo ranks).
(c) Negative control: the same model with plain 1-D RoPE is outside the tolerance.
(d) The whole multimodal forward on mock data (1-D positions on all three axes) is 1-D RoPE's.

The tiny models are built here, offline. The LLM reads the Qwen2.5-VL checkpoint's weights (its
`model.*` / `lm_head.*` tensors) through a Qwen2 config.json of the checkpoint's text config.
"""

import json
import os

import pytest
import torch

from mimo.config import ConfigError, load_config
from mimo.data.mock import Sample
from mimo.data.mrope import image_token_count, mrope_position_ids
from mimo.runtime import run_on_ranks, select_runtime

TOL = 1e-4
VOCAB, IMAGE = 128, 120
MERGE = 2
SECTION = [2, 3, 3]  # head_dim 16: 8 rotary frequencies for time, height, width


def tiny_qwen_vl(version: str = "2.5"):
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": SECTION})
    ids = dict(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2,
               vision_end_token_id=IMAGE + 3)
    torch.manual_seed(0)
    if version == "2.5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      spatial_merge_size=MERGE, fullatt_block_indexes=[0])
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                   **ids)).eval()
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, spatial_merge_size=MERGE)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids)).eval()


def sequence(parts, grids):
    """input_ids from parts: an int n = n text tokens, 'img' = the next grid's image tokens."""
    g = torch.Generator().manual_seed(len(parts))
    ids, k = [], 0
    for p in parts:
        if p == "img":
            ids += [IMAGE] * image_token_count(grids[k], MERGE)
            k += 1
        else:
            ids += torch.randint(3, IMAGE - 1, (p,), generator=g).tolist()
    return torch.tensor(ids)


def hf_rope_index(model, ids, grids):
    types = (ids == IMAGE).long()[None]
    pos, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=torch.tensor(grids))
    return pos[:, 0]


# Grids (t, h, w) in patches: tall, wide, square, one merged row.
GRIDS = [[1, 4, 6], [1, 6, 2], [1, 4, 4], [1, 2, 8]]
LAYOUT = [5, "img", 3, "img", 1, "img", 4, "img", 6]  # text before, between and after the images


@pytest.mark.parametrize("version", ["2.5", "2"])
def test_position_ids_match_get_rope_index(version):
    model = tiny_qwen_vl(version)
    for parts, grids in [(LAYOUT, GRIDS), ([7, "img", 2], GRIDS[1:2]), (["img", 3], GRIDS[3:])]:
        ids = sequence(parts, grids)
        got = mrope_position_ids(ids, IMAGE, grids, MERGE)
        assert torch.equal(got, hf_rope_index(model, ids, grids))
    assert torch.equal(mrope_position_ids(torch.arange(3, 9), IMAGE, [], MERGE), torch.arange(6).expand(3, -1))
    got = mrope_position_ids(sequence(LAYOUT, GRIDS), IMAGE, GRIDS, MERGE)
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[1], got[2])  # non-trivial on every axis


def test_adjacent_images_are_told_apart_by_their_grids():
    """transformers needs text between images (it takes a run of image tokens for one image). With
    the one text token between the second and third image removed, the positions are transformers'
    with that token's column removed and everything after it one less."""
    model = tiny_qwen_vl()
    ids = sequence(LAYOUT, GRIDS)
    sep = 5 + 6 + 3 + image_token_count(GRIDS[1], MERGE)  # the text token between images 2 and 3
    ref = hf_rope_index(model, ids, GRIDS)
    ref = torch.cat([ref[:, :sep], ref[:, sep + 1:] - 1], dim=1)
    adjacent = torch.cat([ids[:sep], ids[sep + 1:]])
    assert torch.equal(mrope_position_ids(adjacent, IMAGE, GRIDS, MERGE), ref)


def test_packed_documents_restart_and_padding_is_zero():
    model = tiny_qwen_vl()
    a, ga = sequence([3, "img", 2], GRIDS[:1]), GRIDS[:1]
    b, gb = sequence([2, "img", 4, "img", 1], GRIDS[2:]), GRIDS[2:]
    ids = torch.cat([a, b, torch.zeros(5, dtype=torch.long)])
    docs = torch.cat([torch.zeros(len(a)), torch.ones(len(b)), torch.full((5,), -1)]).long()
    got = mrope_position_ids(ids, IMAGE, ga + gb, MERGE, document_ids=docs)
    assert torch.equal(got[:, :len(a)], hf_rope_index(model, a, ga))
    assert torch.equal(got[:, len(a):len(a) + len(b)], hf_rope_index(model, b, gb))
    assert torch.equal(got[:, len(a) + len(b):], torch.zeros(3, 5, dtype=torch.long))


def test_bad_input_is_a_value_error():
    ids = sequence([3, "img", 2], GRIDS[:1])
    with pytest.raises(ValueError, match="image_grids: 0 grids"):
        mrope_position_ids(ids, IMAGE, [], MERGE)
    with pytest.raises(ValueError, match="image tokens for only 1"):
        mrope_position_ids(ids, IMAGE, GRIDS[:2], MERGE)
    with pytest.raises(ValueError, match=r"image_grids\[0\]: grid \(1, 4, 8\) needs 8"):
        mrope_position_ids(ids, IMAGE, [[1, 4, 8]], MERGE)
    with pytest.raises(ValueError, match=r"image_grids\[0\]: h and w"):
        mrope_position_ids(ids, IMAGE, [[1, 3, 8]], MERGE)


def test_mrope_config_errors_name_the_field():
    lang = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, max_sequence_length=64,
                position_embedding="mrope")
    for section, reason in [(None, "is required"), ([2, 3], "three positive integers"), ([2, 3, 4], "add up to")]:
        with pytest.raises(ConfigError, match="model.language.mrope_section.*" + reason):
            load_config({"model": {"language": {**lang, "mrope_section": section}}, "data": {"seq_length": 32},
                         "training": {"global_batch_size": 1}})
    with pytest.raises(ConfigError, match="model.language.position_embedding"):
        load_config({"model": {"language": {**lang, "position_embedding": "alibi"}}, "data": {"seq_length": 32},
                         "training": {"global_batch_size": 1}})


# -- logits vs transformers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_vl_llm(tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint, and a directory whose config.json is its text config as a Qwen2
    causal LM, next to the same weights file (the LLM's `model.*` and `lm_head.*` tensors)."""
    root = tmp_path_factory.mktemp("qwen_vl")
    model = tiny_qwen_vl()
    full = str(root / "full")
    model.save_pretrained(full)
    lm = root / "lm"
    lm.mkdir()
    with open(os.path.join(full, "config.json")) as f:
        text = json.load(f)["text_config"]
    text.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    with open(lm / "config.json", "w") as f:
        json.dump(text, f)
    os.symlink(os.path.join(full, "model.safetensors"), lm / "model.safetensors")
    return model, str(lm)


def mrope_inputs():
    """Two rows of 48 tokens with images of different grids: ids [2, 48], positions [3, 2, 48]."""
    rows = [([5, "img", 3, "img", 4], GRIDS[:2]), ([2, "img", 6, "img", 3], GRIDS[2:])]
    ids, pos = [], []
    for parts, grids in rows:
        row = sequence(parts, grids)
        row = torch.cat([row, torch.randint(3, IMAGE - 1, (48 - len(row),), generator=torch.Generator().manual_seed(1))])
        ids.append(row)
        pos.append(mrope_position_ids(row, IMAGE, grids, MERGE))
    return torch.stack(ids), torch.stack(pos, dim=1)


def llm_config(directory, position_embedding="mrope", **language_par):
    lang = {"hf": directory, "attention": "bitfield", "cp_block_size": 8, "position_embedding": position_embedding}
    if position_embedding == "mrope":
        lang["mrope_section"] = SECTION
    return {"model": {"language": lang}, "parallelism": {"language": language_par},
            "training": {"global_batch_size": 2}}


def samples(ids, pos):
    """One real-data Sample per row: one document, every token a target, [3, s] M-RoPE positions."""
    return [Sample(input_ids=ids[b], items={}, targets=torch.ones(ids.shape[1], dtype=torch.bool),
                   document_ids=torch.zeros(ids.shape[1], dtype=torch.long), position_ids=pos[:, b])
            for b in range(ids.shape[0])]


def _logits_of_each(raws, ids, pos):
    """One rank: [B, S, V] logits of each config, merged over the ranks by the caller."""
    from mimo.training import Trainer
    from mimo.training.hf_logits import logits_config, trainer_logits

    out = []
    for raw in raws:
        cfg = load_config(logits_config(raw, *ids.shape))
        out.append(trainer_logits(Trainer(cfg, select_runtime("cpu")), samples(ids, pos)))
    return out


def merged(per_rank, k, batch=2):
    got = {}
    for r in per_rank:
        got.update(r[k])
    return torch.stack([got[i] for i in range(batch)])


def rel_diff(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def hf_logits(model, ids, pos):
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits


def test_logits_single_rank_and_1d_rope_negative_control(qwen_vl_llm):
    model, lm = qwen_vl_llm
    ids, pos = mrope_inputs()
    assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[1], pos[2])
    ref = hf_logits(model, ids, pos)
    per_rank = run_on_ranks(_logits_of_each, 1, [llm_config(lm), llm_config(lm, "rope")], ids, pos)
    assert rel_diff(merged(per_rank, 0), ref) < TOL
    assert rel_diff(merged(per_rank, 1), ref) > TOL  # 1-D RoPE over the same tokens: not Qwen-VL


@pytest.mark.parametrize("layout", [{"cp": 2}, {"pp": 2}, {"tp": 2, "sp": True}], ids=["cp2", "pp2", "tp2_sp"])
def test_logits_llm_multi_rank(qwen_vl_llm, layout):
    """CP 2: each CP rank gets its balanced slots' tokens with their own three positions. PP 2: each
    stage builds its rotary table from the microbatch's [3, b, s] positions. TP 2 with sequence
    parallelism: the table covers the whole sequence the attention gathers."""
    model, lm = qwen_vl_llm
    ids, pos = mrope_inputs()
    per_rank = run_on_ranks(_logits_of_each, 2, [llm_config(lm, **layout)], ids, pos)
    assert rel_diff(merged(per_rank, 0), hf_logits(model, ids, pos)) < TOL


# -- batches ---------------------------------------------------------------------------------------


def test_batches_stack_mrope_positions_as_3_b_s():
    from mimo.data import collate

    ids, pos = mrope_inputs()
    batch = collate(samples(ids, pos), {})
    assert batch["position_ids"].shape == (3, 2, 48) and torch.equal(batch["position_ids"], pos)
    one_d = [Sample(input_ids=ids[b], items={}, targets=torch.ones(48, dtype=torch.bool),
                    document_ids=torch.zeros(48, dtype=torch.long), position_ids=torch.arange(48)) for b in range(2)]
    assert collate(one_d, {})["position_ids"].shape == (2, 48)
    with pytest.raises(ValueError, match="Sample.position_ids"):
        collate([samples(ids, pos)[0], one_d[1]], {})


def _mock_logits(raws):
    """[B, S, V] logits of each config on its own mock step-0 samples (images included)."""
    from mimo.data import MockMultimodalDataset
    from mimo.training import Trainer
    from mimo.training.hf_logits import logits_config, trainer_logits

    out = []
    for raw in raws:
        cfg = load_config(logits_config(raw, 2, raw["data"]["seq_length"]))
        got = trainer_logits(Trainer(cfg, select_runtime("cpu")), MockMultimodalDataset(cfg).global_batch(0))
        out.append(torch.stack([got[i] for i in range(2)]))
    return out


def test_mock_multimodal_step_with_equal_axes_is_1d_rope():
    """Mock samples carry no M-RoPE positions: each token's position goes on all three axes, where
    M-RoPE is 1-D RoPE. The whole multimodal forward (encoders, assembly, LLM) then gives 1-D RoPE's
    logits; negative control: another rotary base does not."""
    import copy

    from tiny import TINY

    rope = copy.deepcopy(TINY)
    rope["data"]["max_images_per_sample"] = 1
    mrope = copy.deepcopy(rope)
    mrope["model"]["language"].update(position_embedding="mrope", mrope_section=[1, 1, 2])  # head_dim 8
    theta = copy.deepcopy(mrope)
    theta["model"]["language"]["rope_theta"] = 100.0
    a, b, c = run_on_ranks(_mock_logits, 1, [rope, mrope, theta])[0]
    assert rel_diff(b, a) < 1e-6
    assert rel_diff(c, a) > TOL


def test_microbatch_positions_of_mock_native_images_match_get_rope_index():
    """A collated microbatch with 1-D positions (mock samples with native-resolution images of
    random sizes) gets [3, b, s] positions from its images' grids: each row as transformers'."""
    import copy

    from tiny import TINY

    from mimo.data import MockMultimodalDataset, collate
    from mimo.data.mrope import microbatch_mrope_position_ids

    raw = copy.deepcopy(TINY)
    raw["data"].update(seq_length=64, max_images_per_sample=3)
    raw["model"]["language"].update(position_embedding="mrope", mrope_section=[2, 1, 1], max_sequence_length=64)
    raw["model"]["encoders"]["images"] = dict(
        kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2, patch_size=4, resolution="native",
        spatial_merge_size=MERGE, min_pixels=64, max_pixels=8 * 8 * 16, position_embedding="rope2d",
        projector={"kind": "patch_merger"}, normalization="RMSNorm", activation="swiglu")
    cfg = load_config(raw)
    batch = MockMultimodalDataset(cfg).global_batch(0)
    host = collate(batch, cfg.placeholder_ids, items=False)
    got = microbatch_mrope_position_ids(cfg, host)
    assert got.shape == (3,) + tuple(host["input_ids"].shape)
    model, pid = tiny_qwen_vl(), cfg.placeholder_ids["images"]
    several, left = 0, 0
    for b, s in enumerate(batch):
        grids = s.grids["images"] if s.grids else []
        several += len(grids) > 1
        ids = s.input_ids
        if not grids:
            assert torch.equal(got[:, b], torch.arange(len(ids)).expand(3, -1))
            continue
        # transformers takes a run of image tokens for one image; adjacent mock images are told
        # apart by marking every other one a video (of one frame: the same positions as an image).
        types, k = (ids == pid).long(), 0
        for i in range(len(ids)):
            if types[i] and (i == 0 or not types[i - 1] or left == 0):
                left, k = image_token_count(grids[k], MERGE), k + 1
            if types[i]:
                types[i], left = 1 + (k - 1) % 2, left - 1
        assert all(g[0] == 1 for g in grids)
        ref, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=types[None],
                                            image_grid_thw=torch.tensor(grids[0::2]),
                                            video_grid_thw=torch.tensor(grids[1::2]) if len(grids) > 1 else None)
        assert torch.equal(got[:, b], ref[:, 0])
    assert several  # some sample has several images (of different grids)
