"""Data-aware microbatching: which samples each DP rank and microbatch runs, per module.

Sits above mimo.planner (its cost model gives per-sample work and its
simulator the pipeline timeline) and below mimo.training (the trainer asks for
the step's order). Pure numpy; no torch.distributed.
"""

from .assignment import StepAssignment, contiguous, violations
from .pipeline import Pipeline, cv, microbatch_loads
from .policy import POLICIES, assign
from .workload import WorkloadModel

__all__ = ["POLICIES", "Pipeline", "StepAssignment", "WorkloadModel", "assign", "contiguous", "cv",
           "microbatch_loads", "violations"]
