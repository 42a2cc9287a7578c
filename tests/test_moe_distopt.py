"""The distributed optimizer with an expert-parallel MoE LLM (docs/moe.md).

Routed experts split over EP have their own gradient buffers, reduced over expert DP; with
`training.use_distributed_optimizer` their Adam state and fp32 step are sharded over expert DP,
the dense weights' over DP x CP. At DP4·EP2 (expert DP 2) with clipping on every step:
* the run equals the same layout without the distributed optimizer (losses, grad norms and first-step
  gradients within 1e-6, weights 1e-5) and the 1-rank run (losses and norms 1e-5, weights 5e-5);
  the expert optimizer is megatron-core's DistributedOptimizer;
* a checkpoint saved with it holds the same optimizer state as one saved without it (every expert's
  moments gathered from its expert-DP owners, by global index), and resumes at EP1 on one rank and
  at DP2·EP2 to the uninterrupted run's losses and weights.
Negative control: skipping the experts' parameter all-gather (each expert-DP rank keeps only its own
shard's update) breaks the equality.
"""

import os

import pytest
import torch

from mimo.checkpoint import paths
from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.parity import max_rel_diff
from test_moe import STEPS, merged, moe
from tiny import PARITY_ADAM_EPS


def _raw(dist_opt, save=None, load=None, steps=STEPS, **layout):
    raw = moe("alltoall", **layout)
    raw["training"].update(optimizer="adam", lr=0.01, clip_grad=0.05, train_iters=steps,
                           use_distributed_optimizer=dist_opt, adam_eps=PARITY_ADAM_EPS)
    if save:
        raw["training"].update(save=save, save_interval=2)
    if load:
        raw["training"].update(load=load)
    return raw


def _run(raw, sabotage=False):
    """Resume (if `training.load`) and train to the end: losses, grad norms, first-step gradients,
    final weights, and the kind of each module's expert optimizer."""
    from megatron.core.distributed import DistributedDataParallel

    from mimo.checkpoint import checkpointer
    from mimo.training import Trainer
    from mimo.training.parity import expert_shards, step_grads
    from mimo.training.state import full_state

    if sabotage:
        sync = DistributedDataParallel.start_param_sync

        def dense_only(self, *args, **kwargs):  # the experts' updated shards are never all-gathered
            experts, self.expert_parallel_bucket_groups = self.expert_parallel_bucket_groups, []
            try:
                sync(self, *args, **kwargs)
            finally:
                self.expert_parallel_bucket_groups = experts
        DistributedDataParallel.start_param_sync = dense_only
    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    ckpt = checkpointer(cfg, trainer, None)
    start = ckpt.resume() if ckpt else 0  # None: neither save nor load
    losses, norms, grads = [], [], {}
    for step in range(start, cfg.training.train_iters):
        result = trainer.train_step(step)
        losses.append(result.loss)
        norms.append(float(result.grad_norm))
        if step == start:
            grads = step_grads(trainer)
        if ckpt:
            ckpt.after_step(step)
    if ckpt:
        ckpt.finish()
    tp_groups = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    params = full_state(trainer.parts, tp_groups, layer_offsets=trainer.layer_offsets, experts=expert_shards(trainer))
    kinds = {n: type(o).__name__ for n, o in trainer.optim.expert_optimizers.items()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "kinds": kinds}


def _merged(results):
    out = merged(results)
    assert all(r["norms"] == results[0]["norms"] for r in results)
    return dict(out, norms=results[0]["norms"], kinds=results[0]["kinds"])


def _optimizer_state(ckpt):
    """The full optimizer-state tensors of a checkpoint (one rank), by key."""
    from megatron.core import dist_checkpointing

    plain = dist_checkpointing.load_plain_tensors(ckpt)
    return {k: v for k, v in plain.items() if k.startswith("optimizer.") and torch.is_tensor(v)}


def _close(got, ref, rtol):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_distributed_optimizer_shards_experts_over_expert_dp(tmp_path):
    layout = dict(dp=4, ep=2)  # 4 experts per rank, each held by 2 expert-DP ranks
    one = _merged(run_on_ranks(_run, 1, _raw(False, steps=4)))
    plain = _merged(run_on_ranks(_run, 4, _raw(False, save=str(tmp_path / "plain"), steps=4, **layout), daemon=False))
    got = _merged(run_on_ranks(_run, 4, _raw(True, save=str(tmp_path / "dist"), steps=4, **layout), daemon=False))
    assert got["kinds"] == {"language": "DistributedOptimizer"}
    assert all(n > 0.05 for n in one["norms"])  # every step clips: a wrong norm moves the weights
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(one["norms"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert max_rel_diff(got["params"], one["params"]) <= 5e-5  # DP summation-order rounding: measured 2.9e-6
    # Against the same layout without the distributed optimizer: the same run.
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(plain["norms"]), rtol=1e-6, atol=0)
    assert got["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    _close(got["grads"], plain["grads"], 1e-6)
    # Reduce-scatter sums in another order than all-reduce; over 4 Adam steps that moves a weight by
    # 1.1e-7 of the largest (measured); a missing expert gather moves it by 2e-2.
    assert max_rel_diff(got["params"], plain["params"]) <= 1e-5
    experts = [k for k in got["params"] if ".local_experts." in k]
    assert len(experts) == 2 * 8

    # The saved optimizer state equals the plain run's, every expert's moments included.
    step2 = {name: paths.iter_dir(str(tmp_path / name), 2) for name in ("plain", "dist")}
    dist_state, plain_state = (run_on_ranks(_optimizer_state, 1, step2[n])[0] for n in ("dist", "plain"))
    assert any(".local_experts.7." in k and k.endswith("exp_avg_sq") for k in dist_state)
    _close(dist_state, plain_state, 1e-6)

    # Resumed from step 2 at EP1 (one rank, no sharding) and at DP2·EP2 with it: the saving run.
    for world, raw in ((1, _raw(False, load=step2["dist"], steps=4)),
                       (2, _raw(True, load=step2["dist"], steps=4, dp=2, ep=2))):
        resumed = _merged(run_on_ranks(_run, world, raw, daemon=False))
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(got["losses"][2:]), rtol=1e-5, atol=0)
        assert max_rel_diff(resumed["params"], got["params"]) <= 1e-5  # measured 1.9e-7


def test_missing_expert_param_gather_breaks_the_parity():
    layout = dict(dp=4, ep=2)
    plain = _merged(run_on_ranks(_run, 4, _raw(False, **layout)))
    bad = _merged(run_on_ranks(_run, 4, _raw(True, **layout), True))
    assert max_rel_diff(bad["params"], plain["params"]) > 1e-3
