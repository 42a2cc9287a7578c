"""Random-number-generator states of one rank (python, numpy, torch, CUDA when present, and
megatron-core's RNG tracker streams, the expert-parallel one included).

Each rank writes its own file `rng/rank_NNNNN.pt` inside the checkpoint. They are
restored only on the layout they were saved with (same ranks, same roles); on
another layout a rank's generators keep the seed the run started with.

The file holds plain data only (tuples, numbers, strings, tensors: numpy's state
is stored with its key as a tensor), so it loads with torch's `weights_only`
loader. Files written before that hold numpy's key as an array; they still load
(`safe_load` accepts numpy arrays, which are data).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from mimo.runtime import gpu_rng_state, set_gpu_rng_state

from .safe_load import load_torch_file


def rng_path(ckpt: str, rank: int) -> str:
    return os.path.join(ckpt, "rng", f"rank_{rank:05d}.pt")


def capture() -> dict:
    algorithm, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (algorithm, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state()}
    gpu = gpu_rng_state()
    if gpu is not None:
        state["cuda"] = gpu
    tracker = _tracker()
    if tracker is not None:  # megatron's named streams: model-parallel and expert-parallel (MoE) dropout
        state["tracker"] = {name: s.clone() for name, s in tracker.get_states().items() if torch.is_tensor(s)}
    return state


def _tracker():
    """megatron-core's RNG tracker where this process set one up (on CPU: mimo.runtime's), else None."""
    from megatron.core.tensor_parallel import random as mcore_random

    return mcore_random.get_cuda_rng_tracker() if mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED else None


def save_rng(ckpt: str, rank: int, state: dict) -> None:
    path = rng_path(ckpt, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        # By the rank that wrote it: rank 0's fsync of the finished tree (before `latest` moves) may not
        # reach another node's writes on a shared filesystem.
        os.fsync(f.fileno())


def read_rng(ckpt: str, rank: int) -> dict:
    """This rank's saved states (CheckpointError for a missing, damaged or refused file)."""
    return load_torch_file(rng_path(ckpt, rank))


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    algorithm, key, pos, has_gauss, gauss = state["numpy"]
    key = key.numpy() if torch.is_tensor(key) else key  # an array in files written before tensors
    np.random.set_state((algorithm, key.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    set_gpu_rng_state(state.get("cuda"))
    tracker = _tracker()
    if tracker is not None and state.get("tracker"):  # files written before it held the tracker lack it
        states = dict(tracker.get_states())
        states.update({k: v for k, v in state["tracker"].items() if k in states})
        tracker.set_states(states)
