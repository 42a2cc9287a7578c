"""Hugging Face MoE LLMs (Qwen3-MoE, Qwen2-MoE, Mixtral; alone and inside LLaVA): mimo's FP32 logits
equal transformers' within 1e-4 at 1 rank and with the experts spread over EP ranks (colocated
DP2·EP2, and the LLM at DP2·EP2 beside a vision tower on its own rank), with both token
dispatchers; one perturbed expert changes them beyond the tolerance; `export` writes per-expert
tensors that transformers loads with the same logits, and `export --load` of a checkpoint saved at
EP2 writes the same trained tensors at EP1 and EP2.

Tiny random models are built and saved in the test (no download).
"""

import json
import os
import shutil

import pytest
import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime

TOL = 1e-4   # max |diff| / max |ref| of the logits
VOCAB = 96
IMAGE = VOCAB - 1
TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=128)


def _text_config(kind: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "qwen3_moe":  # 8 experts, top 2, renormalised top-k, q/k norms, head_dim != hidden / heads
        return Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                              head_dim=16, norm_topk_prob=True, **TEXT)
    if kind == "qwen2_moe":  # shared expert with its sigmoid gate, layer 0 dense, no top-k renormalisation
        return Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                              shared_expert_intermediate_size=24, mlp_only_layers=[0], norm_topk_prob=False, **TEXT)
    return MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, **TEXT)


def _save(model, out: str) -> str:
    with torch.no_grad():  # larger than the default init so that differences show in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def make_causal(out: str, kind: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return _save(AutoModelForCausalLM.from_config(_text_config(kind)), out)


def make_llava(out: str, kind: str, seed: int = 0) -> str:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          image_size=16, patch_size=4, projection_dim=16)
    cfg = LlavaConfig(vision_config=vc, text_config=_text_config(kind), image_token_id=IMAGE,
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    return _save(LlavaForConditionalGeneration(cfg), out)


def text_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, IMAGE - 1, (2, 24), generator=g)}


def llava_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, IMAGE - 1, (2, 32), generator=g)
    ids[0, 3:19] = IMAGE  # one image (16 features) per row
    ids[1, 10:26] = IMAGE
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}


def hf_reference(directory, inputs):
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    llava = "pixel_values" in inputs
    model = (LlavaForConditionalGeneration if llava else AutoModelForCausalLM).from_pretrained(directory).eval()
    with torch.no_grad():
        return model(**inputs).logits


def rel_diff(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def causal_config(directory, **language):
    return {"model": {"language": {"hf": directory}}, "parallelism": {"language": language},
            "training": {"global_batch_size": 2}}


def llava_config(directory, dispatcher="alltoall", **parallelism):
    par = parallelism or {"language": {}, "images": {}}
    return {"model": {"hf": directory, "language": {"moe_token_dispatcher_type": dispatcher}},
            "parallelism": par, "training": {"global_batch_size": 2}}


def _logits_of_each(raws, inputs, export=None):
    """On each rank: the logits of several configs, one after the other (one process start); then,
    with `export` = (raw, out_dir), that config's model written by `export_hf`."""
    from mimo.training import Trainer
    from mimo.training.hf_export import export_hf
    from mimo.training.hf_logits import logits_config, split_inputs, trainer_logits

    out = []
    for raw in raws:
        cfg = load_config(logits_config(raw, *inputs["input_ids"].shape))
        out.append(trainer_logits(Trainer(cfg, select_runtime("cpu")), split_inputs(cfg, inputs)))
    if export is not None:
        export_hf(Trainer(load_config(export[0]), select_runtime("cpu")), export[1])
    return out


def _merged(per_rank, i, batch=2):
    merged = {}
    for r in per_rank:
        merged.update(r[i])
    return torch.stack([merged[k] for k in range(batch)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    return {"qwen3_moe": make_causal(str(root / "qwen3_moe"), "qwen3_moe"),
            "qwen2_moe": make_causal(str(root / "qwen2_moe"), "qwen2_moe"),
            "mixtral": make_causal(str(root / "mixtral"), "mixtral"),
            "llava_qwen3_moe": make_llava(str(root / "llava_qwen3_moe"), "qwen3_moe"),
            "llava_mixtral": make_llava(str(root / "llava_mixtral"), "mixtral")}


def test_config_fields_from_hf(models):
    q3 = load_config(causal_config(models["qwen3_moe"])).model.language
    assert (q3.num_moe_experts, q3.moe_router_topk, q3.moe_ffn_hidden_size, q3.ffn_hidden_size) == (8, 2, 16, 48)
    assert q3.qk_layernorm and not q3.moe_router_pre_softmax and q3.moe_layer_freq == 1 and q3.kv_channels == 16
    assert q3.moe_aux_loss_coeff == pytest.approx(0.001) and q3.moe_shared_expert_intermediate_size == 0
    q2 = load_config(causal_config(models["qwen2_moe"])).model.language
    assert q2.moe_layer_freq == [0, 1] and q2.moe_router_pre_softmax and q2.qkv_bias and not q2.qk_layernorm
    assert (q2.moe_shared_expert_intermediate_size, q2.moe_shared_expert_gate) == (24, True)
    mx = load_config(causal_config(models["mixtral"])).model.language
    assert (mx.moe_ffn_hidden_size, mx.moe_router_pre_softmax, mx.moe_shared_expert_intermediate_size) == (16, False, 0)
    lv = load_config(llava_config(models["llava_mixtral"])).model.language
    assert lv.num_moe_experts == 8 and lv.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_config_without_its_architecture_keys_builds_what_transformers_builds(model_type):
    """transformers fills in missing architecture keys with its own per-model defaults (top 8 for
    Qwen3-MoE, top 4 and a 5,632-wide shared expert for Qwen2-MoE); mimo used top 2 and no shared
    expert, a different model from the same config.json."""
    from transformers import AutoConfig

    from mimo.config.hf_arch import moe_fields

    tc = {"model_type": model_type, "num_hidden_layers": 2, "num_experts": 8, "num_local_experts": 8,
          "moe_intermediate_size": 16, "intermediate_size": 16}
    got = moe_fields(tc, "model.language.hf")
    ref = AutoConfig.for_model(model_type, **{k: v for k, v in tc.items() if k != "model_type"})
    assert got["moe_router_topk"] == ref.num_experts_per_tok
    assert ref.num_experts_per_tok != 2 or model_type == "mixtral"  # (Mixtral's own default is 2)
    assert got.get("moe_shared_expert_intermediate_size", 0) == (getattr(ref, "shared_expert_intermediate_size", 0) or 0)
    assert got["moe_router_pre_softmax"] == (model_type != "mixtral" and not ref.norm_topk_prob)


def test_top1_routing_with_renormalised_weights_is_refused_and_without_is_imported():
    """transformers' renormalised top-1 (Mixtral, norm_topk_prob) weighs every token 1.0, which megatron-core's
    router cannot express: a config error naming the field, not a crash at the model build. Top-1 without
    renormalisation is megatron's pre-softmax top-1, which the config check then accepts."""
    from mimo.config.hf_arch import HFConfigProblem, moe_fields

    base = {"num_hidden_layers": 2, "num_experts": 8, "num_local_experts": 8, "moe_intermediate_size": 16,
            "intermediate_size": 16, "num_experts_per_tok": 1}
    for tc in ({"model_type": "mixtral"}, {"model_type": "qwen3_moe", "norm_topk_prob": True}):
        with pytest.raises(HFConfigProblem, match="num_experts_per_tok 1 and renormalised"):
            moe_fields({**base, **tc}, "model.language.hf")
    got = moe_fields({**base, "model_type": "qwen2_moe", "norm_topk_prob": False}, "model.language.hf")
    assert (got["moe_router_topk"], got["moe_router_pre_softmax"]) == (1, True)


@pytest.mark.parametrize("model_type,keys", [
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),  # every layer slides
    ("qwen3_moe", dict(use_sliding_window=True)),  # the window left out: transformers' 4096
    ("qwen3_moe", dict(sliding_window=16)),  # no use_sliding_window: none
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),  # layer 0 of 2
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),  # none below 0
    ("mixtral", dict(sliding_window=16)),  # Mixtral: every layer, whenever it is set
    ("mixtral", dict()),
])
def test_the_sliding_window_is_the_one_transformers_applies(model_type, keys):
    """The window mimo checks data.seq_length against, against the windows of transformers' own
    attention layers built from the same config.json (the rules differ by model type: Qwen2-MoE slides
    every other layer below max_window_layers, Qwen3-MoE every layer; mimo used Qwen2's rule for all)."""
    from transformers import AutoModelForCausalLM

    from mimo.config.hf_arch import sliding_window

    config = _text_config(model_type)
    for k, v in keys.items():
        setattr(config, k, v)
    tc = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "sliding_window")}
    tc.update(keys)  # as a config.json that names only these
    config = type(config)(**{k: v for k, v in tc.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config)
    # Each layer's window as transformers' forward picks it: by its layer type where the config has
    # them (Qwen2-MoE's mask per layer type), else its attention's own (Qwen3-MoE), else the config's,
    # which Mixtral's attention hands to the kernel.
    types = getattr(config, "layer_types", None)
    windows = {(config.sliding_window if types[i] == "sliding_attention" else None) if types else
               getattr(layer.self_attn, "sliding_window", config.sliding_window)
               for i, layer in enumerate(model.model.layers)} - {None, 0}
    got = sliding_window(tc)
    assert ({got} if got is not None else set()) == windows, (tc, windows)


def test_causal_moe_logits_single_rank_and_negative_control(models, tmp_path):
    """Qwen3-MoE, Qwen2-MoE and Mixtral at 1 rank within tolerance; one Qwen3-MoE expert 2% off
    in mimo's copy moves the logits outside it."""
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(models["qwen3_moe"], bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    tensors[key] = tensors[key] * 1.02
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    inputs = text_inputs()
    kinds = ["qwen3_moe", "qwen2_moe", "mixtral"]
    raws = [causal_config(models[k]) for k in kinds] + [causal_config(bad)]
    out = str(tmp_path / "exported")
    (got,) = run_on_ranks(_logits_of_each, 1, raws, inputs, (causal_config(models["qwen3_moe"]), out))
    for i, k in enumerate(kinds):
        assert rel_diff(_merged([got], i), hf_reference(models[k], inputs)) < TOL, k
    assert rel_diff(_merged([got], 3), hf_reference(models["qwen3_moe"], inputs)) > TOL
    _check_export(models["qwen3_moe"], out, inputs)


def _tensors(d):
    from safetensors import safe_open

    index = os.path.join(d, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    res = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as h:
            res.update({k: h.get_tensor(k) for k in h.keys()})
    return res


def _check_export(source, out, inputs):
    """The export holds exactly the source's tensors (one per expert) and transformers loads it with
    the same logits."""
    src, exported = _tensors(source), _tensors(out)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in exported
    assert set(src) == set(exported)
    for k in src:
        assert exported[k].dtype == src[k].dtype and torch.equal(exported[k], src[k]), k
    assert torch.equal(hf_reference(out, inputs), hf_reference(source, inputs))


def test_colocated_dp2_ep2_logits_both_dispatchers_and_export(models, tmp_path):
    """2 ranks, the LLM at DP2·EP2 (EP out of DP: each rank holds 4 of the 8 experts): LLaVA +
    Qwen3-MoE (all-to-all), LLaVA + Mixtral (all-gather), Qwen2-MoE (shared expert, dense layer 0);
    then Qwen3-MoE exported from EP2, each EP rank writing its own experts."""
    par = {"language": {"dp": 2, "ep": 2}, "images": {"dp": 2}}
    raws = [llava_config(models["llava_qwen3_moe"], "alltoall", **par),
            llava_config(models["llava_mixtral"], "allgather", **par),
            causal_config(models["qwen2_moe"], dp=2, ep=2)]
    out = str(tmp_path / "exported")
    li, ti = llava_inputs(), text_inputs()
    got = run_on_ranks(_logits_of_each, 2, raws[:2], li)
    assert rel_diff(_merged(got, 0), hf_reference(models["llava_qwen3_moe"], li)) < TOL
    assert rel_diff(_merged(got, 1), hf_reference(models["llava_mixtral"], li)) < TOL
    got = run_on_ranks(_logits_of_each, 2, raws[2:], ti, (causal_config(models["qwen3_moe"], dp=2, ep=2), out))
    assert rel_diff(_merged(got, 0), hf_reference(models["qwen2_moe"], ti)) < TOL
    assert sorted(f for f in os.listdir(out) if "experts" in f) == [
        "model-language-000-experts-000.safetensors", "model-language-000-experts-001.safetensors"]
    _check_export(models["qwen3_moe"], out, ti)


def test_noncolocated_encoder_alone_llm_dp2_ep2_both_dispatchers(models):
    """3 ranks: the CLIP tower on rank 2, the LLM (Qwen3-MoE) at DP2·EP2 on ranks 0-1, with each
    token dispatcher."""
    par = {"language": {"dp": 2, "ep": 2}, "images": {"rank_offset": 2}}
    raws = [llava_config(models["llava_qwen3_moe"], d, **par) for d in ("allgather", "alltoall")]
    li = llava_inputs()
    got = run_on_ranks(_logits_of_each, 3, raws, li)
    ref = hf_reference(models["llava_qwen3_moe"], li)
    for i in range(2):
        assert rel_diff(_merged(got, i), ref) < TOL


def test_tp2_sp_with_ep_out_of_tp_and_expert_tp(models):
    """2 ranks, LLM TP2 + SP: EP2 carved out of TP (each TP rank holds 4 whole experts), and ep 1
    with etp 2 (every expert's FFN split over the TP pair, read as row slices of each HF expert)."""
    raws = [causal_config(models["qwen3_moe"], tp=2, sp=True, ep=2),
            causal_config(models["qwen2_moe"], tp=2, sp=True, etp=2)]
    ti = text_inputs()
    got = run_on_ranks(_logits_of_each, 2, raws, ti)
    assert rel_diff(_merged(got, 0), hf_reference(models["qwen3_moe"], ti)) < TOL
    assert rel_diff(_merged(got, 1), hf_reference(models["qwen2_moe"], ti)) < TOL


def test_export_cli_llava_mixtral_noncolocated_ep2(models, tmp_path):
    """`python -m mimo.hf export` of LLaVA + Mixtral with the tower on its own rank and the LLM at
    DP2·EP2: Mixtral's per-expert w1/w2/w3 come back bit-identical and transformers loads them."""
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "export.yaml"
    cfg.write_text(yaml.safe_dump(llava_config(models["llava_mixtral"], language={"dp": 2, "ep": 2},
                                               images={"rank_offset": 2})))
    out = str(tmp_path / "exported")
    r = subprocess.run([sys.executable, "-m", "mimo.hf", "export", "--config", str(cfg), "--out", out],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    src, exported = _tensors(models["llava_mixtral"]), _tensors(out)
    assert any(".block_sparse_moe.experts.7.w2.weight" in k for k in exported)
    assert set(src) == set(exported)
    for k in src:
        assert torch.equal(exported[k], src[k]), k
    li = llava_inputs()
    assert torch.equal(hf_reference(out, li), hf_reference(models["llava_mixtral"], li))


@pytest.mark.slow
def test_llm_pp2_dp2_ep2_noncolocated(models):
    """5 ranks: the tower on rank 4, the LLM (Qwen3-MoE) at PP2 x DP2 x EP2: each stage's EP ranks
    read their experts of the stage's own global layer."""
    par = {"language": {"pp": 2, "dp": 2, "ep": 2}, "images": {"rank_offset": 4}}
    li = llava_inputs()
    got = run_on_ranks(_logits_of_each, 5, [llava_config(models["llava_qwen3_moe"], **par)], li)
    assert rel_diff(_merged(got, 0), hf_reference(models["llava_qwen3_moe"], li)) < TOL


@pytest.mark.slow
def test_qwen2_moe_pp2_ep2_logits_and_export(models, tmp_path):
    """4 ranks, Qwen2-MoE at PP2 x DP2 x EP2: stage 0 holds only the dense layer 0 (no expert
    file), stage 1 the MoE layer; the export is exact."""
    ti = text_inputs()
    raw = causal_config(models["qwen2_moe"], pp=2, dp=2, ep=2)
    out = str(tmp_path / "exported")
    got = run_on_ranks(_logits_of_each, 4, [raw], ti, (raw, out))
    assert rel_diff(_merged(got, 0), hf_reference(models["qwen2_moe"], ti)) < TOL
    assert sorted(f for f in os.listdir(out) if "experts" in f) == [
        "model-language-001-experts-000.safetensors", "model-language-001-experts-001.safetensors"]
    src, exported = _tensors(models["qwen2_moe"]), _tensors(out)
    assert set(src) == set(exported) and all(torch.equal(exported[k], src[k]) for k in src)


def test_export_of_an_ep2_checkpoint_is_the_same_at_ep1_and_ep2(models, tmp_path):
    """Qwen3-MoE imported at DP2·EP2 and trained 2 Adam steps with `training.save`; `export --load`
    of that checkpoint at EP2 (2 ranks) and at EP1 (1 rank) writes bit-identical tensors under the
    same names, transformers loads the export, and the experts and routers are the trained ones
    (they differ from the source's)."""
    import yaml
    from transformers import AutoModelForCausalLM

    from checkpoint_harness import train
    from mimo.checkpoint import paths
    from mimo.hf.__main__ import main

    source, ckpt = models["qwen3_moe"], str(tmp_path / "ckpt")
    raw = causal_config(source, dp=2, ep=2)
    raw["data"] = {"seq_length": 32, "seed": 0}
    raw["training"].update(micro_batch_size=1, train_iters=2, optimizer="adam", lr=0.01, seed=5, save=ckpt)
    train(raw)
    assert paths.read_latest(ckpt) == 2

    outs = {}
    for ep, language in [(2, {"dp": 2, "ep": 2}), (1, {})]:
        cfg = tmp_path / f"export_ep{ep}.yaml"
        cfg.write_text(yaml.safe_dump(causal_config(source, **language)))
        outs[ep] = str(tmp_path / f"ep{ep}")
        assert main(["export", "--config", str(cfg), "--load", ckpt, "--out", outs[ep]]) == 0
    ep2, ep1, src = _tensors(outs[2]), _tensors(outs[1]), _tensors(source)
    assert set(ep2) == set(ep1) == set(src)
    for k in src:
        assert ep2[k].dtype == ep1[k].dtype and torch.equal(ep2[k], ep1[k]), k
    moe = [k for k in src if ".mlp.experts." in k or k.endswith(".mlp.gate.weight")]
    assert len(moe) == 2 * (8 * 3 + 1)
    assert [k for k in moe if torch.equal(ep2[k], src[k])] == []  # the trained model, not the source
    # transformers stacks the per-expert tensors it reads (gate and up concatenated per expert)
    reloaded = AutoModelForCausalLM.from_pretrained(outs[2]).state_dict()
    mlp = "model.layers.1.mlp"
    assert torch.equal(reloaded[f"{mlp}.gate.weight"], ep1[f"{mlp}.gate.weight"])
    for e in range(8):
        x = f"{mlp}.experts.{e}"
        assert torch.equal(reloaded[f"{mlp}.experts.down_proj"][e], ep1[f"{x}.down_proj.weight"]), e
        gate_up = torch.cat([ep1[f"{x}.gate_proj.weight"], ep1[f"{x}.up_proj.weight"]])
        assert torch.equal(reloaded[f"{mlp}.experts.gate_up_proj"][e], gate_up), e
