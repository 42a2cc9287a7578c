"""Hugging Face weights: mimo's logits vs transformers' (FP32, 1e-4) at several layouts, Whisper
encoder outputs, export round trip, config and weight errors, and a negative control.

Tiny random models are written by tools/make_tiny_llava.py into tmp dirs (no download).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mimo.config import ConfigError, load_config
from mimo.runtime import run_on_ranks, select_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "tools", "make_tiny_llava.py"))
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

TOL = 1e-4  # tools/parity.py's criterion, on the logits' max |diff| / max |ref|
IMAGE = mk.VOCAB - 1


@pytest.fixture(scope="module")
def clip_llama(tmp_path_factory):
    """CLIP (class token, layer -2, default strategy) + Llama (GQA, Llama-3 RoPE scaling)."""
    return mk.make_llava(str(tmp_path_factory.mktemp("hf") / "clip_llama"), "clip", "llama", rope_scaling=True)


@pytest.fixture(scope="module")
def siglip_qwen2(tmp_path_factory):
    """SigLIP (no class token, full strategy) + Qwen2 (QKV bias, tied embeddings)."""
    return mk.make_llava(str(tmp_path_factory.mktemp("hf") / "siglip_qwen2"), "siglip", "qwen2", tie=True)


@pytest.fixture(scope="module")
def clip_mistral(tmp_path_factory):
    """CLIP + Mistral (GQA) with a sliding window of 64 tokens (longer than the inputs)."""
    return mk.make_llava(str(tmp_path_factory.mktemp("hf") / "clip_mistral"), "clip", "mistral", sliding_window=64)


def llava_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, IMAGE - 1, (2, 40), generator=g)
    ids[0, 3:19] = IMAGE            # one image (16 features) per row
    ids[1, 10:26] = IMAGE
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}


def hf_reference(directory, inputs):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(**inputs).logits


def rel_diff(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def llava_config(directory, **parallelism):
    par = parallelism or {"language": {}, "images": {}}
    return {"model": {"hf": directory}, "parallelism": par, "training": {"global_batch_size": 2}}


def mimo_logits(raw, inputs):
    from mimo.training.hf_logits import hf_logits

    return hf_logits(raw, inputs)


# -- config ------------------------------------------------------------------------------------


def test_architecture_comes_from_the_hf_config(clip_llama):
    cfg = load_config(llava_config(clip_llama))
    lang, enc = cfg.model.language, cfg.model.encoders["images"]
    assert (lang.num_layers, lang.hidden_size, lang.num_query_groups, lang.ffn_hidden_size) == (2, 64, 2, 96)
    assert (lang.normalization, lang.activation, lang.add_bias_linear, lang.qkv_bias) == ("RMSNorm", "swiglu",
                                                                                         False, False)
    assert lang.rope_theta == 50000.0 and lang.rope_scaling["original_max_position_embeddings"] == 16
    # CLIP: 3 layers, features from layer -2 -> the first 2 run; the class token is dropped.
    assert (enc.num_layers, enc.class_token, enc.pre_norm, enc.final_norm, enc.activation) == (
        2, True, True, False, "quick_gelu")
    assert cfg.placeholder_ids == {"images": IMAGE} and enc.projector.activation == "gelu"


def test_tied_embeddings_follow_transformers_either_flag(siglip_qwen2, tmp_path):
    """transformers' LlavaConfig ties the output layer when the top-level flag or text_config's says so
    (a transformers 4 save of a tied LLM: top level false, text_config true). mimo used the top-level
    flag alone: an untied model that then missed lm_head.weight."""
    from transformers import AutoConfig

    d = tmp_path / "tie"
    shutil.copytree(siglip_qwen2, d)
    c = json.loads((d / "config.json").read_text())
    for top, text in ((False, True), (True, False), (False, False)):
        c["tie_word_embeddings"], c["text_config"]["tie_word_embeddings"] = top, text
        (d / "config.json").write_text(json.dumps(c))
        want = AutoConfig.from_pretrained(str(d)).tie_word_embeddings
        assert load_config(llava_config(str(d))).model.language.tie_embeddings == want == (top or text)


def test_yaml_field_that_disagrees_is_a_config_error(clip_llama, tmp_path):
    import yaml

    raw = llava_config(clip_llama)
    raw["model"]["language"] = {"hidden_size": 64, "num_attention_heads": 8}  # heads disagree (4)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path)], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: model.language.num_attention_heads: 8 disagrees with {clip_llama}/config.json (4)"]
    raw["model"]["language"] = {"hidden_size": 64}  # agreeing fields are fine
    load_config(raw)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError) as exc:
        load_config({"model": {"language": {"hf": str(d)}}, "parallelism": {"language": {}},
                     "training": {"global_batch_size": 1}})
    assert str(exc.value) == ("error: model.language.hf: language model type 'gpt2' is not supported "
                              "(supported: llama, mistral, qwen2, qwen2_moe, qwen3_moe, mixtral)")


# -- logits vs transformers ----------------------------------------------------------------------


def _logits_of_each(raws, inputs):
    """One rank: the logits of several configs (one process start for all)."""
    from mimo.training.hf_logits import logits_config, split_inputs, trainer_logits
    from mimo.training import Trainer

    out = []
    for raw in raws:
        cfg = load_config(logits_config(raw, *inputs["input_ids"].shape))
        logits = trainer_logits(Trainer(cfg, select_runtime("cpu")), split_inputs(cfg, inputs))
        out.append(torch.stack([logits[i] for i in range(len(logits))]))
    return out


def test_clip_llama_logits_single_rank_and_negative_control(clip_llama, tmp_path):
    """1 rank within tolerance; negative control: one k_proj 1% off in mimo's copy -> outside it."""
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(clip_llama, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    key = next(k for k in tensors if "layers.1.self_attn.k_proj.weight" in k and "vision" not in k)
    tensors[key] = tensors[key] * 1.01
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    inputs = llava_inputs()
    good, wrong = run_on_ranks(_logits_of_each, 1, [llava_config(clip_llama), llava_config(bad)], inputs)[0]
    ref = hf_reference(clip_llama, inputs)
    assert rel_diff(good, ref) < TOL
    assert rel_diff(wrong, ref) > TOL


def test_mistral_logits_and_a_shorter_sliding_window_is_a_config_error(clip_mistral, tmp_path):
    """Within its window Mistral is full causal attention: logits within tolerance at 1 rank. A
    window shorter than data.seq_length changes transformers' logits (mimo has no sliding
    window), so it is refused with one config error naming data.seq_length."""
    from mimo.training.hf_logits import logits_config

    inputs = llava_inputs()  # 40 tokens
    (got,) = run_on_ranks(_logits_of_each, 1, [llava_config(clip_mistral)], inputs)[0]
    ref = hf_reference(clip_mistral, inputs)
    assert rel_diff(got, ref) < TOL
    short = str(tmp_path / "short")
    shutil.copytree(clip_mistral, short)
    with open(os.path.join(short, "config.json")) as f:
        config = json.load(f)
    config["text_config"]["sliding_window"] = 32
    with open(os.path.join(short, "config.json"), "w") as f:
        json.dump(config, f)
    assert rel_diff(hf_reference(short, inputs), ref) > TOL  # the window hides tokens: full attention is wrong
    with pytest.raises(ConfigError) as exc:
        load_config(logits_config(llava_config(short), 2, 40))
    assert str(exc.value) == ("error: data.seq_length: 40 is longer than the sliding_window (32) of model.hf; "
                              "mimo attends over whole sequences, so use data.seq_length <= 32")
    load_config(logits_config(llava_config(short), 2, 32))  # within the window: exact, accepted


@pytest.mark.slow
def test_clip_llama_logits_colocated_tp2(clip_llama):
    inputs = llava_inputs()
    raw = llava_config(clip_llama, language={"tp": 2}, images={"tp": 2})
    assert rel_diff(mimo_logits(raw, inputs), hf_reference(clip_llama, inputs)) < TOL


def test_clip_llama_logits_noncolocated_llm_pp2(clip_llama):
    inputs = llava_inputs()
    raw = llava_config(clip_llama, language={"pp": 2}, images={"rank_offset": 2})
    assert rel_diff(mimo_logits(raw, inputs), hf_reference(clip_llama, inputs)) < TOL


def test_clip_llama_logits_llm_dp2_under_a_balancer(clip_llama):
    """Rows of unequal work (two images, none) on 2 LLM DP ranks, with `data.balance: mmscale` in the
    config: the logits come back in row order (a balancer would move rows between microbatches, so the
    logits run turns it off)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, IMAGE - 1, (4, 40), generator=g)
    ids[0, 2:34] = IMAGE
    ids[2, 5:37] = IMAGE  # rows 0 and 2: DP rank 0's microbatches, unless balanced
    inputs = {"input_ids": ids, "pixel_values": torch.randn(4, 3, 16, 16, generator=g)}
    raw = llava_config(clip_llama, language={"dp": 2}, images={"dp": 2})
    raw["data"] = {"balance": "mmscale"}
    assert rel_diff(mimo_logits(raw, inputs), hf_reference(clip_llama, inputs)) < TOL


@pytest.mark.slow
def test_clip_llama_logits_noncolocated_llm_pp2_tp2(clip_llama):
    inputs = llava_inputs()
    raw = llava_config(clip_llama, language={"tp": 2, "pp": 2}, images={"rank_offset": 4})
    assert rel_diff(mimo_logits(raw, inputs), hf_reference(clip_llama, inputs)) < TOL


def _logits_then_export(raw, inputs, out_dir):
    from mimo.training.hf_export import export_hf
    from mimo.training.hf_logits import split_inputs, trainer_logits
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    logits = trainer_logits(trainer, split_inputs(cfg, inputs))  # forward + backward, no update
    export_hf(trainer, out_dir)
    return logits


def _tensors(d):
    from safetensors import safe_open

    index = os.path.join(d, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    res = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as h:
            res.update({k: h.get_tensor(k) for k in h.keys()})
    return res


def test_siglip_qwen2_tied_colocated_tp2_logits_and_exact_export(siglip_qwen2, tmp_path):
    """Logits within tolerance at colocated TP2; the export (streamed from the TP2 shards) holds
    exactly the source tensors and loads in transformers with the same logits."""
    from mimo.training.hf_logits import logits_config, merge_logits

    inputs = llava_inputs()
    out = str(tmp_path / "exported")
    raw = logits_config(llava_config(siglip_qwen2, language={"tp": 2}, images={"tp": 2}), 2, 40)
    got = merge_logits(run_on_ranks(_logits_then_export, 2, raw, inputs, out), 2)
    ref = hf_reference(siglip_qwen2, inputs)
    assert rel_diff(got, ref) < TOL

    src, exported = _tensors(siglip_qwen2), _tensors(out)
    assert set(src) == set(exported)
    for k in src:
        assert exported[k].dtype == src[k].dtype and torch.equal(exported[k], src[k]), k
    assert torch.equal(hf_reference(out, inputs), ref)
    assert os.path.isfile(os.path.join(out, "config.json"))


def test_siglip_qwen2_tied_noncolocated_llm_tp2_pp2_logits_and_exact_export(siglip_qwen2, tmp_path):
    """Tied embeddings with the LLM at TP2 x PP2 (tower on a fifth rank): the last stage's
    output weight is read from embed_tokens, the logits match transformers, and the export writes the
    tied weight once (embed_tokens, no lm_head), exactly the source tensors."""
    from mimo.training.hf_logits import logits_config, merge_logits

    inputs = llava_inputs()
    out = str(tmp_path / "exported")
    raw = logits_config(llava_config(siglip_qwen2, language={"tp": 2, "pp": 2}, images={"rank_offset": 4}), 2, 40)
    got = merge_logits(run_on_ranks(_logits_then_export, 5, raw, inputs, out), 2)
    ref = hf_reference(siglip_qwen2, inputs)
    assert rel_diff(got, ref) < TOL

    src, exported = _tensors(siglip_qwen2), _tensors(out)
    assert not [k for k in src if k.endswith("lm_head.weight")]
    assert set(src) == set(exported)
    for k in src:
        assert exported[k].dtype == src[k].dtype and torch.equal(exported[k], src[k]), k
    assert torch.equal(hf_reference(out, inputs), ref)


@pytest.mark.slow
def test_export_cli_round_trip_is_exact(siglip_qwen2, tmp_path):
    """`python -m mimo.hf export` on a non-colocated layout (LLM TP2, tower on its own rank) writes
    exactly the source tensors. The config is a training config whose data is not on this machine:
    the export reads none of it (before: `error: data.path: no such file`, exit 2)."""
    import yaml

    cfg = tmp_path / "c.yaml"
    raw = llava_config(siglip_qwen2, language={"tp": 2}, images={"rank_offset": 2})
    raw["data"] = {"kind": "llava", "path": "/nonexistent/train.jsonl", "tokenizer": "/nonexistent/tokenizer"}
    cfg.write_text(yaml.safe_dump(raw))
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-m", "mimo.hf", "export", "--config", str(cfg), "--out", out],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    src, exported = _tensors(siglip_qwen2), _tensors(out)
    assert set(src) == set(exported)
    for k in src:
        assert exported[k].dtype == src[k].dtype and torch.equal(exported[k], src[k]), k


@pytest.fixture(scope="module")
def llama_ckpt(clip_llama, tmp_path_factory):
    """clip_llama imported and trained 2 Adam steps on 1 rank with `training.save`: the checkpoint
    directory and the trainer's weights after those steps (the ones saved at step 2)."""
    from checkpoint_harness import train

    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    raw = llava_config(clip_llama)
    raw["data"] = {"seq_length": 64, "seed": 0}
    raw["training"].update(micro_batch_size=1, train_iters=2, optimizer="adam", lr=0.01, seed=5, save=ckpt)
    return {"dir": ckpt, "raw": raw, "params": train(raw)["params"]}


def _export_load(cfg_path, out_dir, ckpt_dir):
    """The CLI's own function, in this process (saves a Python start-up)."""
    from mimo.hf.__main__ import main

    return main(["export", "--config", str(cfg_path), "--load", str(ckpt_dir), "--out", str(out_dir)])


def test_export_refuses_a_checkpoint_that_runs_code(clip_llama, llama_ckpt, tmp_path, capsys):
    """`export --load` of a checkpoint whose common state is a pickle that runs code (manifest
    resealed): one `error:` line naming the file, exit 2, and the code never runs."""
    import shutil

    import yaml

    from checkpoint_harness import poison
    from mimo.checkpoint import paths

    d = str(tmp_path / "ck")
    shutil.copytree(llama_ckpt["dir"], d)
    marker = str(tmp_path / "ran")
    path = poison(paths.iter_dir(d, 2), "common.pt", marker)
    cfg = tmp_path / "export.yaml"
    cfg.write_text(yaml.safe_dump(llava_config(clip_llama)))
    capsys.readouterr()
    assert _export_load(cfg, tmp_path / "out", d) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}: holds objects a checkpoint may not hold"), errors
    assert not os.path.exists(marker)


def test_export_of_a_checkpoint_gives_its_trained_weights(clip_llama, llama_ckpt, tmp_path, capsys):
    """`export --load` of the 1-rank checkpoint at another layout (colocated TP2): transformers loads
    the export, and every tensor equals the trainer's weight after the 2 steps mapped to HF names;
    the trained tensors differ from the source's (negative control). No checkpoint at --load: one
    `error:` line before any rank starts."""
    import yaml
    from transformers import LlavaForConditionalGeneration

    from mimo.checkpoint import paths
    from mimo.hf import Source, hf_modules
    from mimo.hf.convert import split_entry

    assert paths.read_latest(llama_ckpt["dir"]) == 2
    hub = str(tmp_path / "hub")  # a Hub directory that also ships the weights in PyTorch's format
    shutil.copytree(clip_llama, hub)
    for f in ("pytorch_model.bin", "pytorch_model.bin.index.json", "generation_config.json"):
        (tmp_path / "hub" / f).write_text("{}")
    cfg = tmp_path / "export.yaml"
    cfg.write_text(yaml.safe_dump(llava_config(hub, language={"tp": 2}, images={"tp": 2})))
    out = tmp_path / "out"
    capsys.readouterr()
    assert _export_load(cfg, out, llama_ckpt["dir"]) == 0  # DIR: its latest, read once before the ranks start
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out} (weights of {paths.iter_dir(llama_ckpt['dir'], 2)})"

    saved, src = llama_ckpt["params"], Source(clip_llama)
    expected = {}
    for name, mod in hf_modules(load_config(llama_ckpt["raw"])).items():
        for e in mod.entries:
            expected.update(split_entry(e, saved[f"{name}.{e.mimo}"], src))
    exported, source = _tensors(str(out)), _tensors(clip_llama)
    assert set(exported) == set(source)
    for k, v in expected.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    for k in set(source) - set(expected):  # tower layers past the feature layer: copied from the source
        assert torch.equal(exported[k], source[k]), k
    trained = [k for k in expected if not torch.equal(expected[k], source[k])]
    assert len(trained) == len(expected)  # every tensor moved in 2 Adam steps (no frozen module here)

    # The untrained PyTorch-format weights are not copied next to the trained ones; other files are.
    assert "generation_config.json" in os.listdir(out) and not [f for f in os.listdir(out) if "pytorch_model" in f]
    model = LlavaForConditionalGeneration.from_pretrained(str(out))  # transformers reads the export
    reloaded = model.state_dict()
    emb = next(k for k in expected if k.endswith("embed_tokens.weight"))
    assert torch.equal(next(v for k, v in reloaded.items() if k.endswith("embed_tokens.weight")), expected[emb])
    assert sum(v.numel() for v in reloaded.values()) == sum(v.numel() for v in source.values())

    capsys.readouterr()
    assert _export_load(cfg, out, tmp_path / "none") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no checkpoint here" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_export_of_a_checkpoint_of_another_architecture_is_one_error_line(llama_ckpt, tmp_path, capsys):
    """A Qwen2 config (QKV biases) exporting a Llama checkpoint named by its iter_NNNNNNN directory."""
    import yaml

    from mimo.checkpoint import paths

    other = mk.make_llava(str(tmp_path / "other"), "clip", "qwen2")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(llava_config(other)))
    it = paths.iter_dir(llama_ckpt["dir"], 2)
    capsys.readouterr()
    assert _export_load(cfg, tmp_path / "out", it) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(
        f"error: {it}: language.decoder.layers.0.self_attention.linear_qkv.bias: not in the checkpoint"), err


# -- Whisper ---------------------------------------------------------------------------------------


def _whisper_outputs(raw, mel, wav):
    """The encoder's outputs on `mel` and on `wav` as the data pipeline's AudioLoader features it."""
    from mimo.data.audio import AudioLoader
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    clip = AudioLoader(cfg.model.encoders["audio"])(wav)  # [frames, mels]
    with torch.no_grad():
        return trainer.parts["audio"].encoder(mel.transpose(1, 2)), trainer.parts["audio"].encoder(clip[None])


def test_whisper_encoder_outputs_match_transformers(tmp_path):
    """On random mel features and on a WAV clip through the data pipeline (the directory's saved
    WhisperFeatureExtractor) vs transformers' extractor + WhisperModel encoder."""
    import wave

    from transformers import WhisperFeatureExtractor, WhisperModel

    d = mk.make_whisper(str(tmp_path / "whisper"))
    mel = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))  # [n, mel, frames], as Whisper takes
    audio = (0.3 * torch.sin(torch.arange(3000) * 0.2) * 32767).round().to(torch.int16)  # 0.19 s at 16 kHz
    wav = str(tmp_path / "tone.wav")
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(audio.numpy().tobytes())
    raw = {"model": {"language": dict(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                      max_sequence_length=64),
                     "encoders": {"audio": {"kind": "audio", "hf": d}}},
           "parallelism": {"language": {}, "audio": {}}, "data": {"seq_length": 32},
           "training": {"global_batch_size": 1}}
    got, got_wav = run_on_ranks(_whisper_outputs, 1, raw, mel, wav)[0]
    whisper = WhisperModel.from_pretrained(d).eval().encoder
    features = WhisperFeatureExtractor.from_pretrained(d)(  # the encoder's 32-frame window (max_source_positions 16)
        audio.numpy() / 32768.0, sampling_rate=16000, max_length=32 * 160, return_tensors="pt")["input_features"]
    with torch.no_grad():
        ref, ref_wav = whisper(mel).last_hidden_state, whisper(features).last_hidden_state
    assert got.shape == ref.shape == (2, 16, 32) and got_wav.shape == ref_wav.shape == (1, 16, 32)
    assert rel_diff(got, ref) < TOL
    assert rel_diff(got_wav, ref_wav) < TOL


# -- bad input ---------------------------------------------------------------------------------------


def test_missing_and_misshaped_tensors_are_one_error_line(clip_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(clip_llama, bad)
    path = os.path.join(bad, "model.safetensors")
    tensors = load_file(path)
    norm = next(k for k in tensors if k.endswith("model.norm.weight"))
    tensors[norm] = tensors[norm][:10]
    save_file(tensors, path, metadata={"format": "pt"})
    inputs = tmp_path / "in.pt"
    torch.save(llava_inputs(), inputs)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "hf_logits.py"), "--config", str(tmp_path / "c.yaml"),
           "--inputs", str(inputs), "--out", str(tmp_path / "out.pt")]
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(llava_config(bad)))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {path}: {norm}: shape [10], the config needs [64]"]

    from mimo.hf import HFWeightsError, check_hf_weights

    cfg = load_config(llava_config(bad))
    del tensors[norm]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HFWeightsError) as exc:
        check_hf_weights(cfg)
    assert str(exc.value) == f"error: {bad}: missing tensor {norm}"

    os.remove(path)
    with pytest.raises(HFWeightsError) as exc:
        check_hf_weights(cfg)
    assert str(exc.value) == f"error: {bad}: no model.safetensors or model.safetensors.index.json"


def test_logits_inputs_transformers_would_refuse_are_one_error_line(clip_llama, tmp_path):
    """More images than placeholders (transformers: "Image features and image tokens do not match";
    before, the extra image was ignored and logits written), token ids beyond the vocabulary (an
    IndexError traceback) and a file torch.save did not write (a KeyError traceback)."""
    from mimo.training.hf_logits import split_inputs

    cfg = load_config(llava_config(clip_llama))
    extra = llava_inputs()
    extra["input_ids"][1, 10:26] = 5  # the second row's image tokens gone: two images, one placeholder run
    with pytest.raises(ValueError, match=r"pixel_values: 2 items, but input_ids has placeholders for 1"):
        split_inputs(cfg, extra)
    wide = llava_inputs()
    wide["input_ids"][0, 0] = cfg.model.language.vocab_size
    with pytest.raises(ValueError, match=r"input_ids: token ids must be in \[0, \d+\)"):
        split_inputs(cfg, wide)
    assert len(split_inputs(cfg, llava_inputs())) == 2  # the good inputs still split

    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(llava_config(clip_llama)))
    text = tmp_path / "in.txt"
    text.write_text("these are not tensors")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "hf_logits.py"), "--config", str(tmp_path / "c.yaml"),
                        "--inputs", str(text), "--out", str(tmp_path / "out.pt")], capture_output=True, text=True,
                       cwd=ROOT)
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [f"error: {text}: not a file torch.save wrote (a dict "
                                                                  "of tensors with input_ids)"]), r.stderr


def test_quantized_weights_and_a_stale_index_are_one_error_line(clip_llama, tmp_path):
    """An FP8 checkpoint has the real weights' shapes: refused by its config's quantization_config
    and, without one, by the tensors' dtype; an index naming the wrong shard: the file and tensor named
    (not safetensors' own traceback)."""
    import json

    from safetensors.torch import load_file, save_file

    from mimo.hf import HFWeightsError, check_hf_weights

    fp8 = str(tmp_path / "fp8")
    shutil.copytree(clip_llama, fp8)
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    gate = next(k for k in tensors if k.endswith("layers.0.mlp.gate_proj.weight"))
    tensors[gate] = tensors[gate].to(torch.float8_e4m3fn)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = load_config(llava_config(fp8))  # no quantization_config: the dtype gives it away
    with pytest.raises(HFWeightsError) as exc:
        check_hf_weights(cfg)
    assert str(exc.value) == (f"error: {path}: {gate}: dtype F8_E4M3: only F32, BF16, F16, F64 weights are read "
                              "(a quantized checkpoint?)")
    with open(os.path.join(fp8, "config.json")) as f:
        hc = json.load(f)
    hc["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(hc, f)
    with pytest.raises(ConfigError) as exc:
        load_config(llava_config(fp8))
    assert exc.value.problems == [("model.hf", f"{os.path.join(fp8, 'config.json')}: quantization_config (fp8 "
                                               "weights) is not supported; use the checkpoint in bf16, fp16 or fp32")]

    sharded = str(tmp_path / "sharded")
    shutil.copytree(clip_llama, sharded)
    tensors = load_file(os.path.join(sharded, "model.safetensors"))
    os.remove(os.path.join(sharded, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(sharded, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    index = os.path.join(sharded, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = load_config(llava_config(sharded))
    check_hf_weights(cfg)  # control: the right index reads
    norm = next(k for k in names if k.endswith("model.norm.weight"))
    wrong = next(f for f in halves if norm not in halves[f])
    weight_map[norm] = wrong
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.raises(HFWeightsError) as exc:
        check_hf_weights(cfg)
    assert str(exc.value) == (f"error: {os.path.join(sharded, wrong)}: {norm}: listed in "
                              "model.safetensors.index.json but not in this file (a stale index?)")
    # A malformed index is one line naming it (before: AttributeError / TypeError tracebacks).
    for bad in ({"weight_map": list(weight_map)}, [weight_map], {"weight_map": {norm: None}}, {"metadata": {}}):
        with open(index, "w") as f:
            json.dump(bad, f)
        with pytest.raises(HFWeightsError) as exc:
            check_hf_weights(cfg)
        assert str(exc.value) == (f"error: {index}: not a shard index: expected "
                                  "{\"weight_map\": {tensor name: file name}}"), bad


def test_tokenizer_and_processor_are_located_in_model_hf(clip_llama, tmp_path):
    from mimo.hf import processor_dir, tokenizer_dir

    d = str(tmp_path / "with_tokenizer")
    shutil.copytree(clip_llama, d)
    cfg = load_config(llava_config(d))
    assert tokenizer_dir(cfg) is None and processor_dir(cfg) is None  # no such files yet
    for f in ("tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / "with_tokenizer" / f).write_text("{}")
    assert tokenizer_dir(cfg) == d and processor_dir(cfg) == d


def test_images_go_through_the_processor_saved_with_the_model(clip_llama, tmp_path):
    # model.hf without preprocessor_config.json: the pipeline resizes and
    # normalises itself; with one of the tower's size it is used; with one of
    # another size the config check names the field before anything runs.
    from PIL import Image
    from transformers import CLIPImageProcessor

    from mimo.data import build_dataset

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_sample_data

    data = str(tmp_path / "data")
    assert make_sample_data.main([data, "--records", "8", "--image-size", "24"]) == 0
    d = str(tmp_path / "model")
    shutil.copytree(clip_llama, d)
    raw = llava_config(d)
    raw["data"] = {"kind": "llava", "path": os.path.join(data, "train.json"),
                   "tokenizer": os.path.join(data, "tokenizer"), "seq_length": 48}
    picture = next(os.path.join(data, "images", f) for f in sorted(os.listdir(os.path.join(data, "images"))))

    assert build_dataset(load_config(raw)).image_loader(picture).shape == (3, 16, 16)

    mine = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    mine.save_pretrained(d)
    got = build_dataset(load_config(raw)).image_loader(picture)
    want = mine(images=Image.open(picture).convert("RGB"), return_tensors="pt")["pixel_values"][0]
    assert torch.equal(got, want)

    CLIPImageProcessor().save_pretrained(d)    # 224 px crops for a 16 px tower
    with pytest.raises(ConfigError) as exc:
        load_config(raw)
    assert exc.value.problems[0] == ("model.encoders.images.image_size",
                                     f"16, but the image processor in {d} makes 224 x 224 images "
                                     "(preprocessor_config.json)")


def test_a_missing_tokenizer_names_the_directories_searched(clip_llama, tmp_path):
    raw = llava_config(clip_llama)
    (tmp_path / "train.json").write_text("[]")
    raw["data"] = {"kind": "llava", "path": str(tmp_path / "train.json"), "seq_length": 48}
    with pytest.raises(ConfigError) as exc:
        load_config(raw)
    assert ("data.tokenizer", f"required for data.kind llava (an HF tokenizer directory): model.hf ({clip_llama}) "
            "holds no tokenizer files") in exc.value.problems


def test_export_builds_the_model_without_reading_the_configs_data(clip_llama, tmp_path, capsys):
    """A training config whose records and tokenizer are not on this machine exports all the same:
    the export reads no data (before: `error: data.path: no such file` and a data.tokenizer error)."""
    import yaml

    from mimo.hf.__main__ import main

    raw = llava_config(clip_llama)
    raw["data"] = {"kind": "llava", "path": "/nonexistent/train.jsonl", "tokenizer": "/nonexistent/tokenizer",
                   "seq_length": 64}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["export", "--config", str(cfg), "--out", str(out)]) == 0, capsys.readouterr().err
    src, exported = _tensors(clip_llama), _tensors(str(out))
    assert set(src) == set(exported) and all(torch.equal(exported[k], src[k]) for k in src)


def test_export_refuses_a_directory_it_would_mix_with(clip_llama, tmp_path, capsys):
    """An export writes shards beside what the directory holds (transformers would then load a stale
    model.safetensors): the source itself, a non-empty directory or a file is one `error:` line,
    exit 2, before any rank starts, and nothing is written; likewise `--hf-export` of a training run."""
    import yaml

    from mimo.hf.__main__ import main

    src = str(tmp_path / "src")
    shutil.copytree(clip_llama, src)
    before = sorted(os.listdir(src))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(llava_config(src)))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_text("old")
    (tmp_path / "afile").write_text("x")
    cases = {src: f"{src} is the source directory model.hf; export into a new directory",
             str(tmp_path / "full"): f"{tmp_path / 'full'} is not empty; export into a new or empty directory",
             str(tmp_path / "afile"): f"{tmp_path / 'afile'} exists and is not a directory"}
    capsys.readouterr()
    for out, reason in cases.items():
        assert main(["export", "--config", str(cfg), "--out", out]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: --out: {reason}"]
    assert sorted(os.listdir(src)) == before and os.listdir(tmp_path / "full") == ["model.safetensors"]

    r = subprocess.run([sys.executable, "examples/pretrain_mimo.py", "--config", str(cfg), "--device", "cpu",
                        "--hf-export", src], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.splitlines() == [f"error: --hf-export: {cases[src]}"], r.stderr
