"""Random-number-generator states of one rank (python, numpy, torch, CUDA when present).

Each rank writes its own file `rng/rank_NNNNN.pt` inside the checkpoint. They are
restored only on the layout they were saved with (same ranks, same roles); on
another layout a rank's generators keep the seed the run started with.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from mimo.runtime import gpu_rng_state, set_gpu_rng_state


def rng_path(ckpt: str, rank: int) -> str:
    return os.path.join(ckpt, "rng", f"rank_{rank:05d}.pt")


def capture() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    gpu = gpu_rng_state()
    if gpu is not None:
        state["cuda"] = gpu
    return state


def save_rng(ckpt: str, rank: int, state: dict) -> None:
    path = rng_path(ckpt, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)


def restore_rng(ckpt: str, rank: int) -> None:
    state = torch.load(rng_path(ckpt, rank), weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    set_gpu_rng_state(state.get("cuda"))
