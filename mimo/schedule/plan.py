"""The step plan: for every rank, the ordered list of actions of one training step.

`build_plan(cfg)` makes it from the config alone (no process group, no
tensor); `mimo.schedule.check.check_plan` proves, before a step runs, that
the plan completes when every send waits for its matching receive (no message
tags) and every collective for all of its members.

This is the public face of the plan. The data types (`Action`, `StepPlan`,
the action kinds and collective names) live in `plan_types` and are
re-exported here; the builders are `plan_build` (per rank: which schedule,
then the step's reductions) and `plan_nodes` (the stage-node graph). Imports
point one way: plan -> plan_build -> plan_nodes -> plan_types.
"""

from __future__ import annotations

from .plan_build import build_plan
from .plan_types import (ACTIVATION, BACKWARD, BOUNDARY, COLLECTIVE, FORWARD, GRAD_NORM, GRAD_SYNC, GRADIENT, LOSS,
                         LOSS_TOKENS, OFFLOAD, OPTIMIZER, P2P, RECV, RELOAD, SEND, Action, PlanError, RankActions,
                         StepPlan)

__all__ = ["ACTIVATION", "BACKWARD", "BOUNDARY", "COLLECTIVE", "FORWARD", "GRAD_NORM", "GRAD_SYNC", "GRADIENT", "LOSS",
           "LOSS_TOKENS", "OFFLOAD", "OPTIMIZER", "P2P", "RECV", "RELOAD", "SEND", "Action", "PlanError",
           "RankActions", "StepPlan", "build_plan"]

