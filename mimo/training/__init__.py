"""Train loop, per-module gradient sync and optimizers, full-state gathering."""

from .optimizer import ModelOptimizer, trainable
from .state import full_state, unshard
from .trainer import StepResult, Trainer, module_seed, unsupported_layout
from .heterogeneous import HeterogeneousTrainer, layout_problems, make_trainer  # noqa: E402

__all__ = ["HeterogeneousTrainer", "StepResult", "Trainer", "layout_problems", "make_trainer", "ModelOptimizer", "full_state",
           "module_seed", "trainable", "unshard", "unsupported_layout"]
