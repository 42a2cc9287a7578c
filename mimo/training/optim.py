"""Per-module optimizers over trainable parameters only (frozen ones get no state)."""

from __future__ import annotations

from typing import List

import torch

from mimo.config import TrainingConfig


def build_optimizer(params: List[torch.nn.Parameter], tr: TrainingConfig):
    if not params:
        return None
    if tr.optimizer == "adam":
        return torch.optim.Adam(params, lr=tr.lr, weight_decay=tr.weight_decay, foreach=False)
    if tr.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tr.lr, weight_decay=tr.weight_decay, foreach=False)
    raise ValueError(f"training.optimizer must be adam or sgd, got {tr.optimizer!r}")
