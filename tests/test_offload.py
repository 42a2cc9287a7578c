"""Encoder offload in the three-phase schedule: storage is released during phase 2, results are unchanged."""

import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import Trainer
from mimo.training.parity import record_run
from test_heterogeneous_parity import _merge, deeper


def _train(raw, steps):
    from mimo.training.step_work import RankStep

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    seen = []
    if trainer.offload is not None:
        llm_forward = RankStep._llm_forward

        def watched(self, stage, mb):  # phase 2: what the encoder weights hold on the device now
            if mb == 0:
                seen.append((trainer.offload.offloaded_numel,
                             sum(p.data.numel() for n in ("images", "audio") if n in trainer.parts
                                 for p in trainer.parts[n].parameters())))
            return llm_forward(self, stage, mb)

        RankStep._llm_forward = watched  # this rank process only
    return dict(record_run(trainer, steps), seen=seen)


def test_offload_changes_no_weight_or_gradient():
    # images streams through two colocated pipeline stages (phase 1 and 3 in chunks), audio is one stage.
    raw = deeper(language=dict(pp=2), images=dict(pp=2), audio=dict(tp=2))
    plain = _merge(run_on_ranks(_train, 2, raw, 2))
    raw["training"]["offload_encoders"] = True
    results = run_on_ranks(_train, 2, raw, 2)
    for r in results:
        assert len(r["seen"]) == 2  # once per step
        for offloaded, on_device in r["seen"]:
            assert offloaded > 0 and on_device == 0
    off = _merge(results)
    assert off["losses"] == plain["losses"]
    for key in ("grads", "params"):
        assert off[key].keys() == plain[key].keys()
        for k in plain[key]:
            assert torch.equal(off[key][k], plain[key][k]), (key, k)
