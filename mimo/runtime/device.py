"""Device and backend selection. The only place in mimo that asks about CUDA."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Runtime:
    """Where this process computes and how it talks to the others."""

    device: torch.device
    backend: str  # "nccl" | "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def multiprocessor_count(device: torch.device) -> Optional[int]:
    """The streaming multiprocessors of a CUDA device; None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _wants_cuda(preference: str) -> bool:
    return preference == "cuda" or (preference == "auto" and cuda_available())


def device_problem(preference: str = "auto") -> Optional[str]:
    """Why `select_runtime(preference)` cannot run in this process, as one line; None if it can."""
    use_cuda = _wants_cuda(preference)
    if use_cuda and not cuda_available():
        return "cuda was requested but CUDA is not available on this machine"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and local_rank >= torch.cuda.device_count():
        return f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible"
    return None


def select_runtime(preference: str = "auto") -> Runtime:
    """`auto`: NCCL + this process's GPU when CUDA is usable, else gloo + CPU."""
    if preference not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {preference!r}")
    problem = device_problem(preference)
    if problem is not None:
        raise RuntimeError(f"--device: {problem}")
    if not _wants_cuda(preference):
        return Runtime(torch.device("cpu"), "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # device_problem checked it names a GPU
    torch.cuda.set_device(local_rank)
    return Runtime(torch.device("cuda", local_rank), "nccl")


def preferred_device_name(preference: str = "auto") -> str:
    """What `select_runtime(preference)` will compute on, by name, without selecting it: "cpu" or
    this process's CUDA device name (the elastic re-plan picks the planner's hardware profile by it)."""
    if not (preference == "cuda" or (preference == "auto" and cuda_available())) or not cuda_available():
        return "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_name(min(local_rank, torch.cuda.device_count() - 1))


def synchronize(runtime: Runtime) -> None:
    """Wait for queued device work, so step timings measure the work itself."""
    if runtime.is_cuda:
        torch.cuda.synchronize(runtime.device)


def manual_seed(seed: int) -> None:
    """Seed the host RNG and, where present, every GPU's RNG."""
    torch.manual_seed(seed)
    if cuda_available():
        torch.cuda.manual_seed_all(seed)


def gpu_rng_state():
    """This process's GPU RNG state (for checkpoints); None where no GPU has been used."""
    if cuda_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


def set_gpu_rng_state(state) -> None:
    """Restore a state from `gpu_rng_state`; a state saved on a GPU is skipped on a CPU-only machine."""
    if state is not None and cuda_available():
        torch.cuda.set_rng_state(state)


def device_name(runtime: Runtime):
    """The accelerator's marketing name (e.g. "NVIDIA H100 80GB HBM3"), None on CPU."""
    if not runtime.is_cuda:
        return None
    return torch.cuda.get_device_name(runtime.device)


def peak_memory_bytes(runtime: Runtime) -> int:
    """Peak memory of this process so far: device allocations on a GPU, resident host memory on CPU."""
    if runtime.is_cuda:
        return torch.cuda.max_memory_allocated(runtime.device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
