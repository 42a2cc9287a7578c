"""The optimizer part of a checkpoint, resharded like the parameters it belongs to.

Every module's megatron-core optimizer state is stored per parameter, independent of
the layout (mimo.training.optimizer.ModelOptimizer.param_state): each tensor shaped
like its parameter (Adam's `exp_avg`, `exp_avg_sq`; bf16 runs' fp32 `master` weight)
under `optimizer.<parameter key>.<state name>` with the parameter's global shape and
sharding, so it loads on any layout exactly like the weights (with the distributed
optimizer the DP owners' pieces are gathered first, each parameter on one DP rank); scalars (Adam's `step`) are
stored once per parameter. The learning-rate schedule's state goes in the metadata.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

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
    """Sharded state dict of every optimizer state tensor of this rank's parameters (for saving).
    Collective over each module's DP group with the distributed optimizer: every rank calls it."""
    of = _by_param(shards)
    # With the distributed optimizer only a parameter's writer (one DP rank) holds its state: it is
    # the DP main replica, whatever its DP coordinate.
    sole = trainer.cfg.training.use_distributed_optimizer
    out = {}
    for module in trainer.cfg.modules:  # the same order on every rank
        if module not in trainer.optimizers:
            continue
        for pid, state in trainer.optim.param_state(module).items():
            s = of[pid]
            tensor_replica = (s.replica[0], 0, s.replica[2]) if sole else s.replica
            scalar_replica = _scalar_replica(s)
            if sole:
                scalar_replica = (scalar_replica[0], 0, scalar_replica[2])
            for name, value in state.items():
                key = f"{PREFIX}{s.key}.{name}"
                if value.shape == s.param.shape:
                    out[_entry(s, name)] = s.sharded(key, value.detach(), tensor_replica)
                elif value.numel() == 1:
                    out[_entry(s, name)] = [ShardedTensor.from_rank_offsets(key, value.detach().reshape(1),
                                                                            replica_id=scalar_replica)]
                else:
                    raise ValueError(f"optimizer state {name!r} of {s.key} has shape {tuple(value.shape)}, "
                                     f"neither the parameter's {tuple(s.param.shape)} nor a scalar")
    return out


def _rows(p: torch.Tensor, rng) -> tuple:
    """The local rows (axis 0) holding flat range `rng` of `p`, and where `rng` starts in them."""
    row = math.prod(p.shape[1:])
    r0, r1 = rng[0] // row, -(-rng[1] // row)
    return r0, r1, rng[0] - r0 * row


def optimizer_request(trainer, shards: List[ParamShard], saved: Dict) -> Dict[str, List[ShardedTensor]]:
    """What to load for this rank's trainable parameters: the state entries the checkpoint has
    (`saved`: its tensors' metadata). A parameter without saved state (frozen when saved) starts fresh.
    With the distributed optimizer a rank loads only the rows holding the piece it owns (about 1/DP of
    the module part's state, not all of it) and nothing of parameters it owns no piece of."""
    of = _by_param(shards)
    # The checkpoint's optimizer entries by parameter, once (not every entry per parameter).
    states: Dict[str, List[Tuple[str, str]]] = {}
    for key in saved:
        if key.startswith(PREFIX):
            param, _, name = key[len(PREFIX):].rpartition(".")
            states.setdefault(param, []).append((key, name))
    out = {}
    for module in trainer.optimizers:
        ranges = trainer.optim.owned_ranges(module)
        for p in trainer.params[module]:
            if id(p) not in ranges:
                continue
            s, rng = of[id(p)], ranges[id(p)]
            for key, name in states.get(s.key, []):
                meta = saved[key]
                if tuple(meta.global_shape) != s.full_shape:
                    out[_entry(s, name)] = [ShardedTensor.from_rank_offsets(
                        key, torch.empty(1, dtype=meta.dtype), replica_id=_scalar_replica(s))]
                elif rng is None:
                    out[_entry(s, name)] = s.sharded(key, torch.empty_like(p.detach(), dtype=meta.dtype))
                else:
                    r0, r1, _ = _rows(p, rng)
                    out[_entry(s, name)] = s.sharded_rows(key, r0, r1, meta.dtype)
    return out


def assign_optimizer(trainer, shards: List[ParamShard], loaded: Dict, saved: Dict) -> None:
    """Install the loaded state tensors (`optimizer_request`'s, `saved` as there) into the module
    optimizers, replacing any state they had."""
    of = _by_param(shards)
    by_head: Dict[str, List[Tuple[str, object]]] = {}  # the loaded entries by parameter, once
    for entry, pieces in loaded.items():
        head, _, name = entry.rpartition(".")
        by_head.setdefault(head + ".", []).append((name, pieces))
    for module in trainer.optimizers:
        ranges = trainer.optim.owned_ranges(module)
        states = {}
        for p in trainer.params[module]:
            if id(p) not in ranges:
                continue
            s, rng = of[id(p)], ranges[id(p)]
            state = {}
            for name, pieces in by_head.get(_entry(s, ""), []):
                t = s.join(pieces)
                if tuple(saved[f"{PREFIX}{s.key}.{name}"].global_shape) != s.full_shape:
                    t = t.reshape(())  # a scalar (Adam's step)
                elif rng is not None:  # the loaded rows: keep the owned range
                    _, _, start = _rows(p, rng)
                    t = t.reshape(-1)[start:start + rng[1] - rng[0]]
                state[name] = t
            if state:
                states[id(p)] = state
        trainer.optim.load_param_state(module, states)
