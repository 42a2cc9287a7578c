"""Device/backend selection and megatron-core CPU support. Only this package knows CUDA vs CPU."""

from .ahead import NextStep
from .device import (DEVICE_CHOICES, Runtime, cuda_available, device_name, gpu_rng_state, manual_seed,
                     peak_memory_bytes, select_runtime, set_gpu_rng_state, synchronize)
from .fusions import FusionSupport, fusion_flags, fusion_support
from .distributed import checkpoint_scope, collective_device, init_distributed, megatron_scope, optimizer_scope, setup_megatron, shutdown
from .launch import RankFailed, run_on_ranks
from .offload import ParameterOffload
from .timing import Span, StepTimer

__all__ = ["DEVICE_CHOICES", "FusionSupport", "fusion_flags", "fusion_support", "NextStep", "checkpoint_scope", "collective_device", "cuda_available", "gpu_rng_state", "set_gpu_rng_state", "ParameterOffload", "RankFailed", "Runtime", "Span", "StepTimer", "device_name", "peak_memory_bytes", "init_distributed", "manual_seed", "megatron_scope", "optimizer_scope", "run_on_ranks",
           "select_runtime", "setup_megatron", "shutdown", "synchronize"]
