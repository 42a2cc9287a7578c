"""The few adaptations megatron-core 0.16 needs to run on CPU ranks (gloo).

megatron-core assumes a GPU in three places we reach:

1. Buffers are allocated with ``device=torch.cuda.current_device()`` (tensor
   parallel gathers, RoPE frequencies, the global memory buffer). On a CPU run
   we answer that question with the CPU device; nothing else in a CPU process
   asks it.
2. The RNG tracker (``get_cuda_rng_tracker``) saves and restores CUDA
   generator states around dropout in tensor-parallel regions. We install a
   tracker with the same interface that keeps CPU generator states.
3. The global memory buffer (sequence-parallel gathers) is created lazily by
   ``initialize_model_parallel``; we create it ourselves because mimo builds
   its process groups without ``initialize_model_parallel``. Thanks to (1) it
   allocates on the CPU.
4. Activation recompute (``tensor_parallel.checkpoint``, used by
   ``recompute_granularity`` selective and full) snapshots the host RNG, the
   current GPU's RNG and the tracker's states before the forward and restores
   them before recomputing, so that dropout draws the same numbers twice. The
   GPU part (``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in
   ``megatron/core/tensor_parallel/random.py``) calls ``torch.cuda`` and fails
   on a CPU-only build. On a CPU rank there is no GPU generator to keep: the
   host RNG and our CPU tracker (2) already hold every state dropout reads, so
   those two functions become no-ops here.

Everything is idempotent and undone by :func:`restore` (used by tests).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

_saved = {}


class CPURNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's RNG tracker interface over CPU generator states."""

    def __init__(self):
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_device():
    return torch.device("cpu")


def _no_gpu_rng_state(*args, **kwargs):
    """Stands for both reading (nothing to read) and setting (nothing to set) the GPU RNG state."""
    return None


def adapt_for_cpu(seed: int = 0) -> None:
    """Install the CPU adaptations (see module docstring). Call once per process."""
    if "current_device" not in _saved:
        _saved["current_device"] = torch.cuda.current_device
        torch.cuda.current_device = _cpu_device
    if "get_cuda_rng_state" not in _saved:
        _saved["get_cuda_rng_state"] = mcore_random._get_cuda_rng_state
        _saved["set_cuda_rng_state"] = mcore_random._set_cuda_rng_state
        mcore_random._get_cuda_rng_state = _no_gpu_rng_state
        mcore_random._set_cuda_rng_state = _no_gpu_rng_state
    tracker = CPURNGStatesTracker()
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def restore() -> None:
    """Undo :func:`adapt_for_cpu` (tests run several configurations per process)."""
    if "current_device" in _saved:
        torch.cuda.current_device = _saved.pop("current_device")
    if "get_cuda_rng_state" in _saved:
        mcore_random._get_cuda_rng_state = _saved.pop("get_cuda_rng_state")
        mcore_random._set_cuda_rng_state = _saved.pop("set_cuda_rng_state")
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    parallel_state._GLOBAL_MEMORY_BUFFER = None
