"""Multi-rank training equals the single-rank run on the same data (FP32).

Oracle: the 1-rank run of the same config and seed. Compared: per-step
losses, every parameter's full gradient after step 0 (TP shards gathered),
and every parameter after the last step.
"""

import pytest
import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import Trainer
from mimo.training.parity import record_run
from tiny import tiny

STEPS = 3


def _train(raw, steps, sabotage=None):
    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    if sabotage == "no_dp_sync":
        import mimo.training.optimizer as o

        o.finalize_model_grads = lambda model, pg_collection: None  # no DP (nor TP) gradient reduction
    run = record_run(trainer, steps)
    frozen = {f"{n}.{k}" for n, m in trainer.parts.items() for k, p in m.named_parameters() if not p.requires_grad}
    # A parameter is in a module's optimizer when DDP gave it a gradient buffer the optimizer steps.
    registered = {f"{n}.{k}" for n, m in trainer.parts.items() for k, p in m.named_parameters()
                  if n in trainer.optimizers and hasattr(p, "main_grad")}
    return dict(run, frozen=frozen, registered=registered, modules=sorted(trainer.optimizers),
                buffers=sorted(trainer.optim.ddp))


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, tiny(), STEPS)[0]


def assert_same_run(ref, got, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    assert got["grads"].keys() == ref["grads"].keys()
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=rtol, atol=atol, msg=lambda m: f"grad {k}: {m}")
    for k in ref["params"]:
        torch.testing.assert_close(got["params"][k], ref["params"][k], rtol=rtol, atol=atol, msg=lambda m: f"param {k}: {m}")


# tp2xdp2 runs with -m slow: TP x DP parity stays in the default run through
# test_heterogeneous_parity.py::test_colocated_fan_in_three_phase (LLM tp2 x dp2).
@pytest.mark.parametrize("layout,world", [
    (dict(dp=2), 2),
    pytest.param(dict(tp=2, dp=2), 4, marks=pytest.mark.slow),
], ids=["dp2", "tp2xdp2"])
def test_multi_rank_equals_single_rank(reference, layout, world):
    results = run_on_ranks(_train, world, tiny(**layout), STEPS)
    for got in results:  # every rank ends with the same full model
        assert_same_run(reference, got)


def test_parity_check_catches_missing_dp_gradient_sync(reference):
    got = run_on_ranks(_train, 2, tiny(dp=2), STEPS, "no_dp_sync")[0]
    with pytest.raises(AssertionError):
        assert_same_run(reference, got)


def test_frozen_modules_get_no_gradients_and_no_optimizer_state(reference):
    frozen = reference["frozen"]
    assert frozen and all(k.startswith("audio.encoder.") for k in frozen)
    assert not any(k in reference["grads"] for k in frozen)
    assert not frozen & reference["registered"]
    assert reference["registered"] == set(reference["grads"])
    # Audio's frozen encoder shares its part with a trainable projector: one optimizer per trainable part.
    assert reference["modules"] == reference["buffers"] == ["audio", "images", "language"]
    # The frozen encoder's weights never move; its trainable projector does.
    init = run_on_ranks(_train, 1, tiny(), 0)[0]["params"]
    for k in frozen:
        assert torch.equal(init[k], reference["params"][k])
    moved = [k for k in reference["params"] if k.startswith("audio.projector.")]
    assert moved and all(not torch.equal(init[k], reference["params"][k]) for k in moved)


def test_training_reduces_loss(reference):
    assert reference["losses"][-1] < reference["losses"][0]


def _bitfield(raw):
    raw["model"]["language"]["attention"] = "bitfield"
    raw["model"]["encoders"]["images"]["attention"] = "bitfield"
    return raw


def test_bitfield_attention_trains_and_matches_single_rank(reference, monkeypatch):
    # Spawned ranks inherit the variable before they import Triton: the real kernels run, interpreted on CPU.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref = run_on_ranks(_train, 1, _bitfield(tiny()), 2)[0]
    got = run_on_ranks(_train, 2, _bitfield(tiny(tp=2)), 2)[1]
    assert_same_run(ref, got)
    # The multimodal mask changes the model's computation: it is not plain causal attention.
    assert abs(ref["losses"][1] - reference["losses"][1]) > 1e-4
    assert ref["losses"][1] < ref["losses"][0]


def _train_without_loss_tokens(raw, steps):
    """The data carry no token with a loss (every loss mask zero)."""
    import mimo.training.step_data as step_data

    collate = step_data.collate

    def masked(*args, **kwargs):
        batch = collate(*args, **kwargs)
        batch["loss_mask"] = batch["loss_mask"] * 0
        return batch

    step_data.collate = masked  # this rank process only
    step_data.loss_tokens = lambda samples, placeholder_ids: 0  # the whole step's count, from its tokens
    return _train(raw, steps)


@pytest.mark.parametrize("layout,world", [
    (dict(dp=2), 2),                                                    # homogeneous: counted by an all-reduce
    ({"language": {}, "images": {"rank_offset": 1}, "audio": {"rank_offset": 1}}, 2),  # whole step on the host
], ids=["homogeneous_dp2", "noncolocated"])
def test_a_global_batch_without_loss_tokens_stops_every_rank(layout, world):
    from mimo.runtime.launch import RankFailed

    raw = tiny(**layout) if "dp" in layout else {**tiny(), "parallelism": layout}
    with pytest.raises(RankFailed, match="no token that carries a loss"):
        run_on_ranks(_train_without_loss_tokens, world, raw, 1, timeout_s=120)
