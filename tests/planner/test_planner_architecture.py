"""The planner costs the architecture the trainer builds: gated (swiglu) MLPs,
a head dim of its own (kv_channels), tied embeddings, and Hugging Face
directories (``hf:``) read from their config.json.

The oracle for parameter counts is ``transformers`` itself (models built on
the meta device, nothing downloaded)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from mimo.planner.api import make_plan
from mimo.planner.cost_model import CostModel, Workload
from mimo.planner.hardware import get_gpu
from mimo.planner.layout_search import LayoutSearch
from mimo.planner.megatron import Par, Work
from mimo.planner.spec import read_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_tiny_llava import make_llava  # noqa: E402

LLAMA = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=2816, vocab_size=32000)


def _language(activation="swiglu", head_dim=None, tie=False):
    lang = {"num_layers": LLAMA["num_hidden_layers"], "hidden_size": LLAMA["hidden_size"],
            "num_attention_heads": LLAMA["num_attention_heads"],
            "num_query_groups": LLAMA["num_key_value_heads"], "ffn_hidden_size": LLAMA["intermediate_size"],
            "vocab_size": LLAMA["vocab_size"], "activation": activation, "tie_embeddings": tie}
    if head_dim:
        lang["kv_channels"] = head_dim
    return lang


def _hf_params(head_dim=None, tie=False) -> int:
    kw = dict(LLAMA, tie_word_embeddings=tie)
    if head_dim:
        kw["head_dim"] = head_dim
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**kw))
    return sum(p.numel() for p in model.parameters())   # a tied weight counts once


def _planner_params(lang: dict, tp: int = 1, pp: int = 1) -> float:
    spec = read_model({"language": lang})
    model = LayoutSearch(spec, get_gpu("h100"), Work(512, {}), 8, 1).model
    return sum(model.chain([(spec.language, Par(tp=tp, pp=pp), 1)], pp).weights)


@pytest.mark.parametrize("head_dim,tie", [(None, False), (128, False), (None, True)])
def test_llm_parameters_match_transformers(head_dim, tie):
    ours, hf = _planner_params(_language(head_dim=head_dim, tie=tie)), _hf_params(head_dim, tie)
    # The planner charges 4h per layer for norms and biases; Llama has 2h of RMSNorm weights.
    assert abs(ours - hf) <= 2 * LLAMA["hidden_size"] * (LLAMA["num_hidden_layers"] + 1)


def test_reading_swiglu_as_a_plain_mlp_misses_a_third_of_the_mlp():
    # negative control: the count above can fail
    missed = _hf_params() - _planner_params(_language(activation="gelu"))
    per_layer = LLAMA["hidden_size"] * LLAMA["intermediate_size"]
    assert missed >= 0.99 * per_layer * LLAMA["num_hidden_layers"]


def test_tied_embeddings_pipeline_with_a_copy_on_the_last_stage():
    # The trainer pipelines a tied LLM (the last stage keeps a copy of the embedding, which the
    # embedding group keeps equal), so the search proposes pp > 1 and --evaluate takes it; one
    # stage holds the tied weight once, two stages hold it twice, as an untied model would.
    assert _planner_params(_language(tie=True)) < _planner_params(_language())
    assert _planner_params(_language(tie=True), pp=2) == _planner_params(_language(), pp=2)
    spec = read_model({"language": _language(tie=True)})
    search = LayoutSearch(spec, get_gpu("h100"), Work(4096, {}), 64, 1)
    assert max(c.pars["language"].pp for c in search.search(32)) > 1
    search.evaluate({"language": Par(tp=2, pp=2, dp=4)})


def test_sequence_parallel_only_where_the_sequence_splits_evenly(tmp_path):
    # a CLIP-style encoder: 576 patches + a class token = 577 tokens, which no tp > 1 divides
    model = {"language": _language(), "encoders": {"images": {
        "kind": "vision", "num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
        "image_size": 336, "patch_size": 14, "class_token": True}}}
    spec = read_model(model)
    search = LayoutSearch(spec, get_gpu("h100"), Work(4096, {"images": 1.0}), 128, 1)
    found = search.search(64)
    assert all(not c.pars["images"].sp for c in found if c.pars["images"].tp > 1)
    assert any(c.pars["images"].tp > 1 for c in found)
    with pytest.raises(ValueError, match=r"parallelism.images.sp: needs tokens per item \(577"):
        search.evaluate({"language": Par(tp=2, dp=32), "images": Par(tp=2, dp=32, sp=True)})
    cfg = {"model": model, "data": {"kind": "mock", "seq_length": 4096},
           "training": {"global_batch_size": 128, "micro_batch_size": 1}}
    path = tmp_path / "clip.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _plan("--config", str(path), "--gpus", "64", "--out", str(tmp_path / "out.yaml"))
    assert r.returncode == 0, r.stderr


def test_gated_mlp_costs_more_time_and_memory():
    def estimate(activation):
        spec = read_model({"language": _language(activation)})
        return LayoutSearch(spec, get_gpu("h100"), Work(4096, {}), 16, 1).evaluate(
            {"language": Par(tp=2, dp=4, sp=True)})
    gated, plain = estimate("swiglu"), estimate("gelu")
    assert gated.step_time > 1.05 * plain.step_time and gated.peak_memory > plain.peak_memory


def test_layer_cost_model_counts_the_gate_too():
    h, f = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    cm = CostModel(get_gpu("h100"))

    def layer_params(activation):
        spec = read_model({"language": _language(activation)})
        works = cm.module_work(spec.language, 1, 1, 1.0, Workload(512))
        return next(w.params for w in works if w.kind == "transformer")
    assert layer_params("swiglu") - layer_params("gelu") == h * f


@pytest.mark.parametrize("lang,message", [
    ({"activation": "tanh"}, "model.language.activation"),
    ({"hidden_size": 1000}, "model.language.hidden_size"),
    ({"kv_channels": -1}, "model.language.kv_channels"),
    ({"tie_embeddings": "yes"}, "model.language.tie_embeddings"),
])
def test_bad_architecture_fields_name_the_field(lang, message):
    with pytest.raises(ValueError, match=message):
        read_model({"language": {**_language(), **lang}})


def test_head_dim_of_its_own_lifts_the_divisibility_rule():
    spec = read_model({"language": {**_language(head_dim=64), "hidden_size": 1000}})
    assert spec.language.kv_channels == 64 and spec.language.attention_width == 1024


def test_trainer_config_objects_read_the_same(tmp_path):
    # mimo.balance reads the loaded config's dataclasses (kv_channels None there)
    from mimo.config import load_config
    cfg = {"model": {"language": {**_language(head_dim=None, tie=True), "max_sequence_length": 512}},
           "parallelism": {"language": {"tp": 1}}, "data": {"kind": "mock", "seq_length": 512},
           "training": {"global_batch_size": 2, "micro_batch_size": 1, "train_iters": 1}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert read_model(load_config(str(path)).model) == read_model(cfg["model"])


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _hf_config(tmp_path, directory):
    cfg = {"model": {"hf": str(directory), "encoders": {"images": {"frozen": True}}},
           "parallelism": {"language": {"tp": 2}, "images": {"tp": 1, "rank_offset": 2}},
           "data": {"kind": "mock", "seq_length": 64},
           "training": {"global_batch_size": 4, "micro_batch_size": 1}}
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, str(path)


def test_hf_directory_is_costed_with_its_own_architecture(tmp_path):
    directory = make_llava(str(tmp_path / "llava"), text="llama", tie=True)
    cfg, path = _hf_config(tmp_path, directory)
    with open(os.path.join(directory, "config.json")) as fh:
        text = json.load(fh)["text_config"]
    plan = make_plan(cfg, 4, gpu="cpu")
    lang = plan.spec.language
    assert (lang.num_layers, lang.hidden_size, lang.ffn_hidden_size, lang.vocab_size) == (
        text["num_hidden_layers"], text["hidden_size"], text["intermediate_size"], text["vocab_size"])
    assert lang.gated and lang.tie_embeddings
    assert plan.config["model"] == cfg["model"]            # the emitted config keeps its hf: form

    r = _plan("--config", path, "--evaluate", "--gpu", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["placement"] == "non-colocated"

    out = tmp_path / "planned.yaml"
    r = _plan("--config", path, "--gpus", "4", "--gpu", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    emitted = yaml.safe_load(out.read_text())
    assert emitted["model"] == cfg["model"]
    chk = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(out), "--world-size", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert chk.returncode == 0 and chk.stdout.strip() == "ok", chk.stderr


def test_missing_hf_directory_is_one_error_line(tmp_path):
    _, path = _hf_config(tmp_path, tmp_path / "nowhere")
    r = _plan("--config", path, "--gpus", "4", "--gpu", "cpu")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.hf: no such directory")


@pytest.mark.parametrize("change,start", [
    (lambda m: m.update(encoders=["images"]), "error: model.encoders: must be a mapping"),
    (lambda m: m["encoders"]["images"].update(kind="video"), "error: model.encoders.images.kind: expected vision or audio"),
])
def test_hf_sections_of_the_wrong_kind_name_their_field(tmp_path, change, start):
    directory = make_llava(str(tmp_path / "llava"))
    cfg, _ = _hf_config(tmp_path, directory)
    if ".kind" in start:   # an encoder of its own HF directory
        cfg["model"] = {"language": _language(), "encoders": {"images": {"hf": directory, "kind": "vision"}}}
    change(cfg["model"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _plan("--config", str(path), "--gpus", "4", "--gpu", "cpu")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith(start), r.stderr
