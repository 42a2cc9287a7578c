"""Qwen2.5-VL and Qwen2-VL end to end: mimo's logits (model.hf, the hf_logits path) equal transformers'
`forward(input_ids, pixel_values, image_grid_thw)` (FP32, 1e-4), and the export round trip.

Tiny random models are built here (tests/qwen_vl_models.py): Qwen2.5-VL with window and
full-attention ViT layers and tied embeddings, Qwen2-VL untied. One batch holds three images of
different grids (two in row 0, one in row 1). Layouts:
  (a) 1 rank (both models; negative controls: every ViT layer full-attention, and image tokens
      attending each other bidirectionally in the LLM);
  (b) colocated TP2: every module TP2 on ranks 0-1 (both models);
  (c) LLM PP2 on ranks 0-1, the ViT on rank 2;
  (d) LLM TP2 with the ViT DP2 on the same two ranks (the three images divided between them);
  (e) LLM CP2 (each token's M-RoPE positions travel with it to its CP rank).
Export: `python -m mimo.hf export` writes the source tensors, config, tokenizer and processor files
and transformers loads it with the same logits; the export of a model trained one step holds the
trained tensors, and transformers' logits of it are mimo's logits of the trained model.
"""

import os

import pytest
import torch

import qwen_vl_models as q
from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.hf_logits import FixedSamples, hf_logits, logits_config, merge_logits, split_inputs

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{version: (directory, transformers' logits)}, the batch, and the all-full-attention copy of 2.5."""
    root = tmp_path_factory.mktemp("qwen_vl")
    batch = q.inputs()
    out = {}
    for version in ("2.5", "2"):
        model = q.build(version)
        out[version] = (q.save(model, str(root / version)), q.reference(model, batch))
    return out, batch, q.all_full_attention(out["2.5"][0], str(root / "all_full"))


def config(directory, **parallelism):
    return {"model": {"hf": directory}, "parallelism": {"language": {}, "images": {}, **parallelism},
            "training": {"global_batch_size": 2}}


def _logits_of_each(raws, batch):
    """This rank's logits of each config (the hf_logits path, several models in one rank process)."""
    from mimo.training import Trainer
    from mimo.training.hf_logits import trainer_logits

    out = []
    for raw in raws:
        cfg = load_config(logits_config(raw, *batch["input_ids"].shape))
        out.append(trainer_logits(Trainer(cfg, select_runtime("cpu")), split_inputs(cfg, batch)))
    return out


def logits_of_each(raws, batch, ranks):
    per_rank = run_on_ranks(_logits_of_each, ranks, raws, batch, timeout_s=300)
    return [merge_logits([r[k] for r in per_rank], batch["input_ids"].shape[0]) for k in range(len(raws))]


def test_one_rank_both_models_and_negative_controls(models):
    ref, batch, all_full = models
    bidirectional = config(ref["2.5"][0])
    bidirectional["model"]["language"] = {"attention": "bitfield", "modality_attention": "bidirectional"}
    raws = [config(ref["2.5"][0]), config(ref["2"][0]), config(all_full), bidirectional]
    got = logits_of_each(raws, batch, 1)
    assert q.rel(got[0], ref["2.5"][1]) < TOL
    assert q.rel(got[1], ref["2"][1]) < TOL
    # Every ViT layer full-attention (the windowed ones too): not Qwen2.5-VL's logits.
    assert q.rel(got[2], ref["2.5"][1]) > 100 * TOL
    # Image tokens seeing each other both ways (mimo's multimodal mask) is not transformers' causal LLM:
    # why model.hf sets modality_attention causal.
    assert load_config(config(ref["2.5"][0])).model.language.modality_attention == "causal"
    assert q.rel(got[3], ref["2.5"][1]) > 10 * TOL


def test_two_rank_layouts(models):
    """(b) colocated TP2, both models; (d) LLM TP2 + ViT DP2 on the same ranks: encoder DP divides
    the step's three images (6, 9 and 2 LLM tokens) by tokens: image 0 (of row 0) on ViT rank 0,
    images 1 (of row 0) and 2 (of row 1) on ViT rank 1."""
    from mimo.data.items import divide_items, grid_tokens

    ref, batch, _ = models
    tokens = [grid_tokens(g, q.MERGE) for g in q.GRIDS]
    assert tokens == [6, 9, 2] and divide_items(tokens, 2) == [0, 1, 3]
    raws = [config(ref["2.5"][0], language=dict(tp=2), images=dict(tp=2)),
            config(ref["2"][0], language=dict(tp=2), images=dict(tp=2)),
            config(ref["2.5"][0], language=dict(tp=2), images=dict(dp=2))]
    got = logits_of_each(raws, batch, 2)
    assert q.rel(got[0], ref["2.5"][1]) < TOL
    assert q.rel(got[1], ref["2"][1]) < TOL
    assert q.rel(got[2], ref["2.5"][1]) < TOL


def test_llm_cp2_through_hf_logits(models):
    """(e) hf_logits at LLM CP2 (the ViT DP2 beside it): the balanced slots put tokens of both rows'
    images on both CP ranks, each with its own (t, h, w) positions; logits gathered back in order."""
    ref, batch, _ = models
    raw = config(ref["2.5"][0], language=dict(cp=2), images=dict(dp=2))
    raw["model"]["language"] = {"attention": "bitfield", "cp_block_size": 4}
    assert q.rel(hf_logits(raw, batch), ref["2.5"][1]) < TOL


# -- export ------------------------------------------------------------------------------------------


def _tensors(d):
    import json

    from safetensors import safe_open

    index = os.path.join(d, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _hf_logits_of(directory, batch):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return q.reference(Qwen2_5_VLForConditionalGeneration.from_pretrained(directory), batch)


@pytest.fixture(scope="module")
def with_tokenizer(models, tmp_path_factory):
    """The Qwen2.5-VL directory with a tokenizer's files beside its config and processor settings."""
    import shutil
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools"))
    import make_sample_data

    ref, _, _ = models
    out = str(tmp_path_factory.mktemp("qwen25_tok") / "hf")
    shutil.copytree(ref["2.5"][0], out)
    make_sample_data.make_tokenizer(out)
    for name in os.listdir(os.path.join(out, "tokenizer")):
        shutil.move(os.path.join(out, "tokenizer", name), os.path.join(out, name))
    os.rmdir(os.path.join(out, "tokenizer"))
    return out


def test_export_cli_round_trip(models, with_tokenizer, tmp_path):
    """`python -m mimo.hf export` (colocated TP2): the source's tensors exactly, its config, tokenizer
    and processor files; transformers loads it as Qwen2_5_VLForConditionalGeneration with the same logits."""
    import yaml
    from transformers import AutoImageProcessor, AutoTokenizer

    from mimo.hf.__main__ import main

    ref, batch, _ = models
    cfg = tmp_path / "export.yaml"
    cfg.write_text(yaml.safe_dump(config(with_tokenizer, language=dict(tp=2), images=dict(tp=2))))
    out = str(tmp_path / "exported")
    assert main(["export", "--config", str(cfg), "--out", out]) == 0
    src, exported = _tensors(with_tokenizer), _tensors(out)
    assert set(src) == set(exported) and not [k for k in src if k.endswith("lm_head.weight")]  # tied
    for k in src:
        assert exported[k].dtype == src[k].dtype and torch.equal(exported[k], src[k]), k
    files = sorted(f for f in os.listdir(with_tokenizer) if not f.endswith(".safetensors"))
    assert {"config.json", "preprocessor_config.json", "tokenizer.json"} <= set(files)
    for f in files:
        with open(os.path.join(with_tokenizer, f), "rb") as a, open(os.path.join(out, f), "rb") as b:
            assert a.read() == b.read(), f
    assert AutoImageProcessor.from_pretrained(out).merge_size == q.MERGE
    assert len(AutoTokenizer.from_pretrained(out)) > 0
    assert torch.equal(_hf_logits_of(out, batch), ref["2.5"][1])


class _Batch(FixedSamples):
    """The test's batch as a training dataset (step 0)."""

    def skipped_samples(self, step):
        return 0


def _logits_train_logits_export(raw, batch, out_dir):
    """The model's logits on the batch; one training step on it; the trained model's logits; its export."""
    from mimo.training import Trainer
    from mimo.training.hf_export import export_hf
    from mimo.training.hf_logits import trainer_logits

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    before = trainer_logits(trainer, split_inputs(cfg, batch))
    trainer.dataset = _Batch(split_inputs(cfg, batch))
    trainer.train_step(0)
    after = trainer_logits(trainer, split_inputs(cfg, batch))
    export_hf(trainer, out_dir)
    return before, after


@pytest.fixture(scope="module")
def pp2_run(models, tmp_path_factory):
    """(c) LLM PP2 on ranks 0-1, the ViT on rank 2: logits, then one step, logits and export (one run)."""
    ref, batch, _ = models
    out = str(tmp_path_factory.mktemp("qwen25_trained") / "hf")
    raw = logits_config(config(ref["2.5"][0], language=dict(pp=2), images=dict(rank_offset=2)),
                        *batch["input_ids"].shape)
    per_rank = run_on_ranks(_logits_train_logits_export, 3, raw, batch, out, timeout_s=300)
    return [merge_logits([r[k] for r in per_rank], 2) for k in range(2)] + [out]


def test_llm_pp2_with_the_vit_on_its_own_rank(models, pp2_run):
    """(c) The tied output weight on the last stage is a copy of the first stage's embedding."""
    ref, _, _ = models
    assert q.rel(pp2_run[0], ref["2.5"][1]) < TOL


def test_export_of_a_trained_model_is_the_trained_model(models, pp2_run):
    """Trained one step (LLM PP2, the ViT on its own rank): every exported tensor differs from the
    source, and transformers' logits of the export are mimo's logits of the trained model."""
    ref, batch, _ = models
    _, trained, out = pp2_run
    src, exported = _tensors(ref["2.5"][0]), _tensors(out)
    assert set(src) == set(exported)
    assert [k for k in src if torch.equal(src[k], exported[k])] == []
    assert q.rel(trained, ref["2.5"][1]) > 100 * TOL  # the step moved the logits
    assert q.rel(_hf_logits_of(out, batch), trained) < TOL


def test_modality_attention_field_is_checked(models):
    from mimo.config import ConfigError

    ref, _, _ = models
    raw = config(ref["2.5"][0])
    raw["model"]["language"] = {"attention": "bitfield", "modality_attention": "both"}
    with pytest.raises(ConfigError, match="model.language.modality_attention: must be one of bidirectional, causal"):
        load_config(raw)
    raw["model"]["language"] = {"attention": "bitfield", "text_sees": []}  # model.hf: causal
    with pytest.raises(ConfigError, match="model.language.text_sees: needs model.language.modality_attention"):
        load_config(raw)
