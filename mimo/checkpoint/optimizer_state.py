"""The optimizer part of a checkpoint, resharded like the parameters it belongs to.

Today every module has a plain torch optimizer over the trainable parameters a
rank holds (mimo.training.optim). Each per-parameter state tensor shaped like its
parameter (Adam's `exp_avg`, `exp_avg_sq`; SGD's momentum) is stored under
`optimizer.<parameter key>.<state name>` with the parameter's global shape and
sharding, so it loads on any layout exactly like the weights; scalars (Adam's
`step`) are stored once per parameter. This is the one module to replace when
the optimizer becomes megatron-core's (whose `sharded_state_dict` gives the same
kind of layout-independent entries).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from megatron.core.dist_checkpointing import ShardedTensor

from .shards import ParamShard

PREFIX = "optimizer."


def _by_param(shards: List[ParamShard]) -> Dict[int, ParamShard]:
    return {id(s.param): s for s in shards}


def _scalar_replica(s: ParamShard):
    # Every TP rank holds the parameter's scalars: all but TP rank 0 are replicas
    # (one of tp_rank / replica[0] is always 0, see ParamShard).
    return (s.replica[0] + s.tp_rank, s.replica[1], s.replica[2])


def _entry(s: ParamShard, name: str) -> str:
    return f"{PREFIX}{s.key}{'#tied_copy' if s.replica[2] else ''}.{name}"


def optimizer_state(trainer, shards: List[ParamShard]) -> Dict[str, List[ShardedTensor]]:
    """Sharded state dict of every optimizer state tensor this rank holds (for saving)."""
    of = _by_param(shards)
    out = {}
    for opt in trainer.optimizers.values():
        if opt is None:
            continue
        for p, state in opt.state.items():
            s = of[id(p)]
            for name, value in state.items():
                if not torch.is_tensor(value):
                    continue
                key = f"{PREFIX}{s.key}.{name}"
                if value.shape == p.shape:
                    out[_entry(s, name)] = s.sharded(key, value.detach())
                elif value.numel() == 1:
                    out[_entry(s, name)] = [ShardedTensor.from_rank_offsets(key, value.detach().reshape(1),
                                                                            replica_id=_scalar_replica(s))]
                else:
                    raise ValueError(f"optimizer state {name!r} of {s.key} has shape {tuple(value.shape)}, "
                                     f"neither the parameter's {tuple(p.shape)} nor a scalar")
    return out


def optimizer_request(trainer, shards: List[ParamShard], saved: Dict) -> Dict[str, List[ShardedTensor]]:
    """What to load for this rank's trainable parameters: the state entries the checkpoint has
    (`saved`: its tensors' metadata). A parameter without saved state (frozen when saved) starts fresh."""
    of = _by_param(shards)
    out = {}
    for module, opt in trainer.optimizers.items():
        if opt is None:
            continue
        for p in trainer.params[module]:
            s = of[id(p)]
            head = f"{PREFIX}{s.key}."
            for key, meta in saved.items():
                if not key.startswith(head) or "." in key[len(head):]:
                    continue
                name = key[len(head):]
                if tuple(meta.global_shape) == s.full_shape:
                    out[_entry(s, name)] = s.sharded(key, torch.empty_like(p.detach()))
                else:
                    out[_entry(s, name)] = [ShardedTensor.from_rank_offsets(
                        key, torch.empty(1, dtype=meta.dtype), replica_id=_scalar_replica(s))]
    return out


def assign_optimizer(trainer, shards: List[ParamShard], loaded: Dict) -> None:
    """Install the loaded state tensors into the torch optimizers (replacing any state they had)."""
    of = _by_param(shards)
    for module, opt in trainer.optimizers.items():
        if opt is None:
            continue
        for p in trainer.params[module]:
            s = of[id(p)]
            head = _entry(s, "")
            state = {}
            for entry, pieces in loaded.items():
                if entry.startswith(head) and "." not in entry[len(head):]:
                    t = s.join(pieces)
                    state[entry[len(head):]] = t if t.shape == p.shape else t.reshape(())
            if state:
                opt.state[p] = state
