"""Planner: frozen-aware cost model, stage partitioning and layout search.

Pure Python (no torch.distributed, no megatron): it runs anywhere, including
before any process group exists.
"""

from mimo.planner.api import PlanResult, load_raw, make_plan
from mimo.planner.cost_model import Calibration, CostModel, Measurement, Workload, calibrate, fit_scale
from mimo.planner.costs import LayerCost, frozen_aware_costs, frozen_unaware_costs, llm_upstream_requires_grad
from mimo.planner.emit import build_config, to_yaml
from mimo.planner.hardware import GPUS, GpuSpec, get_gpu
from mimo.planner.memory import in_flight_microbatches, stage_memory, state_bytes_per_param
from mimo.planner.partition import allocate_stages, partition_stages
from mimo.planner.profiling import proportional_allocation, stable_profiling_batch, workload_ratio
from mimo.planner.rules import layout_errors
from mimo.planner.search import Candidate, Planner, SearchSettings
from mimo.planner.simulator import SimStage, simulate_1f1b, simulate_colocated
from mimo.planner.spec import ModelSpec, ModuleSpec, read_model
from mimo.planner.stages import Layout, ModulePlan, plan_module

__all__ = [
    "Calibration", "Candidate", "CostModel", "GPUS", "GpuSpec", "LayerCost", "Layout", "Measurement",
    "ModelSpec", "ModulePlan", "ModuleSpec", "PlanResult", "Planner", "SearchSettings", "SimStage",
    "Workload", "allocate_stages", "build_config", "calibrate", "fit_scale", "frozen_aware_costs",
    "frozen_unaware_costs", "get_gpu", "in_flight_microbatches", "layout_errors",
    "llm_upstream_requires_grad", "load_raw", "make_plan", "partition_stages", "plan_module",
    "proportional_allocation", "read_model", "simulate_1f1b", "simulate_colocated",
    "stable_profiling_batch", "stage_memory", "state_bytes_per_param", "to_yaml", "workload_ratio",
]
