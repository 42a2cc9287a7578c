"""Checkpoints of an MoE LLM store experts by global index (docs/checkpoints.md, docs/moe.md).

One uninterrupted Adam run at DP2·EP2 (2 ranks, 4 steps) saves at steps 2 and 4. Resumed from step 2
at EP1 (1 rank) and at TP2+SP+EP2 (2 ranks):
* the weights each layout loads equal the checkpoint's full tensors exactly, by global name (the
  same tensors at EP1 and EP2), and the full tensors of step 4 equal the saving run's own weights;
* the continued losses and final weights equal the uninterrupted run's within 1e-4 (Adam's moments
  and step of the expert optimizer come back too);
* `convert` writes every expert by global index, `inspect` lists them.
Negative control: loading with the two EP ranks' expert offsets swapped fails the exact comparison.
"""

import copy
import io
import os
from contextlib import redirect_stdout

import torch

from mimo.checkpoint import paths
from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.parity import max_rel_diff
from test_moe import moe
from tiny import PARITY_ADAM_EPS

EXPERTS = 8


def _raw(save=None, load=None, **layout):
    raw = moe("alltoall", **layout)
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=4, adam_eps=PARITY_ADAM_EPS)
    if save:
        raw["training"].update(save=save, save_interval=2)
    if load:
        raw["training"].update(load=load)
    return raw


def _full(trainer):
    from mimo.training.parity import expert_shards
    from mimo.training.state import full_state

    tp_groups = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    return full_state(trainer.parts, tp_groups, layer_offsets=trainer.layer_offsets, experts=expert_shards(trainer))


def _run(raw, swap_experts=False, tools=None):
    """Resume (if `training.load`) and train to the end: {start, loaded (full state after the resume),
    losses, params}; with `tools` (a checkpoint, one rank) also what `convert` and `inspect` give."""
    import torch.distributed as dist

    from mimo.checkpoint import checkpointer, shards
    from mimo.training import Trainer

    if swap_experts:  # each EP rank reads the other's experts: a wrong global offset
        real = shards.expert_shard

        def swapped(lang, grid):
            ex = real(lang, grid)
            return type(ex)(offset=EXPERTS // 2 - ex.offset, tp_rank=ex.tp_rank, tp_size=ex.tp_size,
                            tp_group=ex.tp_group)
        shards.expert_shard = swapped
    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    ckpt = checkpointer(cfg, trainer, None)
    start = ckpt.resume()
    loaded = _full(trainer)
    losses = []
    for step in range(start, cfg.training.train_iters):
        losses.append(trainer.train_step(step).loss)
        ckpt.after_step(step)
    ckpt.finish()
    out = {"start": start, "loaded": loaded, "losses": losses, "params": _full(trainer)}
    if tools is not None:
        from mimo.checkpoint.__main__ import main

        text = io.StringIO()
        with redirect_stdout(text):
            assert main(["inspect", tools]) == 0
            assert main(["convert", tools, "--to-torch", tools + ".pt"]) == 0
        out["inspect"] = text.getvalue()
        out["converted"] = {f"{m}.{k}": v for m, ts in torch.load(tools + ".pt").items() for k, v in ts.items()}
    dist.barrier()
    return out


def _merged(results):
    out = dict(results[0], loaded={}, params={})
    for r in results:
        assert r["losses"] == out["losses"]
        out["loaded"].update(r["loaded"])
        out["params"].update(r["params"])
    return out


def _equal(a, b, keys):
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_experts_by_global_index_resume_at_other_expert_layouts(tmp_path):
    src = str(tmp_path / "ep2")
    base = _merged(run_on_ranks(_run, 2, _raw(save=src, dp=2, ep=2), daemon=False))
    step2 = paths.iter_dir(src, 2)

    ep1 = _merged(run_on_ranks(_run, 1, _raw(load=step2), False, step2, daemon=False))
    full = ep1["converted"]  # the checkpoint's full tensors at step 2
    expert_keys = sorted(k for k in full if ".local_experts." in k)
    assert len(expert_keys) == 2 * EXPERTS  # fc1 and fc2 of experts 0..7, by global index
    assert {k.split(".local_experts.")[1].split(".")[0] for k in expert_keys} == {str(e) for e in range(EXPERTS)}
    keys = sorted(set(full) & set(ep1["loaded"]))
    assert set(expert_keys) <= set(keys)
    assert _equal(ep1["loaded"], full, keys)  # EP1 loads exactly the saved tensors
    assert not _equal(base["params"], full, expert_keys)  # trained on after the save: not the step-4 weights
    assert "experts: 8 (saved at ep=2, etp=1)" in ep1["inspect"]
    assert "language.decoder.layers.1.mlp.experts.local_experts.<0-7>.linear_fc1.weight" in ep1["inspect"]

    tp2 = _merged(run_on_ranks(_run, 2, _raw(load=step2, tp=2, sp=True, ep=2), daemon=False))
    assert _equal(tp2["loaded"], full, keys)  # EP2 (out of TP) loads the same tensors
    for got in (ep1, tp2):
        assert got["start"] == 2
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"][2:]), rtol=1e-4, atol=0)
        assert max_rel_diff(got["params"], base["params"]) <= 1e-4

    # The step-4 checkpoint holds exactly the saving run's weights (gathered at EP2).
    last = _merged(run_on_ranks(_run, 1, _raw(load=paths.iter_dir(src, 4)), daemon=False))
    assert _equal(last["loaded"], base["params"], keys)

    # Negative control: experts read under a wrong global offset are not the saved ones.
    bad = _merged(run_on_ranks(_run, 2, _raw(load=step2, dp=2, ep=2), True, daemon=False))
    assert not _equal(bad["loaded"], full, expert_keys)


def test_experts_cut_over_expert_tp_and_ep_resume_whole_on_one_rank(tmp_path):
    """Saved at TP2+SP x DP2 with EP2 and expert TP2 (each expert's fc1/fc2 cut over 2 ranks, 4 experts
    per EP rank; the gated fc1 strided), resumed at EP1 on one rank: the loaded experts are the
    checkpoint's full tensors, and the run continues as the saving run did."""
    src = str(tmp_path / "etp2")
    base = _merged(run_on_ranks(_run, 4, _raw(save=src, tp=2, sp=True, dp=2, ep=2, etp=2), daemon=False))
    step2 = paths.iter_dir(src, 2)
    one = _merged(run_on_ranks(_run, 1, _raw(load=step2), False, step2, daemon=False))
    full = one["converted"]
    expert_keys = sorted(k for k in full if ".local_experts." in k)
    assert len(expert_keys) == 2 * EXPERTS
    assert _equal(one["loaded"], full, sorted(set(full) & set(one["loaded"])))
    assert "experts: 8 (saved at ep=2, etp=2)" in one["inspect"]
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(base["losses"][2:]), rtol=1e-4, atol=0)
    assert max_rel_diff(one["params"], base["params"]) <= 1e-4
