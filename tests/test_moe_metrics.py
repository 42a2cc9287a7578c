"""An MoE LLM's step metrics `moe_aux_loss` and `expert_load_max_over_mean` (README "Watching a run",
docs/moe.md), checked against a hand computation from the router's inputs and routes captured in
the test, at 1 rank, DP2·EP2 and TP2+SP+EP2 (TP partial losses summed, as megatron does); reset
every step; absent for a dense LLM, null aux loss without a coefficient. With the aux loss on, a
skewed toy run's expert load imbalance decreases (the figures docs/moe.md quotes).
"""

import copy
import io
import json
import os

import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import Trainer
from test_moe import MOE_LAYER, _hand_aux, _lang, moe

COEFF = 0.05
EXPERTS, TOPK = 8, 2


def _logged(raw, steps, path, skew=0.0):
    """Train `steps` steps through the trainer's StepReporter (`--log-json path`): rank 0's rows and step
    lines; every rank's router calls (step, input, routing map) and the router weight of each step."""
    import torch.distributed as dist

    from mimo.training.metrics import StepReporter

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    part = trainer.parts["language"]
    router = part.decoder.layers[MOE_LAYER].mlp.router
    if skew:  # every token's hidden state gets a large component 0, which the router sends to experts 0, 1
        with torch.no_grad():
            part.embedding.word_embeddings.weight[:, 0] += 0.1  # about the size of the other components
            router.weight[:2, 0] += skew
    calls, now = [], [0]

    def capture(module, args, out):
        if torch.is_grad_enabled():
            calls.append((now[0], args[0].detach().clone(), out[1].detach().clone()))
    router.register_forward_hook(capture)
    stream = io.StringIO()
    reporter = StepReporter(cfg, trainer, trainer.runtime, log_json=path, stream=stream)
    weights = []
    for s in range(steps):
        now[0] = s
        weights.append(router.weight.detach().clone())
        reporter.before_step(s)
        reporter.after_step(s, trainer.train_step(s))
    reporter.close()
    rank0 = dist.get_rank() == 0
    return dict(rows=[json.loads(line) for line in open(path)] if rank0 else None,
                lines=stream.getvalue() if rank0 else None, calls=calls, weights=weights)


def _hand(results, steps, tp=1):
    """Per step: (aux loss, max/mean expert load) by hand from every rank's captured router calls.
    Under TP the ranks of a TP group route the shards of the same microbatches: joined first."""
    out = []
    for s in range(steps):
        per_rank = [[(x, m) for step, x, m in r["calls"] if step == s] for r in results]
        if tp > 1:  # ranks 0..tp-1 are one TP group: call i of each is one microbatch's shard
            per_rank = [[(torch.cat([c[0] for c in group]), torch.cat([c[1] for c in group]))
                         for group in zip(*per_rank)]]
        mbs = [c for r in per_rank for c in r]
        w = results[0]["weights"][s]
        aux = sum(float(_hand_aux(x, w, EXPERTS, TOPK, COEFF)) for x, _ in mbs) / COEFF / len(mbs)
        load = sum(m.sum(0).double() for _, m in mbs)
        out.append((aux, float(load.max() / load.mean())))
    return out


def _check(results, steps, tp=1):
    rows = results[0]["rows"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row, (aux, load) in zip(rows, _hand(results, steps, tp)):
        assert abs(row["moe_aux_loss"] - aux) <= 1e-5 * aux, (row["moe_aux_loss"], aux)
        assert row["expert_load_max_over_mean"] == load
    assert "moe_aux_loss" in results[0]["lines"] and "expert_load_max/mean" in results[0]["lines"]
    return rows


def test_metrics_equal_a_hand_computation_and_reset_every_step(tmp_path):
    steps = 2
    raw = _lang(moe(), moe_aux_loss_coeff=COEFF)
    one = run_on_ranks(_logged, 1, raw, steps, str(tmp_path / "one.jsonl"))
    rows = _check(one, steps)
    # Reset per step: the second step's value is its own, not the sum of the two steps' (negative control).
    hand = _hand(one, steps)
    assert abs(rows[1]["moe_aux_loss"] - (hand[0][0] + hand[1][0])) > 0.5 * hand[1][0]
    ep = run_on_ranks(_logged, 2, _lang(moe(dp=2, ep=2), moe_aux_loss_coeff=COEFF), steps,
                      str(tmp_path / "ep.jsonl"))
    ep_rows = _check(ep, steps)
    tp = run_on_ranks(_logged, 2, _lang(moe(tp=2, sp=True, ep=2), moe_aux_loss_coeff=COEFF), steps,
                      str(tmp_path / "tp.jsonl"))
    tp_rows = _check(tp, steps, tp=2)
    for got in (ep_rows, tp_rows):  # the same step at any layout
        for a, b in zip(got, rows):
            assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-4 * b["moe_aux_loss"]
    # Without a coefficient megatron computes no aux loss: null; the load is still measured.
    off = run_on_ranks(_logged, 1, moe(), 1, str(tmp_path / "off.jsonl"))[0]["rows"][0]
    assert off["moe_aux_loss"] is None and off["expert_load_max_over_mean"] >= 1.0


def test_dense_rows_have_no_moe_keys(tmp_path):
    raw = copy.deepcopy(moe())
    lang = raw["model"]["language"]
    for k in [k for k in lang if k.startswith("moe_") or k == "num_moe_experts"]:
        del lang[k]
    lang["ffn_hidden_size"] = 64
    row = run_on_ranks(_logged_dense, 1, raw, str(tmp_path / "dense.jsonl"))[0]
    assert "moe_aux_loss" not in row and "expert_load_max_over_mean" not in row


def _logged_dense(raw, path):
    from mimo.training.metrics import StepReporter

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    reporter = StepReporter(cfg, trainer, trainer.runtime, log_json=path, stream=io.StringIO())
    rec = reporter.after_step(0, trainer.train_step(0))
    reporter.close()
    return rec


SKEW_STEPS, SKEW, LR, ON = 10, 0.1, 0.1, 0.1


def skewed_run(coeff, tmp):
    """Per step (expert_load_max_over_mean, moe_aux_loss) of a 1-rank run whose routes start skewed to
    experts 0, 1."""
    raw = _lang(moe(), moe_aux_loss_coeff=coeff)
    raw["training"].update(train_iters=SKEW_STEPS, lr=LR)
    rows = run_on_ranks(_logged, 1, raw, SKEW_STEPS, os.path.join(tmp, f"skew{coeff}.jsonl"), SKEW)[0]["rows"]
    return [r["expert_load_max_over_mean"] for r in rows], [r["moe_aux_loss"] for r in rows]


def test_aux_loss_decreases_expert_load_imbalance_on_a_skewed_run(tmp_path):
    (off, _), (on, aux) = skewed_run(0.0, str(tmp_path)), skewed_run(ON, str(tmp_path))
    print("imbalance, aux off:", [round(v, 2) for v in off])
    print("imbalance, aux on: ", [round(v, 2) for v in on])
    print("moe_aux_loss, on:  ", [round(v, 3) for v in aux])
    assert off[0] == on[0] == 4.0  # the same skewed start: every token goes to experts 0 and 1
    assert on[-1] < 0.5 * on[0] and on[-1] < 0.5 * off[-1]
    assert aux[-1] < aux[0]  # the loss it minimises went down too
