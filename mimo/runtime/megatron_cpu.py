"""The few adaptations megatron-core 0.16 needs to run on CPU ranks (gloo).

megatron-core assumes a GPU in the places below (1-4 for models, then the
optimizer stack in `optimizer_on_cpu`):

1. Buffers are allocated with ``device=torch.cuda.current_device()`` (tensor
   parallel gathers, RoPE and M-RoPE frequencies, the global memory buffer). On a CPU run
   we answer that question with the CPU device; nothing else in a CPU process
   asks it. Scoped: `megatron_on_cpu` (through `mimo.runtime.megatron_scope`)
   is entered around building megatron modules and around running a step,
   where these allocations happen; nothing outside it is changed. Remove it
   once megatron-core allocates on the device of its inputs or takes a device
   argument.
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

7. megatron-core's fused functions (``megatron.core.jit.jit_fuser``, which is
   ``torch.compile``; mimo reaches it through the vocab-parallel cross entropy)
   are traced by dynamo and compiled by inductor's C++ backend in every rank
   process, again for each new input shape: seconds per rank before the first
   loss on a small CPU, for a few elementwise operations. A CPU rank runs them
   eagerly (``torch.compiler.set_stance("force_eager")``), the same arithmetic
   without the compile; CUDA ranks keep the compiled kernels.

8. Mixture-of-experts layers (megatron-core 0.16.1, transformer/moe): the
   all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``) creates a
   ``torch.cuda.Stream`` in its first ``__init__`` and copies its split sizes
   device-to-host on that stream (``_maybe_dtoh_and_synchronize``), leaving CPU
   tensors as tensors, which gloo's ``all_to_all_single`` refuses as split
   sizes. Inside `megatron_on_cpu` the stream is a placeholder and the copy is
   a plain conversion of the split sizes to host arrays, as the CUDA path ends
   with. The router, the all-to-all output and GroupedMLP ask
   ``torch.cuda.current_device()``, answered by (1). The expert-parallel RNG
   state that megatron forks around expert weight init (and its random-logits
   benchmark router) is registered in the tracker (2). Not adapted, so not
   used on CPU ranks: ``track_moe_metrics`` (allocates on "cuda"), shared-expert
   overlap (a CUDA stream), permute / router fusion (Transformer Engine).
   ``te_general_gemm``, referenced by the router's gating whether or not
   Transformer Engine is installed, is defined (None) where it is missing, on
   any device (`define_missing_te_gemm`).

9. Uneven sequence-parallel gathers and reduce-scatters (``tensor_parallel.mappings``,
   ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split sizes): the
   all-to-all dispatcher with expert TP > 1 gathers each expert-TP rank's received tokens, a
   different count per rank. megatron passes a list of differently sized tensors to
   ``all_gather`` / ``reduce_scatter``, which NCCL takes and gloo refuses. Inside `megatron_on_cpu`
   the uneven case becomes equal-sized collectives gloo runs: a gather of row blocks padded to the
   largest split, then the padding cut; a reduce-scatter as an all-reduce of the whole tensor, then
   this rank's rows (the same sums; CPU ranks only, where the extra volume does not matter).
   The equal-split case is megatron's own.

Everything is idempotent and undone by :func:`restore` (used by tests).

5. megatron-core's DDP grad buffers and optimizers (``optimizer_on_cpu``, a
   context entered only around those calls, see its docstring).
6. megatron-core's checkpoint save/load and asynchronous writer
   (``checkpoint_on_cpu``, entered only around a save, a load and finalizing
   an async save).
"""

from __future__ import annotations

import contextlib
import types

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.tensor_parallel import mappings as mcore_mappings
from megatron.core.tensor_parallel import random as mcore_random

_saved = {}
# megatron's own sequence-parallel gather / reduce-scatter (adaptation 9 wraps them)
_MEGATRON_GATHER = mcore_mappings._gather_along_first_dim
_MEGATRON_REDUCE_SCATTER = mcore_mappings._reduce_scatter_along_first_dim


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


class _NoStream:
    """Stands for the all-to-all dispatcher's device-to-host CUDA stream on a CPU rank (never used)."""


def _dispatcher_host_splits(self, point, tokens_per_expert=None):
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on a CPU rank: at its copy point the
    split sizes become host arrays (what the CUDA path's copies end with); nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
    """Adaptation 9: megatron's `_gather_along_first_dim` with gloo-friendly uneven splits."""
    if output_split_sizes is None or group.size() == 1:
        return _MEGATRON_GATHER(input_, group, output_split_sizes, use_global_buffer)
    rows, tail = max(output_split_sizes), tuple(input_.shape[1:])
    padded = input_.new_zeros((rows,) + tail)
    padded[:input_.shape[0]] = input_
    gathered = input_.new_empty((rows * group.size(),) + tail)
    torch.distributed.all_gather_single(gathered, padded, group=group)
    return torch.cat([gathered[i * rows:i * rows + n] for i, n in enumerate(output_split_sizes)])


def _reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
    """Adaptation 9: megatron's `_reduce_scatter_along_first_dim` with gloo-friendly uneven splits."""
    if input_split_sizes is None or group.size() == 1:
        return _MEGATRON_REDUCE_SCATTER(input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(input_split_sizes[:group.rank()])
    return total[start:start + input_split_sizes[group.rank()]].clone()


def _moe_dispatcher():
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher.MoEAlltoAllTokenDispatcher


@contextlib.contextmanager
def megatron_on_cpu():
    """Adaptations 1, 8 and 9, scoped: inside, ``torch.cuda.current_device()`` answers the CPU device,
    the all-to-all MoE dispatcher uses no CUDA stream and uneven gathers run on gloo."""
    saved = torch.cuda.current_device
    dispatcher = _moe_dispatcher()
    saved_moe = (dispatcher.cuda_dtoh_stream, dispatcher.__dict__["_maybe_dtoh_and_synchronize"])
    saved_maps = (mcore_mappings._gather_along_first_dim, mcore_mappings._reduce_scatter_along_first_dim)
    torch.cuda.current_device = _cpu_device
    if dispatcher.cuda_dtoh_stream is None:
        dispatcher.cuda_dtoh_stream = _NoStream()
    dispatcher._maybe_dtoh_and_synchronize = _dispatcher_host_splits
    mcore_mappings._gather_along_first_dim = _gather_uneven
    mcore_mappings._reduce_scatter_along_first_dim = _reduce_scatter_uneven
    try:
        yield
    finally:
        torch.cuda.current_device = saved
        dispatcher.cuda_dtoh_stream, dispatcher._maybe_dtoh_and_synchronize = saved_moe
        mcore_mappings._gather_along_first_dim, mcore_mappings._reduce_scatter_along_first_dim = saved_maps


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating (moe_utils.RouterGatingLinearFunction) tests
    ``te_general_gemm is not None``, a name its module defines only when Transformer Engine imports:
    without TE it is a NameError on any device. Define it as None there (the plain torch GEMM path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


EXPERT_RNG_OFFSET = 1024  # megatron's model_parallel_cuda_manual_seed: expert seed = seed + 1024 + ...


def _nothing_to_wait_for(*args, **kwargs):
    return None


@contextlib.contextmanager
def checkpoint_on_cpu():
    """megatron-core's dist_checkpointing save, load and asynchronous writer on a CPU rank.

    megatron-core 0.16.1 makes its ranks-agree tensors on ``torch.cuda.current_device()``
    (strategies/state_dict_saver.py, strategies/async_utils.py) and, for an asynchronous save,
    calls ``torch.cuda.synchronize()`` before it forks the writer process (to finish device-to-host
    copies). A CPU rank keeps those tensors on the CPU and has no device to wait for (its host
    copies are synchronous). The writer process is forked inside this context, so it sees the same
    answers. Remove when megatron-core checks for CUDA there.
    """
    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    torch.cuda.current_device, torch.cuda.synchronize = _cpu_device, _nothing_to_wait_for
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def adapt_for_cpu(seed: int = 0) -> None:
    """Install the CPU adaptations 2-4 and 7 (see module docstring). Call once per process."""
    torch.compiler.set_stance("force_eager")
    if "get_cuda_rng_state" not in _saved:
        _saved["get_cuda_rng_state"] = mcore_random._get_cuda_rng_state
        _saved["set_cuda_rng_state"] = mcore_random._set_cuda_rng_state
        mcore_random._get_cuda_rng_state = _no_gpu_rng_state
        mcore_random._set_cuda_rng_state = _no_gpu_rng_state
    tracker = CPURNGStatesTracker()
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mcore_random.get_expert_parallel_rng_tracker_name(), seed + 2718 + EXPERT_RNG_OFFSET)
    define_missing_te_gemm()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        with megatron_on_cpu():
            parallel_state._set_global_memory_buffer()


def restore() -> None:
    """Undo :func:`adapt_for_cpu` (tests run several configurations per process)."""
    torch.compiler.set_stance("default")
    if "get_cuda_rng_state" in _saved:
        mcore_random._get_cuda_rng_state = _saved.pop("get_cuda_rng_state")
        mcore_random._set_cuda_rng_state = _saved.pop("set_cuda_rng_state")
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    parallel_state._GLOBAL_MEMORY_BUFFER = None


def _on_cpu(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


def _cpu_torch():
    """The `torch` namespace as megatron's optimizer module sees it inside `optimizer_on_cpu`:
    tensors it creates on "cuda" are created on the CPU instead."""
    ns = types.ModuleType("torch")
    ns.__dict__.update(torch.__dict__)
    ns.tensor = lambda *a, device=None, **kw: torch.tensor(*a, device=_on_cpu(device), **kw)
    ns.zeros = lambda *a, device=None, **kw: torch.zeros(*a, device=_on_cpu(device), **kw)
    return ns


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    """`Tensor.type()` with no argument names a CPU tensor's type as its CUDA twin ("torch.cuda.BFloat16Tensor")."""
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or self.is_cuda or not isinstance(name, str):
        return name
    return name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def optimizer_on_cpu():
    """Run megatron-core DDP / optimizer calls (construction, grad sync, step) on a CPU rank.

    megatron-core 0.16.1 assumes CUDA there; inside this context:
    * ``torch.cuda.current_device()`` answers the CPU device: grad and param buffers
      (distributed/param_and_grad_buffer.py, the ``torch.zeros(..., device=torch.cuda.current_device())``
      of ``_ParamAndGradBuffer.__init__``), the distributed optimizer's shard buffers
      (optimizer/distrib_optimizer.py) and ``ChainedOptimizer.get_loss_scale`` (optimizer/optimizer.py);
    * optimizer/optimizer.py's ``torch.tensor(..., device='cuda')`` (``found_inf``, ``_scale_one``,
      ``_dummy_overflow_buf`` of ``MixedPrecisionOptimizer``, ``_scale`` of ``FP32Optimizer``) are made
      on the CPU;
    * ``Float16OptimizerWithFloat16Params`` sorts parameters by ``param.type()`` against the strings
      'torch.cuda.BFloat16Tensor' / 'torch.cuda.FloatTensor' and rejects anything else, so a CPU
      tensor reports its CUDA type name.
    Remove this when megatron-core allocates on the parameters' device.
    """
    saved = (torch.cuda.current_device, mcore_optimizer.torch, torch.Tensor.type)
    torch.cuda.current_device = _cpu_device
    mcore_optimizer.torch = _cpu_torch()
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.cuda.current_device, mcore_optimizer.torch, torch.Tensor.type = saved
