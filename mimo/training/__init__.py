"""The trainer, per-module optimizers, full-state gathering."""

from .optimizer import ModelOptimizer, trainable
from .parts import module_seed
from .state import full_state, unshard
from .trainer import StepResult, Trainer, layout_problems

__all__ = ["ModelOptimizer", "StepResult", "Trainer", "full_state", "layout_problems", "module_seed", "trainable",
           "unshard"]
