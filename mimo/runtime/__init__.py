"""Device/backend selection and megatron-core CPU support. Only this package knows CUDA vs CPU."""

from .device import DEVICE_CHOICES, Runtime, manual_seed, select_runtime, synchronize
from .distributed import init_distributed, setup_megatron, shutdown
from .launch import RankFailed, run_on_ranks
from .offload import ParameterOffload

__all__ = ["DEVICE_CHOICES", "ParameterOffload", "RankFailed", "Runtime", "init_distributed", "manual_seed", "run_on_ranks",
           "select_runtime", "setup_megatron", "shutdown", "synchronize"]
