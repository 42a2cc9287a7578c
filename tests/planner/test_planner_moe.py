"""The planner and the FLOP count with a mixture-of-experts LLM (docs/moe.md, docs/planner.md):
active parameters for FLOPs, every expert a rank holds for memory, and the search's choice of `ep`.
Oracles: hand counts, and the trainer's own FLOP count (mimo.training.flops) for the same shapes."""

import copy
import os

import pytest

from mimo.config import load_config
from mimo.planner.best import searcher
from mimo.planner.megatron import Par
from mimo.planner.spec import read_model
from mimo.training.flops import StepWork, llm_layers_linear_flops, module_flops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "configs", "qwen3_30b_a3b_vision.yaml")


@pytest.fixture(scope="module")
def example():
    import yaml

    with open(EXAMPLE) as fh:
        return yaml.safe_load(fh)


def _hand_layer(h=2048, heads=32, d=128, groups=4, experts=128, topk=8, fe=768):
    attention = 2 * h * (heads * d + 2 * groups * d) + 2 * heads * d * h
    return attention, attention + 2 * h * experts + topk * 6 * h * fe      # router + top-k gated experts


def test_flops_count_active_parameters_and_match_the_trainer(example):
    cfg = load_config(EXAMPLE)
    lang = cfg.model.language
    attention, moe = _hand_layer()
    assert llm_layers_linear_flops(lang) == 48 * moe
    spec = read_model(example["model"]).language
    assert sum(spec.layer_linear_flops(i) for i in range(48)) == 48 * moe
    # A dense layer pattern (every other layer MoE) and a shared expert count as the trainer does.
    mixed = copy.deepcopy(example["model"])
    mixed["language"].update(moe_layer_freq=2, moe_shared_expert_intermediate_size=512, ffn_hidden_size=1024)
    cfg2 = load_config(EXAMPLE, ["model.language.moe_layer_freq=2",
                                 "model.language.moe_shared_expert_intermediate_size=512",
                                 "model.language.ffn_hidden_size=1024"])
    dense = attention + 6 * 2048 * 1024
    want = 24 * (moe + 6 * 2048 * 512) + 24 * dense
    assert llm_layers_linear_flops(cfg2.model.language) == want
    assert sum(read_model(mixed).language.layer_linear_flops(i) for i in range(48)) == want
    # The step's LLM forward: layers on every position, attention core at heads x head dim, the head.
    work = StepWork(samples=1, positions=4096, tokens=4096, items={"images": 0}, llm_attention_pairs=1000)
    f = module_flops(cfg, work)["language"].forward
    assert f == 4096 * 48 * moe + 48 * 4 * 1000 * 32 * 128 + 2 * 4096 * 2048 * 151936
    # Negative control: counting every expert (not the active ones) is a different number.
    assert 48 * (attention + 2 * 2048 * 128 + 128 * 6 * 2048 * 768) != llm_layers_linear_flops(lang)


def test_expert_memory_per_rank_falls_with_ep(example):
    search, spec = searcher(copy.deepcopy(example), "h100", None)
    lang = spec.language
    all_experts = 128 * 3 * 2048 * 768
    weights = {ep: search.model.module_layers(lang, Par(1, 1, 4, 8, ep=ep), 4096.0, 2048.0, 2048)[1][1]
               for ep in (1, 2, 4, 8)}
    for ep in (2, 4, 8):   # each EP rank holds num_experts / ep experts; nothing else changes
        assert weights[1] - weights[ep] == pytest.approx(all_experts * (1 - 1 / ep), rel=1e-12)
    router = 2048 * 128
    attention = 2048 * (4096 + 1024) + 4096 * 2048
    assert weights[8] == pytest.approx(attention + router + all_experts / 8 + 4 * 2048, rel=1e-12)
    # Peak memory of the whole layout falls with ep too, and ep 1 does not fit an H100.
    pars = lambda ep: {"language": Par(1, 1, 4, 8, ep=ep), "images": Par(4, 1, 1, 8)}
    peaks = [search.evaluate(pars(ep)).peak_memory for ep in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > search.limit > peaks[-1]


def test_search_picks_ep_for_experts_that_do_not_fit(example):
    # Without the distributed optimizer every DP rank holds its experts' whole Adam state.
    cfg = copy.deepcopy(example)
    cfg["training"]["use_distributed_optimizer"] = False
    search, _ = searcher(cfg, "h100", None)
    found = search.search(32)
    assert found[0].pars["language"].ep > 1
    best = found[0].pars
    at_ep1 = {**best, "language": Par(**{**best["language"].__dict__, "ep": 1, "stage_layers": ()})}
    homogeneous = found[0].estimate.placement == "homogeneous"
    assert search.evaluate(at_ep1, homogeneous).peak_memory > search.limit     # its experts do not fit at ep 1
    assert search.evaluate(best, homogeneous).peak_memory <= search.limit
    assert all(128 % p.pars["language"].ep == 0 for p in found)
    # Negative control: a dense LLM with the same active MLP width (8 x 768) never gets ep > 1.
    dense = copy.deepcopy(example)
    for k in [k for k in dense["model"]["language"] if k.startswith("moe_") or k == "num_moe_experts"]:
        del dense["model"]["language"][k]
    dense["model"]["language"]["ffn_hidden_size"] = 8 * 768
    search_d, spec_d = searcher(dense, "h100", None)
    assert not spec_d.language.is_moe
    assert all(p.pars["language"].ep == 1 for p in search_d.search(32))


def _few_big_experts(example, bias=False):
    """Two experts of FFN 65536 on 8 layers of hidden 4096: EP stops at 2, so the experts only fit
    an H100 when expert TP cuts them too."""
    cfg = copy.deepcopy(example)
    cfg["model"]["language"].update(num_layers=8, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                    ffn_hidden_size=14336, vocab_size=32000, num_moe_experts=2, moe_router_topk=1,
                                    moe_router_pre_softmax=True,  # (top 1 needs it)
                                    moe_ffn_hidden_size=65536, add_bias_linear=bias)
    del cfg["parallelism"]
    return cfg


def test_search_picks_expert_tp_when_ep_runs_out_of_experts(example):
    from mimo.planner.best import planned_config

    cfg = _few_big_experts(example)
    search, spec = searcher(cfg, "h100", None)
    found = search.search(8)
    best = found[0].pars
    lang = best["language"]
    assert lang.ep == 2 and lang.etp > 1
    for p in (f.pars["language"] for f in found):  # every candidate a split the config check takes
        assert (p.tp * p.cp * p.dp) % (p.ep * p.etp) == 0 and 65536 % (8 * p.etp) == 0 and p.etp <= 8
    homogeneous = found[0].estimate.placement == "homogeneous"
    at_etp1 = {**best, "language": Par(**{**lang.__dict__, "etp": 1, "stage_layers": ()})}
    assert search.evaluate(at_etp1, homogeneous).peak_memory > search.limit      # the experts need the cut
    assert search.evaluate(best, homogeneous).peak_memory <= search.limit
    # The emitted config is one mimo runs: the config check passes on it, etp included.
    order = ["language"] + [e.name for e in spec.encoders]
    emitted = planned_config(cfg, search, found[0], order)
    assert load_config(emitted).parallelism["language"].etp == lang.etp
    # Negative control: biased experts (megatron-core: etp 1 only) never get expert TP, and
    # --evaluate refuses it in one line.
    biased, _ = searcher(_few_big_experts(example, bias=True), "h100", None)
    assert all(f.pars["language"].etp == 1 for f in biased.search(8))
    with pytest.raises(ValueError, match=r"parallelism\.language\.etp: must be 1 with add_bias_linear"):
        biased.evaluate({**best, "language": Par(**{**lang.__dict__, "stage_layers": ()})}, homogeneous)


def test_evaluate_refuses_bad_expert_layouts(example):
    search, _ = searcher(copy.deepcopy(example), "h100", None)
    with pytest.raises(ValueError, match=r"parallelism\.language\.ep: must divide num_moe_experts"):
        search.evaluate({"language": Par(1, 1, 4, 8, ep=3), "images": Par(4, 1, 1, 8)})
    with pytest.raises(ValueError, match=r"parallelism\.images\.ep"):
        search.evaluate({"language": Par(1, 1, 4, 8, ep=8), "images": Par(4, 1, 1, 8, ep=2)})


def test_dispatch_volume_and_links(example):
    search, spec = searcher(copy.deepcopy(example), "h100", None)
    m, gpu = search.model, search.gpu
    nbytes = 4096 * 8 * 2048 * 2                          # tokens x top-k x hidden x bf16 bytes
    for ep in (2, 8, 16):
        want = 2 * ((ep - 1) / ep * nbytes / gpu.bus_bandwidth(ep) + gpu.latency(ep))
        assert m.dispatch_time(nbytes, ep) == pytest.approx(want, rel=1e-12)
    assert m.dispatch_time(nbytes, 1) == 0.0
    # An 8-rank EP group stays on the node's links; a 16-rank one crosses nodes and costs more.
    assert gpu.bus_bandwidth(8) == gpu.intra_node_bandwidth * gpu.link_efficiency
    assert m.dispatch_time(nbytes, 16) > 3 * m.dispatch_time(nbytes, 8)
    # The layer pays it forward and backward: with the dispatch free the layer is faster by 2x it.
    lang, par = spec.language, Par(1, 1, 4, 8, ep=8)
    layer = m.module_layers(lang, par, 4096.0, 2048.0, 2048)[0][1]
    m.dispatch_time = lambda nbytes, group: 0.0
    m._layers.clear()
    free = m.module_layers(lang, par, 4096.0, 2048.0, 2048)[0][1]
    a2a = type(m).dispatch_time(m, nbytes, 8)
    assert layer.forward - free.forward == pytest.approx(a2a, rel=1e-9)
    assert layer.backward_input - free.backward_input == pytest.approx(a2a, rel=1e-9)


def test_cost_model_moe_layers(example):
    """The library planner's cost model (mimo.planner.make_plan; experts at ep 1): FLOPs of the
    active parameters, weights of every expert, and a plan for the MoE model."""
    from mimo.planner import make_plan
    from mimo.planner.cost_model import CostModel, Workload
    from mimo.planner.hardware import get_gpu

    spec = read_model(example["model"]).language
    works = CostModel(get_gpu("h100")).module_work(spec, 1, 1, 1.0, Workload(4096, {}))
    moe = [w for w in works if w.kind == "moe"]
    assert len(moe) == 48 and not [w for w in works if w.kind == "transformer"]
    _, per_token = _hand_layer()
    attn = 4 * 4096 * 4096 * 4096 * 0.5            # causal pairs x heads x head dim
    assert moe[0].fwd_flops == pytest.approx(4096 * per_token + attn, rel=1e-12)
    attention_params = 2048 * (4096 + 1024) + 4096 * 2048
    assert moe[0].params == attention_params + 2048 * 128 + 128 * 3 * 2048 * 768 + 4 * 2048
    small = copy.deepcopy(example)
    small["model"]["language"].update(num_layers=4, num_moe_experts=8, moe_router_topk=2)
    small["model"]["encoders"]["images"]["num_layers"] = 2
    result = make_plan(small, 8)
    assert result.candidates and result.config["parallelism"]["language"]["ep"] == 1


def test_distributed_optimizer_shards_expert_state_over_expert_dp(example, tmp_path):
    """The config check takes the distributed optimizer with experts split over EP; the planner's
    default for an MoE LLM is on, and with it each rank's optimizer state shrinks by the expert-DP
    (and DP) degree: the predicted peak falls against the same layout without it, by at least the
    hand-counted expert-state saving, and the search still splits the experts."""
    import subprocess
    import sys

    import yaml

    cfg = copy.deepcopy(example)
    assert cfg["training"]["use_distributed_optimizer"] is True
    path = tmp_path / "distopt.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    del cfg["training"]["use_distributed_optimizer"]
    on, _ = searcher(cfg, "h100", None)
    assert on.distributed_optimizer is True  # the default, MoE or not
    cfg["training"]["use_distributed_optimizer"] = False
    off, _ = searcher(cfg, "h100", None)
    pars = {"language": Par(1, 1, 4, 8, ep=8), "images": Par(4, 1, 1, 8)}
    # Adam's two fp32 moments and the fp32 master of one stage's 16 local experts (13 layers on the first
    # stage): 12 bytes each, sharded over expert DP 1 here (ep 8 = dp 8), so no saving on them; the
    # dense weights' 12 bytes per parameter are sharded over DP 8.
    saved = off.evaluate(pars).peak_memory - on.evaluate(pars).peak_memory
    attention = 2048 * (4096 + 1024) + 4096 * 2048 + 2048 * 128 + 4 * 2048
    assert saved >= 13 * attention * 12 * (1 - 1 / 8) * 0.99
    found = on.search(32)
    assert found and found[0].pars["language"].ep > 1
