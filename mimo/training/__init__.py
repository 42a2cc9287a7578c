"""Train loop, per-module gradient sync and optimizers, full-state gathering."""

from .grad_sync import allreduce_gradients, clip_by_global_norm, local_grad_sq_norm, trainable
from .optim import build_optimizer
from .state import full_state, unshard
from .trainer import StepResult, Trainer, module_seed, unsupported_layout
from .heterogeneous import HeterogeneousTrainer, layout_problems, make_trainer  # noqa: E402

__all__ = ["HeterogeneousTrainer", "StepResult", "Trainer", "layout_problems", "make_trainer", "allreduce_gradients", "build_optimizer", "clip_by_global_norm", "full_state",
           "local_grad_sq_norm", "module_seed", "trainable", "unshard", "unsupported_layout"]
