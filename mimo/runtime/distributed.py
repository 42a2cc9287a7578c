"""Process-group start-up and shutdown, with timeouts so a dead rank never hangs the rest."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

from . import fusions, megatron_cpu
from .device import Runtime


def init_distributed(runtime: Runtime, timeout_minutes: float = 10.0) -> None:
    """Join the job launched by torchrun / srun (env:// rendezvous)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {', '.join(missing)} are not set: launch with torchrun "
            "(e.g. `torchrun --nproc-per-node 2 examples/pretrain_mimo.py ...`) or srun")
    kwargs = dict(backend=runtime.backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    if runtime.is_cuda:
        kwargs["device_id"] = runtime.device
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0":
        # torchrun restarts workers against the rendezvous store of the first attempt; the process
        # groups' keys there still hold the dead workers' addresses, which the new ones would read
        # (gloo: "connection refused"). A prefix per attempt keeps each generation's keys apart.
        store, rank, world = next(dist.rendezvous("env://", timeout=kwargs["timeout"]))
        kwargs.update(store=dist.PrefixStore(f"mimo_attempt_{restart}", store), rank=rank, world_size=world)
    dist.init_process_group(**kwargs)


def setup_megatron(runtime: Runtime, seed: int) -> None:
    """Prepare megatron-core's process-global state for mimo-built process groups.

    mimo never calls ``initialize_model_parallel`` (each module has its own
    groups), so the RNG tracker and the global memory buffer it would create
    are created here. It also makes `runtime`'s fused kernels the ones TransformerConfigs built
    from now on use (`mimo.runtime.fusions`).
    """
    fusions.activate(runtime)
    if not runtime.is_cuda:
        megatron_cpu.adapt_for_cpu(seed)
        return
    mcore_random.initialize_rng_tracker(force_reset=True)
    mcore_random.get_cuda_rng_tracker().add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    # Forked by megatron's MoE expert init on the GPU path (mimo initialises on the CPU, but register it).
    mcore_random.get_cuda_rng_tracker().add(mcore_random.get_expert_parallel_rng_tracker_name(),
                                            seed + 2718 + megatron_cpu.EXPERT_RNG_OFFSET)
    megatron_cpu.define_missing_te_gemm()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def megatron_scope(runtime: Runtime):
    """Context for building and running megatron-core modules: CPU ranks need `megatron_cpu.megatron_on_cpu`."""
    return contextlib.nullcontext() if runtime.is_cuda else megatron_cpu.megatron_on_cpu()


def checkpoint_scope(runtime: Runtime):
    """Context for megatron-core's checkpoint save, load and async finalization: CPU ranks need
    `megatron_cpu.checkpoint_on_cpu`."""
    return contextlib.nullcontext() if runtime.is_cuda else megatron_cpu.checkpoint_on_cpu()


def optimizer_scope(runtime: Runtime):
    """Context for megatron-core DDP / optimizer calls: CPU ranks need `megatron_cpu.optimizer_on_cpu`."""
    return contextlib.nullcontext() if runtime.is_cuda else megatron_cpu.optimizer_on_cpu()


def collective_device() -> torch.device:
    """Where this process's collective buffers live: NCCL moves device tensors only, gloo host tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    fusions.activate(None)
    megatron_cpu.restore()
