"""megatron-core optimizer stack: LR schedule values, the distributed optimizer vs one rank (FP32),
bf16 with fp32 master weights vs FP32, and frozen modules without optimizer or gradient buffer."""

import math

import pytest
import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import Trainer
from mimo.training.optimizer import lr_scheduler
from mimo.training.parity import max_rel_diff, record_run
from tiny import PARITY_ADAM_EPS, tiny

STEPS = 3


# -- learning-rate schedule (no processes) ------------------------------------------------------

class _Groups:
    """The one thing the schedule touches: param groups (here one, without params)."""

    def __init__(self):
        self.param_groups = [{"params": []}]


def _lrs(steps, **training):
    raw = tiny()
    raw["training"].update(lr=1.0, train_iters=10, **training)
    tr = load_config(raw).training
    opt = _Groups()
    sched = lr_scheduler(opt, tr)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        assert sched.get_lr({}) == out[-1]  # what the metrics report is what the optimizer uses
        sched.step(increment=1)
    return out


def test_constant_schedule_is_the_configured_lr():
    assert _lrs(12) == [1.0] * 12


def test_warmup_then_linear_decay_to_min_lr():
    got = _lrs(12, lr_warmup_iters=2, lr_decay_style="linear", min_lr=0.1)
    # Warmup from 0 over 2 steps, then lr - (lr - min_lr) * (s - 2) / (10 - 2); min_lr from step 10 on.
    want = [0.0, 0.5, 1.0] + [0.1 + 0.9 * (1 - (s - 2) / 8) for s in range(3, 11)] + [0.1]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_cosine_decay_to_min_lr():
    got = _lrs(11, lr_decay_style="cosine", min_lr=0.1)
    want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(11)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert got[5] == pytest.approx(0.55) and got[10] == pytest.approx(0.1)


# -- training runs --------------------------------------------------------------------------------

def _run(raw, steps, sabotage=None):
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    if sabotage == "no_param_gather":
        from megatron.core.distributed import DistributedDataParallel

        # Each DP rank then keeps only the update of its own shard of the parameters.
        DistributedDataParallel.start_param_sync = lambda self, *a, **k: None
    run = record_run(trainer, steps)
    masters = {}
    for name, opt in trainer.optimizers.items():
        masters[name] = sorted({str(p.dtype) for p in opt.get_parameters()})
    params = {f"{n}.{k}": str(p.dtype) for n, m in trainer.parts.items() for k, p in m.named_parameters()}
    buffers = {f"{n}.{k}" for n, m in trainer.parts.items() for k, p in m.named_parameters() if hasattr(p, "main_grad")}
    # gradient buffer dtype of the bf16 weights
    grad_dtypes = sorted({str(p.main_grad.dtype) for m in trainer.parts.values() for p in m.parameters()
                          if hasattr(p, "main_grad") and p.dtype != torch.float32})
    return dict(run, modules=sorted(trainer.optimizers), ddp=sorted(trainer.optim.ddp), masters=masters,
                param_dtypes=params, buffers=buffers, grad_dtypes=grad_dtypes,
                kinds={n: type(o).__name__ for n, o in trainer.optimizers.items()},
                overlap={n: (d.ddp_config.overlap_grad_reduce,
                             # filled after the first step once the DDP hooks counted every gradient
                             all(g.golden_per_param_grad_ready_counts for g in d.bucket_groups))
                         for n, d in trainer.optim.ddp.items()})


def _adam(layout=None, **training):
    """Adam at lr 0.01 with PARITY_ADAM_EPS (tiny.py says why)."""
    raw = tiny(**(layout or {}))
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=STEPS, adam_eps=PARITY_ADAM_EPS)
    raw["training"].update(training)
    return raw


@pytest.fixture(scope="module")
def adam_reference():
    return run_on_ranks(_run, 1, _adam(), STEPS)[0]


def test_distributed_optimizer_equals_single_rank(adam_reference):
    results = run_on_ranks(_run, 2, _adam(dict(dp=2), use_distributed_optimizer=True), STEPS)
    plain = run_on_ranks(_run, 2, _adam(dict(dp=2)), STEPS)[0]
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(adam_reference["losses"]),
                                   rtol=1e-5, atol=0)
        # Against the same DP2 layout without it, sharding the optimizer changes nothing.
        assert max_rel_diff(got["params"], plain["params"]) <= 1e-6
        # Against 1 rank: only the DP summation order's rounding (measured 5.4e-6 with `_adam`'s eps).
        assert max_rel_diff(got["params"], adam_reference["params"]) <= 5e-5


def test_distributed_optimizer_parity_catches_a_missing_param_gather(adam_reference):
    got = run_on_ranks(_run, 2, _adam(dict(dp=2), use_distributed_optimizer=True), STEPS, "no_param_gather")[0]
    assert max_rel_diff(got["params"], adam_reference["params"]) > 1e-3


def _adam_settings(raw):
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    return sorted({(tuple(g["betas"]), g["eps"]) for o in trainer.optimizers.values() for g in o.optimizer.param_groups})


def test_adam_betas_and_eps_reach_every_module_optimizer():
    # A control: the defaults (Megatron-LM's) unless set.
    assert run_on_ranks(_adam_settings, 1, _adam(adam_eps=1e-8))[0] == [((0.9, 0.999), 1e-8)]
    got = run_on_ranks(_adam_settings, 1, _adam(adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6))[0]
    assert got == [((0.8, 0.95), 1e-6)]


def test_bf16_keeps_fp32_masters_tracks_fp32_and_learns(adam_reference):
    got = run_on_ranks(_run, 1, _adam(precision="bf16"), STEPS)[0]
    ref = adam_reference["losses"]
    # bf16 weights and activations, fp32 master weights: within 2% of the FP32 run's losses.
    for a, b in zip(got["losses"], ref):
        assert abs(a - b) <= 0.02 * abs(b), (got["losses"], ref)
    assert got["losses"][-1] < got["losses"][0]
    # Every model weight is bf16, norms included (CUDA's layer norm refuses bf16 activations with
    # fp32 weights, though the CPU kernel runs the mix); what the optimizer steps is fp32.
    assert any("layernorm" in k for k in got["param_dtypes"]) and any("linear" in k for k in got["param_dtypes"])
    assert set(got["param_dtypes"].values()) == {"torch.bfloat16"}, got["param_dtypes"]
    assert got["masters"] == {m: ["torch.float32"] for m in ("audio", "images", "language")}
    assert got["grad_dtypes"] == ["torch.float32"]  # grad_reduce_in_fp32 defaults to true
    # Negative control for the tolerance: bf16 differs from fp32 at all.
    assert got["losses"] != ref


def test_bf16_gradient_reduction_in_bf16_halves_the_buffer_and_still_tracks_fp32(adam_reference):
    # DP2 with the distributed optimizer: the bf16 buffers are what the ranks reduce-scatter.
    raw = _adam(dict(dp=2), precision="bf16", use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    got = run_on_ranks(_run, 2, raw, STEPS)
    fp32_grads = run_on_ranks(_run, 2, _adam(dict(dp=2), precision="bf16", use_distributed_optimizer=True),
                              STEPS)[0]
    for r in got:
        assert r["grad_dtypes"] == ["torch.bfloat16"]
        assert r["masters"] == {m: ["torch.float32"] for m in ("audio", "images", "language")}
        for a, b in zip(r["losses"], adam_reference["losses"]):
            assert abs(a - b) <= 0.02 * abs(b), (r["losses"], adam_reference["losses"])
        assert r["losses"][-1] < r["losses"][0]
    assert fp32_grads["grad_dtypes"] == ["torch.float32"]
    # The two reductions differ at all (the knob reaches megatron-core's DDP).
    assert max_rel_diff(got[0]["params"], fp32_grads["params"]) > 0


def test_frozen_module_gets_no_optimizer_and_no_grad_buffer():
    raw = tiny()
    raw["model"]["encoders"]["audio"]["projector"]["frozen"] = True  # audio entirely frozen
    got = run_on_ranks(_run, 1, raw, 0)[0]
    assert got["modules"] == got["ddp"] == ["images", "language"]
    assert got["buffers"] and not any(k.startswith("audio.") for k in got["buffers"])
    # Control: with its projector trainable, audio has both.
    both = run_on_ranks(_run, 1, tiny(), 0)[0]
    assert both["modules"] == both["ddp"] == ["audio", "images", "language"]
    assert any(k.startswith("audio.projector.") for k in both["buffers"])


# -- one global gradient norm ---------------------------------------------------------------------

def _norms(raw, steps, sabotage=False):
    if sabotage:  # TP-replicated weights (norms, biases) counted on every TP rank instead of once
        from mimo.training import optimizer as optimizer_module

        optimizer_module.counted = lambda param, tp_rank: True
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    norms = [trainer.train_step(s).grad_norm for s in range(steps)]
    return dict(record_run(trainer, 0), norms=norms)


def test_global_grad_norm_and_clipping_match_one_rank():
    # TP2 with sequence parallelism x DP2 with the distributed optimizer: each element of the
    # gradient must be counted exactly once in the norm (TP shards all, TP-replicated and
    # sequence-parallel weights once, DP replicas once, distributed-optimizer shards each once).
    # clip_grad far below the norm: every step clips, so a wrong norm changes the weights.
    training = dict(clip_grad=0.05)
    ref = run_on_ranks(_norms, 1, _adam(**training), STEPS)[0]
    assert all(n > 0.05 for n in ref["norms"])
    layout = dict(tp=2, dp=2, sp=True)
    got = run_on_ranks(_norms, 4, _adam(layout, use_distributed_optimizer=True, **training), STEPS)
    for r in got:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    params = {}
    for r in got:
        params.update(r["params"])
    # The TP x DP summation order's rounding, through 3 clipped Adam steps (measured 5.5e-6 with `_adam`'s
    # eps; 1.3e-3 on one machine with eps 1e-8, which is why `_adam` raises it).
    assert max_rel_diff(params, ref["params"]) <= 1e-4
    # Negative control: replicated weights counted on both TP ranks give another norm.
    bad = run_on_ranks(_norms, 4, _adam(layout, use_distributed_optimizer=True, **training), 1, True)[0]
    assert abs(bad["norms"][0] - ref["norms"][0]) > 1e-4 * ref["norms"][0]


# -- the distributed optimizer on heterogeneous layouts ------------------------------------------

@pytest.mark.parametrize("modules,world", [
    (dict(language=dict(dp=2), images=dict(dp=2, rank_offset=2), audio=dict(rank_offset=4)), 5),
    (dict(language=dict(pp=2), images=dict(dp=2), audio=dict(dp=2)), 2),
], ids=["noncolocated_dp2", "colocated_three_phase_pp2"])
def test_distributed_optimizer_adam_on_heterogeneous_layouts_equals_one_rank(adam_reference, modules, world):
    """Each module's optimizer shards its state over that module's own DP group; with Adam the run
    still equals the 1-rank one (losses and weights tightly; a DP rank's gradient
    buffer holds only its own shard reduced, so gradients are compared through the weights)."""
    from mimo.training.parity import merge_ranks
    from test_heterogeneous_parity import layout

    raw = layout(**modules)
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=STEPS, use_distributed_optimizer=True,
                           adam_eps=PARITY_ADAM_EPS)  # as `_adam`, whose run is the reference
    ranks = run_on_ranks(_run, world, raw, STEPS, timeout_s=240)
    kinds = {k for r in ranks for k in r["kinds"].values()}
    assert kinds == {"DistributedOptimizer"}, kinds
    got = merge_ranks(ranks)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(adam_reference["losses"]), rtol=1e-5, atol=0)
    assert max_rel_diff(got["params"], adam_reference["params"]) <= 5e-5  # measured 5.4e-6 and 2.5e-7
    # Negative control: without the parameter all-gather each DP rank keeps only its own shard's update.
    bad = merge_ranks(run_on_ranks(_run, world, raw, STEPS, "no_param_gather", timeout_s=240))
    assert max_rel_diff(bad["params"], adam_reference["params"]) > 1e-2


# -- overlap_grad_reduce --------------------------------------------------------------------------

@pytest.mark.parametrize("modules,world", [
    (dict(language=dict(dp=2), images=dict(dp=2), audio=dict(dp=2)), 2),
    (dict(language=dict(dp=2), images=dict(dp=2, rank_offset=2), audio=dict(rank_offset=4)), 5),
], ids=["homogeneous_dp2", "noncolocated_dp2"])
def test_overlap_grad_reduce_on_the_llm_equals_one_rank(modules, world):
    """The LLM's DP reduction starts from megatron's backward hooks while backward runs; trainable
    encoders (whose backward count varies with the data) reduce at the grad-sync action."""
    from mimo.training.parity import merge_ranks
    from test_heterogeneous_parity import layout

    raw = layout()
    reference = run_on_ranks(_run, 1, raw, STEPS)[0]
    raw = layout(**modules)
    raw["training"]["overlap_grad_reduce"] = True
    ranks = run_on_ranks(_run, world, raw, STEPS, timeout_s=240)
    for r in ranks:
        for name, (overlap, hooked) in r["overlap"].items():
            assert overlap == hooked == (name == "language"), r["overlap"]
    got = merge_ranks(ranks)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert max_rel_diff(got["params"], reference["params"]) <= 1e-5


# -- torch's fused Adam (on CUDA runtimes) ----------------------------------------------------------

def _run_fused(raw, steps, fused, save=None, load=None):
    """Train a 3-step run up to `steps` with the CUDA runtime's choice of torch's fused Adam forced on
    (`fused`) or left as on CPU (off); save at step 2 (`save`) / resume first (`load`). The fused
    kernel also runs on CPU."""
    import mimo.training.optimizer as optimizer
    from mimo.checkpoint import checkpointer
    from mimo.runtime import FusionSupport

    if fused:
        optimizer.fusion_support = lambda runtime: FusionSupport(fused_adam=True)
    raw["training"].update(train_iters=3, **({"save": save, "save_interval": 2} if save else {}),
                           **({"load": load} if load else {}))
    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    ckpt = checkpointer(cfg, trainer, None)
    start = ckpt.resume() if ckpt else 0
    for step in range(start, steps):
        trainer.train_step(step)
        if ckpt:
            ckpt.after_step(step)
    if ckpt:
        ckpt.finish()
    flags = sorted({bool(g.get("fused")) for o in trainer.optimizers.values() for g in o.optimizer.param_groups})
    return dict(record_run(trainer, 0), fused=flags)


@pytest.mark.parametrize("layout,world,training", [({}, 1, {}),
                                                   (dict(dp=2), 2, dict(precision="bf16", use_distributed_optimizer=True))],
                         ids=["fp32", "bf16_distopt_dp2"])
def test_fused_adam_steps_like_the_foreach_adam_and_resumes(tmp_path, layout, world, training):
    from mimo.checkpoint import paths
    from mimo.training.parity import merge_ranks

    plain = merge_ranks(run_on_ranks(_run_fused, world, _adam(layout, **training), 3, False))
    fused = merge_ranks(run_on_ranks(_run_fused, world, _adam(layout, **training), 3, True))
    assert plain["fused"] == [False] and fused["fused"] == [True]
    # The same update to rounding (measured 5.5e-6 of the largest weight after 3 steps in fp32, 9.7e-6
    # in bf16 with `_adam`'s settings; 2.8e-5 in fp32 with eps 1e-8).
    assert max_rel_diff(fused["params"], plain["params"]) <= 1e-4
    # Saved after 2 fused steps, resumed fused (Adam's step counter back where the fused step wants
    # it): the third step lands where the uninterrupted run's did.
    merge_ranks(run_on_ranks(_run_fused, world, _adam(layout, **training), 2, True, str(tmp_path), daemon=False))
    resumed = merge_ranks(run_on_ranks(_run_fused, world, _adam(layout, **training), 3, True, None,
                                       paths.iter_dir(str(tmp_path), 2), daemon=False))
    assert max_rel_diff(resumed["params"], fused["params"]) <= 1e-6
