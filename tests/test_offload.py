"""Encoder offload in the three-phase schedule: storage is released during phase 2, results are unchanged."""

import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import full_state, make_trainer
from test_heterogeneous_parity import _merge, layout


def _train(raw, steps):
    trainer = make_trainer(load_config(raw), select_runtime("cpu"))
    seen = []
    if trainer.offload is not None:
        run_llm = trainer._llm_node

        def watched(*args, **kwargs):  # phase 2: what the encoder weights hold on the device now
            seen.append((trainer.offload.offloaded_numel,
                         sum(p.data.numel() for n in ("images", "audio") if n in trainer.parts
                             for p in trainer.parts[n].parameters())))
            return run_llm(*args, **kwargs)

        trainer._llm_node = watched
    tp = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    losses, grads = [], None
    for s in range(steps):
        losses.append(trainer.train_step(s).loss)
        if s == 0:
            grads = full_state(trainer.parts, tp, grads=True, layer_offsets=trainer.layer_offsets)
    return dict(losses=losses, grads=grads, params=full_state(trainer.parts, tp, layer_offsets=trainer.layer_offsets),
                seen=seen)


def test_offload_changes_no_weight_or_gradient():
    raw = layout(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(tp=2, dp=2))
    plain = _merge(run_on_ranks(_train, 4, raw, 2))
    raw["training"]["offload_encoders"] = True
    results = run_on_ranks(_train, 4, raw, 2)
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
