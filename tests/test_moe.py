"""Mixture-of-experts LLM with expert parallelism (docs/moe.md).

* Validation: each broken rule is one `error:` line naming the field.
* The expert decomposition of the LLM's own ranks (etp-ep-edp-pp) and the real groups built from it.
* FP32 training parity with the 1-rank run (losses over 2 steps, first-step gradients, final weights)
  for DP2·EP2 and TP2+SP+EP2 (EP carved out of TP), with both token dispatchers, aux loss off;
  TP2+SP at EP1 (experts whole on each TP rank: their gradients reduce over expert DP = TP).
* Experts with biases (megatron-core's default) at EP1 and EP2, with and without TP+SP, against the
  1-rank run.
* Negative controls: expert gradients reduced over the dense group only, and one expert perturbed on
  one rank, both fail the parity check.
* The aux load-balancing loss: its gradient equals a hand computation of megatron-core's
  switch loss, weighted per microbatch as mimo's executor sets it; the reported loss excludes it.
  Under CP with padded slices (uneven blocks), it and the step metrics equal the 1-rank run's.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
import yaml

from mimo.config import ConfigError, load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.topology import EXPERT_GROUP_DIMS, Layout
from mimo.training import Trainer
from mimo.training.parity import record_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2
MOE_LAYER = 1  # global index of the tiny model's MoE layer (layer 0 is dense)

# A tiny text-only MoE LLM: 8 experts, top-2, a gated shared expert, a dense first layer.
MOE = {
    "model": {
        "language": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                         max_sequence_length=64, add_bias_linear=False, normalization="RMSNorm",
                         activation="swiglu", num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                         moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                         moe_layer_freq=[0, 1], moe_token_dispatcher_type="alltoall"),
        "encoders": {},
    },
    "parallelism": {"language": {}},
    "data": {"seq_length": 32, "seed": 3},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": STEPS, "optimizer": "sgd", "lr": 0.1,
                 "seed": 7},
}


def moe(dispatcher="alltoall", **layout):
    raw = copy.deepcopy(MOE)
    raw["model"]["language"]["moe_token_dispatcher_type"] = dispatcher
    raw["parallelism"]["language"] = dict(layout)
    return raw


def errors(raw, world_size=None):
    try:
        load_config(raw, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []


# -- validation ------------------------------------------------------------------------------------

def _with_encoder(raw, **images_layout):
    raw["model"]["encoders"]["images"] = dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2,
                                              image_size=8, patch_size=4)
    raw["parallelism"]["images"] = images_layout
    return raw


def _lang(raw, **fields):
    raw["model"]["language"].update(fields)
    return raw


@pytest.mark.parametrize("raw,field,needle", [
    (_lang(moe(dp=4, ep=4), num_moe_experts=6), "parallelism.language.ep", "num_moe_experts (6)"),
    (moe(dp=2, ep=4), "parallelism.language.ep", "must divide tp * cp * dp"),
    (moe(tp=2, sp=True, etp=4), "parallelism.language.ep", "must divide tp * cp * dp"),
    (_with_encoder(moe(dp=2, ep=2), dp=2, ep=2), "parallelism.images.ep", "encoders have no experts"),
    (_with_encoder(moe(dp=2), dp=2, etp=2), "parallelism.images.etp", "encoders have no experts"),
    (moe(tp=2, ep=2), "parallelism.language.sp", "must be true for an MoE LLM with tp > 1"),
    (moe(tp=2), "parallelism.language.sp", "must be true for an MoE LLM with tp > 1"),
    (_lang(moe(dp=2, ep=2), num_moe_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
           moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False, moe_layer_freq=1),
     "parallelism.language.ep", "no experts"),
    (_lang(moe(dp=2, etp=2), moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False,
           add_bias_linear=True), "parallelism.language.etp", "add_bias_linear"),
    (_lang(moe(dp=2, etp=2), moe_ffn_hidden_size=15), "parallelism.language.etp", "FFN width (15)"),
    (_lang(moe(), moe_router_topk=9), "model.language.moe_router_topk", "<= num_moe_experts"),
    # (megatron-core refuses it at the model build, after the check said ok)
    (_lang(moe(), moe_router_topk=1), "model.language.moe_router_topk", "1 needs moe_router_pre_softmax: true"),
    (_lang(moe(), moe_layer_freq=[1, 2]), "model.language.moe_layer_freq", "0 (dense) or 1 (MoE)"),
    (_lang(moe(), moe_layer_freq=[1]), "model.language.moe_layer_freq", "one 0 (dense) or 1"),
    (_lang(moe(), moe_layer_freq="every"), "model.language.moe_layer_freq", "positive integer or a list"),
    (_lang(moe(), moe_token_dispatcher_type="flex"), "model.language.moe_token_dispatcher_type", "alltoall"),
    (_lang(moe(), add_bias_linear=True), "model.language.moe_shared_expert_intermediate_size", "add_bias_linear"),
    (_lang(moe(), moe_shared_expert_intermediate_size=0), "model.language.moe_shared_expert_gate",
     "needs a shared expert"),
    (_lang(moe(), moe_aux_loss_coeff=-0.1), "model.language.moe_aux_loss_coeff", ">= 0"),
    (_lang(moe(), num_moe_experts=None, moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False,
           moe_layer_freq=1, moe_router_topk=2, moe_ffn_hidden_size=None, moe_aux_loss_coeff=0.01),
     "model.language.moe_aux_loss_coeff", "only takes effect with model.language.num_moe_experts"),
])
def test_each_broken_rule_is_one_error_naming_the_field(raw, field, needle):
    probs = errors(raw)
    assert len(probs) == 1, probs
    assert probs[0][0] == field and needle in probs[0][1], probs


def test_an_aux_loss_with_cp_is_accepted_whether_or_not_the_blocks_deal_evenly():
    # Uneven slices are padded; the router is told which slots are padding (parity test below).
    assert errors(_lang(moe(cp=2), attention="bitfield", moe_aux_loss_coeff=0.01, cp_block_size=16)) == []
    assert errors(_lang(moe(cp=2), attention="bitfield", moe_aux_loss_coeff=0.01)) == []
    assert errors(_lang(moe(cp=2), attention="bitfield", moe_aux_loss_coeff=0.01, cp_policy="lpt_free")) == []


@pytest.mark.parametrize("layout,world", [(dict(dp=2, ep=2), 2), (dict(tp=2, sp=True, ep=2), 2),
                                          (dict(tp=2, sp=True), 2), (dict(tp=2, sp=True, dp=2, ep=4), 4),
                                          (dict(dp=2, pp=2, ep=2), 4), (dict(dp=2, etp=2), 2)])
def test_expert_parallelism_adds_no_ranks(layout, world):
    cfg = load_config(moe(**layout), world_size=world)
    assert cfg.world_size == world


def test_cli_exit_2_before_any_process_group(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_lang(moe(dp=4, ep=4), num_moe_experts=6)))
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["error: parallelism.language.ep: must divide "
                                             "model.language.num_moe_experts (6)"], r.stderr


def test_moe_layer_pattern():
    lang = load_config(moe()).model.language
    assert lang.moe_layers() == [False, True]
    lang = load_config(_lang(moe(), num_layers=4, moe_layer_freq=2)).model.language
    assert lang.moe_layers() == [True, False, True, False]


# -- the expert decomposition ----------------------------------------------------------------------

def test_expert_decomposition_re_divides_the_llm_ranks():
    # tp 2 x dp 2 x pp 2 = 8 ranks; experts: etp 1 x ep 4 x edp 1 per stage (EP over TP and DP).
    lay = Layout(tp=2, dp=2, pp=2, ep=4, etp=1, rank_offset=3)
    assert lay.size == 8 and lay.edp == 1 and list(lay.ranks) == list(range(3, 11))
    assert lay.expert_groups(["ep"]) == [[3, 4, 5, 6], [7, 8, 9, 10]]
    assert lay.expert_groups(["edp"]) == [[r] for r in range(3, 11)]
    assert lay.expert_coords(9) == dict(etp=0, ep=2, edp=0, pp=1)
    # tp 2 x dp 2, ep 2: in etp-ep-edp order (etp 1), ep takes the fastest ranks, the TP pair; edp spans DP.
    lay = Layout(tp=2, dp=2, ep=2)
    assert lay.expert_groups(["ep"]) == [[0, 1], [2, 3]]
    assert lay.expert_groups(["edp"]) == [[0, 2], [1, 3]]
    assert lay.expert_groups(["etp", "ep"]) == [[0, 1], [2, 3]]
    # Expert TP 2 out of DP 2 (tp 1): expert TP spans the DP pair.
    lay = Layout(dp=2, etp=2)
    assert lay.expert_groups(["etp"]) == [[0, 1]] and lay.expert_groups(["edp"]) == [[0], [1]]
    # Dense coordinates have no ep: the encoder boundary sees the dense grid only.
    assert Layout(tp=2, dp=2, ep=2).coords(3) == dict(tp=1, cp=0, dp=1, pp=0)
    for lay in (Layout(tp=2, dp=2, pp=2, ep=2, etp=2), Layout(tp=2, cp=2, dp=2, ep=4)):
        for dims in EXPERT_GROUP_DIMS.values():
            groups = lay.expert_groups(dims)
            assert sorted(r for g in groups for r in g) == list(lay.ranks)


# -- training parity -------------------------------------------------------------------------------

def _train(raw, steps, sabotage=None):
    import mimo.training.optimizer as optimizer
    import torch.distributed as dist

    if sabotage == "dense_expert_grads":
        optimizer.mark_expert_grads = lambda part, layout: None  # expert grads over the dense DP group only
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    g = trainer.topo.grid("language")
    if sabotage == "perturb_expert" and dist.get_rank() == 1:
        w = trainer.parts["language"].decoder.layers[MOE_LAYER].mlp.experts.local_experts[0].linear_fc1.weight
        with torch.no_grad():
            w.add_(1e-2)
    groups = {k: sorted(dist.get_process_group_ranks(g.groups[k])) for k in EXPERT_GROUP_DIMS} if g.is_member else {}
    run = record_run(trainer, steps)
    return dict(run, groups=groups, expert_optimizers=sorted(trainer.optim.expert_optimizers))


_REFERENCES = {}


def reference(dispatcher):
    if dispatcher not in _REFERENCES:
        _REFERENCES[dispatcher] = run_on_ranks(_train, 1, moe(dispatcher), STEPS)[0]
    return _REFERENCES[dispatcher]


def merged(results):
    out = {"losses": results[0]["losses"], "grads": {}, "params": {}}
    for r in results:
        assert r["losses"] == out["losses"]  # every rank reports the same loss
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
    return out


def assert_same_run(ref, got, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    assert got["grads"].keys() == ref["grads"].keys()
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=rtol, atol=atol, msg=lambda m: f"grad {k}: {m}")
    assert got["params"].keys() == ref["params"].keys()
    for k in ref["params"]:
        torch.testing.assert_close(got["params"][k], ref["params"][k], rtol=rtol, atol=atol, msg=lambda m: f"param {k}: {m}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("layout,groups", [
    # EP out of DP: each rank holds 4 of the 8 experts; expert DP is one rank.
    (dict(dp=2, ep=2), dict(ep=[0, 1], expt_tp=[], tp_ep=[0, 1], expt_dp=[], tp_ep_pp=[0, 1])),
    # EP carved out of TP (sequence parallel): the TP pair holds 4 experts each.
    (dict(tp=2, sp=True, ep=2), dict(ep=[0, 1], expt_tp=[], tp_ep=[0, 1], expt_dp=[], tp_ep_pp=[0, 1])),
], ids=["dp2ep2", "tp2sp_ep2"])
def test_expert_parallel_training_equals_single_rank(dispatcher, layout, groups):
    results = run_on_ranks(_train, 2, moe(dispatcher, **layout), STEPS)
    ref = reference(dispatcher)
    assert_same_run(ref, merged(results))
    experts = [k for k in ref["grads"] if ".local_experts." in k]
    assert len(experts) == 8 * 2  # every expert (fc1, fc2) by global index, gathered from both EP ranks
    assert all(not any(".local_experts." in k for k in r["grads"]) or
               len([k for k in r["grads"] if ".local_experts." in k]) == 8 for r in results)
    for rank, r in enumerate(results):
        want = {k: (v if v else [rank]) for k, v in groups.items()}
        assert r["groups"] == want, (rank, r["groups"])
        assert r["expert_optimizers"] == ["language"]  # expert weights stepped by their own optimizer


def test_tp2_sp_at_ep1_reduces_expert_grads_over_expert_dp():
    # etp 1 < tp 2: each TP rank holds every expert whole, fed by its sequence shard only; the expert
    # gradients must sum over expert DP (= the TP pair), not the dense DP group (one rank here).
    results = run_on_ranks(_train, 2, moe(tp=2, sp=True), STEPS)
    assert results[0]["groups"]["expt_dp"] == [0, 1] and results[0]["groups"]["ep"] == [0]
    assert_same_run(reference("alltoall"), merged(results))


def test_negative_controls_fail_the_parity_check():
    ref = reference("alltoall")
    wrong_group = run_on_ranks(_train, 2, moe(tp=2, sp=True), STEPS, "dense_expert_grads")
    with pytest.raises(AssertionError, match="local_experts"):
        assert_same_run(ref, merged(wrong_group))
    perturbed = run_on_ranks(_train, 2, moe(dp=2, ep=2), STEPS, "perturb_expert")
    with pytest.raises(AssertionError):
        assert_same_run(ref, merged(perturbed))


def _biased(**layout):
    """The tiny MoE LLM with biases in every linear layer (megatron-core's default); no shared expert,
    which needs `add_bias_linear: false`."""
    raw = _lang(moe(**layout), add_bias_linear=True, moe_shared_expert_gate=False)
    del raw["model"]["language"]["moe_shared_expert_intermediate_size"]
    return raw


_BIASED = []


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, ep=2), dict(tp=2, sp=True), dict(tp=2, sp=True, ep=2)],
                         ids=["dp2ep1", "dp2ep2", "tp2sp_ep1", "tp2sp_ep2"])
def test_experts_with_biases_equal_single_rank(layout):
    # With one expert-TP rank and EP 1, megatron-core 0.16.1's expert fc2 hands its output out of an
    # autograd Function that returns its input as is, and the expert adds its bias to it in place:
    # the 1-rank run and the ep1 layouts stopped at the first forward (mimo.model.expert_linear).
    if not _BIASED:
        _BIASED.append(run_on_ranks(_train, 1, _biased(), STEPS)[0])
    ref = _BIASED[0]
    assert len([k for k in ref["grads"] if ".local_experts." in k and k.endswith(".bias")]) == 8 * 2
    assert_same_run(ref, merged(run_on_ranks(_train, 2, _biased(**layout), STEPS)))


# -- the aux load-balancing loss -------------------------------------------------------------------

def _train_capturing_router(raw):
    """One step; the router's inputs per microbatch, its weight before the step, megatron's aux-loss tracker."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    router = trainer.parts["language"].decoder.layers[MOE_LAYER].mlp.router
    weight = router.weight.detach().clone()
    inputs = []
    router.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach().clone()))
    run = record_run(trainer, 1)
    tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    return dict(run, inputs=inputs, weight=weight,
                tracked=None if tracker is None else tracker["values"].clone())


def _hand_aux(x, weight, experts, topk, coeff):
    """megatron-core's switch load-balancing loss of one microbatch at one rank, by hand:
    coeff * E / (k T^2) * sum_i (sum_t p_ti) * (tokens routed to i), p = softmax of the router logits."""
    x = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(x @ weight.t(), dim=-1, dtype=torch.float32)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1).sum(0)
    T = x.shape[0]
    return (scores.sum(0) * counts).sum() * experts * coeff / (topk * T * T)


def test_aux_loss_gradient_matches_a_hand_computation():
    coeff = 0.05
    off = run_on_ranks(_train_capturing_router, 1, moe())[0]
    on = run_on_ranks(_train_capturing_router, 1, _lang(moe(), moe_aux_loss_coeff=coeff))[0]
    assert on["losses"] == off["losses"]  # the reported loss is the language loss alone
    key = f"language.decoder.layers.{MOE_LAYER}.mlp.router.weight"
    delta = on["grads"][key] - off["grads"][key]
    assert delta.abs().max() > 1e-4  # the aux loss reaches the router's gradient
    tr = MOE["training"]
    weight = tr["micro_batch_size"] / tr["global_batch_size"]  # each microbatch's weight (step_work)
    w = on["weight"].clone().requires_grad_()
    assert len(on["inputs"]) == tr["global_batch_size"] // tr["micro_batch_size"]
    auxes = [_hand_aux(x, w, 8, 2, coeff) for x in on["inputs"]]
    (grad,) = torch.autograd.grad(sum(a * weight for a in auxes), w)
    torch.testing.assert_close(delta, grad, rtol=1e-4, atol=1e-8)
    # megatron's tracker logs each microbatch's loss over the coefficient: the same values.
    torch.testing.assert_close(on["tracked"][MOE_LAYER], sum(a.detach() for a in auxes) / coeff, rtol=1e-5, atol=0)
    assert off["tracked"] is None  # coefficient 0: no aux loss at all


# -- behind an encoder boundary ----------------------------------------------------------------------

def _multimodal(language, images):
    raw = _with_encoder(moe(), **images)
    raw["parallelism"]["language"] = language
    return raw


def test_plan_checker_meets_expert_parallel_peers():
    """An MoE layer's all-to-all ties EP peers (here the LLM's DP replicas) inside every forward and
    backward: the plan checker meets them there, and the plan passes."""
    from mimo.schedule.check import check_plan
    from mimo.schedule.collectives import meets
    from mimo.schedule.plan import FORWARD, build_plan

    for raw, llm_ranks in ((moe(dp=2, ep=2), [0, 1]), (_multimodal(dict(dp=2, ep=2), dict(rank_offset=2)), [0, 1]),
                           (moe(dp=2), None)):
        plan = build_plan(load_config(raw))
        check_plan(plan)
        fwd = [a for a in plan.actions[0] if a.op == FORWARD and a.module == "language"]
        got = [m.ranks for a in fwd for m in meets(plan, a)]
        assert got == ([tuple(llm_ranks)] * len(fwd) if llm_ranks else []), got


def test_non_colocated_encoder_feeding_an_ep2_llm_equals_single_rank(dispatcher="alltoall"):
    # The encoder on its own rank feeds the LLM's dense grid (DP2); EP2 re-divides the LLM's 2 ranks.
    ref_raw, raw = _multimodal({}, {}), _multimodal(dict(dp=2, ep=2), dict(rank_offset=2))
    for r in (ref_raw, raw):
        r["model"]["language"]["moe_token_dispatcher_type"] = dispatcher
    ref = run_on_ranks(_train, 1, ref_raw, STEPS)[0]
    got = merged(run_on_ranks(_train, 3, raw, STEPS))
    assert_same_run(ref, got)


def test_reference_init_cuts_experts_by_global_index():
    # training.init reference: each rank slices its experts out of the whole module built on one rank.
    def ref_init(raw):
        raw["training"]["init"] = "reference"
        return raw

    ref = run_on_ranks(_train, 1, ref_init(moe()), STEPS)[0]
    assert_same_run(ref, merged(run_on_ranks(_train, 2, ref_init(moe(dp=2, ep=2)), STEPS)))


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [(dict(pp=2, dp=2, ep=2), 4),
                                          (dict(tp=2, sp=True, ep=2, recompute="full"), 2)],
                         ids=["pp2dp2ep2", "tp2sp_ep2_recompute_full"])
def test_more_expert_parallel_layouts_equal_single_rank(layout, world):
    assert_same_run(reference("alltoall"), merged(run_on_ranks(_train, world, moe(**layout), STEPS)))


@pytest.mark.parametrize("layout,world", [(dict(cp=2, ep=2), 2), (dict(cp=2, dp=2, ep=2), 4)],
                         ids=["cp2ep2", "cp2dp2ep2"])
def test_context_parallel_moe_equals_single_rank(layout, world):
    # EP carved out of CP (and DP): each CP rank routes its own query blocks' tokens; expert DP is
    # 1 at cp2ep2 and 2 at cp2dp2ep2. Context parallelism needs the bitfield attention.
    ref = run_on_ranks(_train, 1, _lang(moe(), attention="bitfield"), STEPS)[0]
    assert_same_run(ref, merged(run_on_ranks(_train, world, _lang(moe(**layout), attention="bitfield"), STEPS)))


@pytest.mark.parametrize("layout,world,blocks", [
    # 128-token blocks (the default): the 32-token sequence is one block, so one CP rank holds only padding.
    (dict(cp=2, ep=2), 2, {}),
    # 40 tokens in five 8-token blocks: one rank holds 3 blocks, the other 2 and 8 padding slots.
    (dict(cp=2, ep=2), 2, dict(cp_block_size=8)),
    # The padding mask sharded over TP with the layer inputs (SP); blocks dealt without a cap.
    (dict(tp=2, sp=True, cp=2, ep=2), 4, dict(cp_block_size=8, cp_policy="lpt_free")),
    # The MoE layer on the second pipeline stage, which gets the mask without the embedding.
    (dict(pp=2, cp=2, ep=2), 4, dict(cp_block_size=8)),
], ids=["cp2ep2_one_block", "cp2ep2_uneven", "tp2sp_cp2ep2_uneven", "pp2cp2ep2_uneven"])
def test_cp_padding_is_left_out_of_the_aux_loss(layout, world, blocks):
    """CP pads its ranks' slices to one length where the blocks do not deal evenly; the router is told
    which slots are padding, so the load-balancing loss and its gradient (and the reported aux loss and
    expert load) equal the 1-rank run's. Without the mask every case fails (the gradients differ)."""
    coeff = dict(attention="bitfield", moe_aux_loss_coeff=0.1, **blocks)

    def run(raw, world):
        if blocks:
            raw["data"]["seq_length"] = 40
        return run_on_ranks(_train, world, _lang(raw, **coeff), STEPS)
    ref = run(moe(), 1)[0]
    results = run(moe(**layout), world)
    assert_same_run(ref, merged(results))
    for r in results:
        for got, want in zip(r["moe"], ref["moe"]):
            assert got["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=1e-5)
            assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-9)


def test_cp_padding_is_left_out_of_the_aux_loss_behind_a_non_colocated_encoder():
    """The multimodal first stage (the fused sequence cut into CP slots after the merge) tells the
    router its padding slots too: LLM CP2·EP2 on ranks 0-1, the vision encoder on rank 2."""
    def run(raw, world):
        raw["data"]["seq_length"] = 40  # five 8-token blocks: one CP rank padded
        return run_on_ranks(_train, world, _lang(raw, attention="bitfield", moe_aux_loss_coeff=0.1, cp_block_size=8),
                            STEPS)
    ref = run(_multimodal({}, {}), 1)[0]
    results = run(_multimodal(dict(cp=2, ep=2), dict(rank_offset=2)), 3)
    assert_same_run(ref, merged(results))
    for got, want in zip(results[0]["moe"], ref["moe"]):
        assert got["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=1e-5)
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-9)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_tp_with_ep_equals_single_rank(dispatcher):
    # Expert TP 2 x EP 2 over TP2+SP x DP2: each expert's fc1/fc2 cut over an expert-TP pair, 4 experts
    # per EP rank. The all-to-all dispatcher then gathers a different token count from each expert-TP
    # rank (uneven gathers, which gloo runs through mimo.runtime.megatron_cpu, adaptation 9).
    results = run_on_ranks(_train, 4, moe(dispatcher, tp=2, sp=True, dp=2, ep=2, etp=2), STEPS)
    assert_same_run(reference(dispatcher), merged(results))
    assert results[0]["groups"]["expt_tp"] == [0, 1] and results[0]["groups"]["ep"] == [0, 2]
