"""megatron-core's DDP and optimizers per module, one global gradient-norm clip and one step.

Each trainable module part a rank holds is wrapped in megatron-core's
`DistributedDataParallel` over the module's own DP (x CP) group and gets its own
megatron optimizer (Adam or SGD; bf16 params with fp32 master weights; optionally
the distributed optimizer). The step's actions keep calling the inner modules:
DDP's hooks accumulate each gradient into `param.main_grad`.

The step plan's reduction actions call, in order: `finish_grads(module)` (the
module's gradient sums), `clip()` (ONE norm over every trainable parameter of the
whole model, on every rank: ranks without a trainable module take part in its
all-reduce too), `step_module(module)` for each module, then `end_step()`
advances the learning-rate schedule.

The global gradient norm is megatron-core's fused fp32 L2 norm
(`multi_tensor_applier` + `l2_norm_impl` of `megatron.core.optimizer.clip_grads`:
Transformer Engine's or apex's kernel when installed) over a few contiguous
views of each module's DDP grad buffers (`norm_views`), not a loop over
parameters: each rank counts its 1/(DP x CP) slice of every bucket (with the
distributed optimizer exactly the shard it reduce-scattered), and within it
the TP-sharded parameters on every TP rank, the TP-replicated ones on TP rank
0 only. One world all-reduce of a float then sums the partial squares; the
norm stays on the device (no host read).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import l2_norm_impl, multi_tensor_applier
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import local_multi_tensor_l2_norm

from mimo.config import LANGUAGE, MimoConfig, TrainingConfig
from mimo.model.transformer_config import dtype_of
from mimo.runtime import Runtime, fusion_support, optimizer_scope
from mimo.topology import Topology


def trainable(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]


def is_trainable(module: torch.nn.Module) -> bool:
    return bool(trainable(module.parameters()))


def transformer_config(part: torch.nn.Module) -> TransformerConfig:
    """The megatron config a module part was built with (its own, else its first submodule's)."""
    for m in part.modules():
        if isinstance(getattr(m, "config", None), TransformerConfig):
            return m.config
    raise ValueError(f"{type(part).__name__} holds no megatron-core module with a TransformerConfig")


def lr_scheduler(optimizer, tr: TrainingConfig) -> OptimizerParamScheduler:
    """Linear warmup from 0 over `lr_warmup_iters` steps, then `lr_decay_style` to `min_lr` at `train_iters`.

    Step s (0-based) trains with the schedule's value after s increments (megatron-core's convention)."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=tr.lr, min_lr=tr.min_lr, lr_warmup_steps=tr.lr_warmup_iters,
        lr_decay_steps=max(tr.train_iters, tr.lr_warmup_iters + 1), lr_decay_style=tr.lr_decay_style,
        start_wd=tr.weight_decay, end_wd=tr.weight_decay, wd_incr_steps=max(tr.train_iters, 1),
        wd_incr_style="constant",
        # On resume the step count comes from the checkpoint and the shape of the schedule from this
        # config, so a run extended with a larger train_iters decays over its new length.
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


@contextlib.contextmanager
def _module_param_groups():
    """megatron-core's `_get_param_groups` all-gathers param-group keys over the WORLD so that every
    rank of one model has the same groups for megatron's own optimizer checkpoints. mimo builds one
    optimizer per module, on that module's ranks only (other ranks hold other modules), and
    checkpoints per parameter; within a module every rank already has the same groups. Inside this
    context the gather returns this rank's own keys for every rank (no communication)."""
    gather = dist.all_gather_object

    def own_keys(out, obj, group=None):
        out[:] = [obj] * len(out)

    dist.all_gather_object = own_keys
    try:
        yield
    finally:
        dist.all_gather_object = gather


def use_fused_adam(opt) -> bool:
    """Switch a megatron optimizer's inner torch Adam / AdamW (what megatron-core builds without
    Transformer Engine or apex) to torch's fused step: one kernel per dtype and device for the
    whole update instead of the multi-tensor (foreach) one's several. The same arithmetic, to fp32
    rounding. Before the first step only (the step counters it creates then live on the device).
    Returns whether it switched."""
    inner = getattr(opt, "optimizer", None)
    if not isinstance(inner, torch.optim.Adam) or any(inner.state.values()):
        return False
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, False
    return True


def counted(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this TP rank counts `param`'s gradient in the global norm (megatron-core's rule,
    `get_main_grads_for_grad_norm`): TP shards on every TP rank, TP-replicated parameters (norms,
    biases of row-parallel layers) on TP rank 0 only, a `shared` copy (tied embeddings on the last
    pipeline stage) never."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _runs(start: int, end: int, holes: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """[start, end) minus the sorted, disjoint `holes`, as maximal contiguous ranges."""
    out, at = [], start
    for a, b in holes:
        a, b = max(a, start), min(b, end)
        if a >= b:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


def norm_ranges(buffer, tp_rank: int) -> List[Tuple[int, int]]:
    # An expert buffer (`DistributedDataParallel.expert_parallel_buffers`) holds the routed experts of
    # this EP rank; its `data_parallel_group` is the expert-DP group and `tp_rank` the expert-TP rank,
    # so every expert element is counted once: distinct experts over EP, distinct shards over expert
    # TP (replicated ones on expert-TP rank 0), one slice per expert-DP rank.
    """Element ranges of one megatron-core grad buffer (`_ParamAndGradBuffer`) this rank counts.

    The buffer's DP (x CP) ranks split every bucket into equal contiguous slices, rank r the r-th
    (with the distributed optimizer exactly the shard it reduce-scattered and owns; without it every
    rank holds the whole reduced bucket, and each counts its own slice, so the work is split too).
    Within its slice a rank skips the parameters `counted` rejects. Padding in the buffer is zero."""
    group = buffer.data_parallel_group
    n, r = group.size(), group.rank()
    holes = sorted((a, b) for p, (a, b, _) in buffer.param_index_map.items() if not counted(p, tp_rank))
    out = []
    for bucket in buffer.buckets:
        size = bucket.grad_data.numel()
        out += _runs(bucket.offset + r * size // n, bucket.offset + (r + 1) * size // n, holes)
    return out


def norm_views(ddp: DistributedDataParallel, tp_rank: int, expert_tp_rank: int = 0) -> List[torch.Tensor]:
    """Contiguous views of `ddp`'s grad buffers holding this rank's share of the module's norm:
    one per bucket on TP rank 0, a few per bucket (runs between TP-replicated parameters) elsewhere.
    An MoE module's expert buffers (reduced over expert DP) count by the expert-TP rank."""
    if ddp.ddp_config.num_distributed_optimizer_instances != 1:
        raise NotImplementedError("one distributed-optimizer instance per module is assumed")
    views = [buf.grad_data[a:b] for buf in ddp.buffers for a, b in norm_ranges(buf, tp_rank)]
    return views + [buf.grad_data[a:b] for buf in ddp.expert_parallel_buffers
                    for a, b in norm_ranges(buf, expert_tp_rank)]


def mark_expert_grads(part: torch.nn.Module, layout) -> None:
    """Route a module part's routed-expert gradients to megatron-core DDP's expert buffers (reduced
    over the expert-DP group) wherever that group differs from the dense DP x CP one.

    megatron-core marks expert weights `allreduce=False` only when `expert_model_parallel_size > 1`;
    with ep = 1 and expert TP smaller than TP (e.g. tp 2, etp 1) each TP rank holds whole experts that
    see only its sequence shard, so their gradients must also be summed over TP: the expert-DP group.
    That sum covers every rank that fed the expert, so an expert's `linear_fc2` bias (which megatron-core
    marks `sequence_parallel` like a dense row-parallel bias) must not be summed over TP again by
    finalize_model_grads: that counted it twice at EP 1, and added other experts' at EP > 1."""
    from mimo.model.reference_init import is_expert

    if layout.ep == 1 and layout.etp == layout.tp:
        return  # the expert decomposition is the dense one
    for name, p in part.named_parameters():
        if is_expert(name):
            p.allreduce = False
            p.sequence_parallel = False


# megatron-core's multi_tensor_applier chunk (2048 * 32 elements): the fused kernel sums squares per
# chunk in fp32, then sums the chunks' results; the torch path below keeps that shape.
NORM_CHUNK = 2048 * 32


def _chunk_norms(t: torch.Tensor) -> torch.Tensor:
    """fp32 L2 norms of consecutive NORM_CHUNK-element pieces of `t` (flattened), one per piece.

    One reduction over one [n, NORM_CHUNK] view, not one over the whole tensor: a CPU reduction of
    10^9 elements into a few fp32 accumulators loses most of its digits (measured: 42% off at 1.3 B,
    tools/bench_grad_norm.py), while each piece's sum stays exact to fp32 rounding."""
    flat = t.reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    parts = []
    if whole:
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), dim=1, dtype=torch.float32))
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1))
    return torch.cat(parts)


def sq_norm_fp32(tensors: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of `tensors` (any float dtypes) as a 0-d fp32 tensor on the device, no host read.

    On CUDA: megatron-core's fused multi-tensor L2 norm (Transformer Engine's or apex's
    `multi_tensor_l2norm`: one launch per dtype, fp32 accumulation per chunk). megatron-core's fallback
    without either (`local_multi_tensor_l2_norm`) reads each norm back to the host and allocates on
    "cuda", so on CPU ranks and in that case torch computes the same per-chunk fp32 norms
    (`_chunk_norms`: one reduction per tensor)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return total
    if tensors[0].is_cuda and l2_norm_impl is not local_multi_tensor_l2_norm:
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            overflow = torch.zeros(1, dtype=torch.int, device=group[0].device)
            norm, _ = multi_tensor_applier(l2_norm_impl, overflow, [group], False)
            total = total + norm.float().square().sum()
        return total
    return total + torch.cat([_chunk_norms(t) for t in tensors]).square().sum()


def _grad_kind(param: torch.nn.Parameter) -> str:
    """The kind of group a parameter's gradient is reduced over (see `ModelOptimizer.grad_group`)."""
    return "dp_cp" if getattr(param, "allreduce", True) else "expt_dp"


class ModelOptimizer:
    """Per-module DDP wrappers and optimizers of this rank; one global clip for the whole model."""

    def __init__(self, cfg: MimoConfig, parts: Dict[str, torch.nn.Module], topo: Topology, runtime: Runtime):
        tr = cfg.training
        self.cfg, self.runtime, self.topo = cfg, runtime, topo
        self.clip_grad = tr.clip_grad
        self._finished, self._sq_norms = set(), {}
        self.ddp: Dict[str, DistributedDataParallel] = {}
        self.norm_views: Dict[str, List[torch.Tensor]] = {}  # module -> views of its grad buffers (`norm_views`)
        self.groups = {}  # module -> its ProcessGroupCollection (with the optimizer's extra groups)
        self.optimizers = {}  # module -> megatron optimizer (one per trainable module part)
        # module -> megatron optimizer of its expert-parallel weights (an MoE LLM whose expert grid differs
        # from the dense one: `mark_expert_grads`); stepped, clipped and zeroed with the module's.
        self.expert_optimizers = {}
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=tr.grad_reduce_in_fp32 or tr.precision != "bf16",
            overlap_grad_reduce=tr.overlap_grad_reduce,
            use_distributed_optimizer=tr.use_distributed_optimizer)
        opt_config = OptimizerConfig(
            optimizer=tr.optimizer, lr=tr.lr, min_lr=tr.min_lr, weight_decay=tr.weight_decay,
            adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps,
            bf16=tr.precision == "bf16", params_dtype=dtype_of(tr.precision),
            use_distributed_optimizer=tr.use_distributed_optimizer, clip_grad=tr.clip_grad, sgd_momentum=0.0)
        with optimizer_scope(runtime), _module_param_groups():
            # Config order on every rank: the step's per-module collectives then come in one order.
            for name in cfg.modules:
                part = parts.get(name)
                if part is None or not is_trainable(part):
                    continue  # not held, or frozen: no grad buffer, no optimizer
                pgs = topo.grid(name).pg_collection()
                pgs.intra_dist_opt = pgs.dp_cp  # one distributed-optimizer instance over the module's DP x CP
                self.groups[name] = pgs
                config = copy.copy(transformer_config(part))
                # The loss is already divided by the global batch's loss-token count, so DP ranks
                # SUM their gradients (megatron's per-token-loss mode) rather than average them.
                config.calculate_per_token_loss = True
                module_ddp = copy.copy(ddp_config)
                # megatron's DDP starts a bucket's reduction once each of its parameters' gradients
                # arrived as often as in the first step. The LLM's backward count is fixed by the
                # plan; an encoder's depends on the step's items (none on a rank: no backward), so
                # its gradients are reduced at the grad-sync action instead.
                module_ddp.overlap_grad_reduce = tr.overlap_grad_reduce and name == LANGUAGE
                self.ddp[name] = DistributedDataParallel(config, module_ddp, part, pg_collection=pgs)
                chained = get_megatron_optimizer(opt_config, [self.ddp[name]], pg_collection=pgs,
                                                 use_gloo_process_groups=False)
                inner = [o for o in chained.chained_optimizers if o.get_parameters()]
                experts = bool(self.ddp[name].expert_parallel_buffers)
                if len(inner) != 1 + experts:
                    raise RuntimeError(f"{name}: expected {1 + experts} megatron optimizer(s), got {len(inner)}")
                self.optimizers[name] = inner[0]  # megatron lists the dense optimizer first
                if experts:
                    self.expert_optimizers[name] = inner[1]
                grid = topo.grid(name)
                self.norm_views[name] = norm_views(self.ddp[name], grid.coords["tp"],
                                                   grid.expert_coords["etp"] if experts else 0)
        if fusion_support(runtime).fused_adam:
            for opt in list(self.optimizers.values()) + list(self.expert_optimizers.values()):
                use_fused_adam(opt)
        # One schedule drives every module's param groups.
        self.scheduler = lr_scheduler(ChainedOptimizer(list(self.optimizers.values())
                                                       + list(self.expert_optimizers.values())), tr)

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return self.scheduler.get_lr({})

    def zero_grad(self) -> None:
        with optimizer_scope(self.runtime):
            for name, ddp in self.ddp.items():
                ddp.zero_grad_buffer()
                for opt in self._module_optimizers(name):
                    opt.zero_grad()
        self._finished, self._sq_norms = set(), {}

    def _local_sq_norm(self, name: str) -> torch.Tensor:
        """This rank's share of the squared norm of module `name`'s gradients (fp32, on the device), each
        element of the module counted on exactly one rank (`norm_views`)."""
        return sq_norm_fp32(self.norm_views[name], self.runtime.device)

    def finish_grads(self, name: str) -> None:
        """Module `name`'s gradient reductions (megatron-core's finalize_model_grads: the DP (x CP) sum,
        then the TP sum of sequence-parallel replicated weights, then for a pipelined LLM with tied
        embeddings the sum of the embedding's and its last-stage copy's gradients over the module's
        embedding group, `pg_collection.embd`) and its share of the squared norm.
        Runs once per step: the first of the module's grad-sync actions performs them all."""
        if name in self._finished or name not in self.ddp:
            return
        self._finished.add(name)
        with optimizer_scope(self.runtime):
            finalize_model_grads([self.ddp[name]], pg_collection=self.groups[name])
            for opt in self._module_optimizers(name):
                opt.prepare_grads()
            self._sq_norms[name] = self._local_sq_norm(name)

    def _module_optimizers(self, name: str) -> List:
        """Module `name`'s megatron optimizers: the dense one, then its expert one if any."""
        return [self.optimizers[name]] + ([self.expert_optimizers[name]] if name in self.expert_optimizers else [])

    def clip(self) -> torch.Tensor:
        """One global gradient norm over every trainable module of the model (a world all-reduce, on
        every rank, also those without a trainable module), and the clip by it; returns the norm."""
        for name in self.ddp:  # modules whose reductions the plan lists no collective for (DP = 1)
            self.finish_grads(name)
        with optimizer_scope(self.runtime):
            # Summed in config order, whichever action finished a module first: the same float sum every step.
            total = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
            for name in self.ddp:
                total += self._sq_norms[name]
            dist.all_reduce(total)
            norm = total.sqrt()
            if self.clip_grad > 0:
                coeff = (self.clip_grad / (norm + 1e-6)).clamp(max=1.0).float()
                for opt in list(self.optimizers.values()) + list(self.expert_optimizers.values()):
                    grads = [p.grad for p in opt.get_parameters() if p.grad is not None]
                    if grads:
                        torch._foreach_mul_(grads, coeff)
        return norm

    def step_module(self, name: str) -> None:
        with optimizer_scope(self.runtime):
            for opt in self._module_optimizers(name):
                opt.step_with_ready_grads()

    def end_step(self) -> None:
        """Advance the learning-rate schedule, after every module stepped."""
        self.scheduler.step(increment=1)

    def reload_model_params(self) -> None:
        """After the weights changed outside the optimizer (a checkpoint load): refresh the fp32 masters."""
        with optimizer_scope(self.runtime):
            for opt in list(self.optimizers.values()) + list(self.expert_optimizers.values()):
                opt.reload_model_params()

    # -- per-parameter state (checkpoints) ----------------------------------------------------

    def _owned(self, name: str) -> Dict[int, tuple]:
        """id(model param) -> (the inner optimizer's param for it, its flat range in the model param or
        None for all of it). With the distributed optimizer only the params this DP rank owns a
        piece of appear; bf16 params map to their fp32 master copies. Routed experts stepped by the
        module's expert optimizer are included (sharded over expert DP with the distributed optimizer)."""
        out = {}
        for opt in self._module_optimizers(name):
            out.update(self._owned_by(opt))
        return out

    @staticmethod
    def _owned_by(opt) -> Dict[int, tuple]:
        out = {}
        if isinstance(opt, DistributedOptimizer):
            for models, shards in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                   (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for mg, sg in zip(models, shards):
                    for p, s in zip(mg, sg):
                        r = opt._get_model_param_range_map(p)["param"]
                        out[id(p)] = (s, (r.start, r.end))
        elif hasattr(opt, "float16_groups"):  # bf16: fp32 master weights
            for mg, sg in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                out.update({id(p): (s, None) for p, s in zip(mg, sg)})
            out.update({id(p): (p, None) for g in opt.fp32_from_fp32_groups for p in g})
        else:
            out.update({id(p): (p, None) for g in opt.optimizer.param_groups for p in g["params"]})
        return out

    def grad_group(self, name: str, param: torch.nn.Parameter):
        """The group module `name`'s DDP reduces `param`'s gradient over (and, with the distributed
        optimizer, shards its state over): the expert-DP group for routed experts that
        `mark_expert_grads` sent to the expert buffers (megatron's `allreduce=False`), else DP x CP."""
        return self.topo.grid(name).groups[_grad_kind(param)]

    def owned_ranges(self, name: str) -> Dict[int, Optional[tuple]]:
        """id(model param) -> the flat range (start, end) of it this rank's optimizer steps, None for
        all of it; with the distributed optimizer params this rank owns no piece of are absent."""
        return {pid: rng for pid, (_, rng) in self._owned(name).items()}

    def _owner_spans(self, name: str, params: List[torch.nn.Parameter],
                     owned: Dict[int, tuple]) -> List[List[Tuple[int, int]]]:
        """With the distributed optimizer, per parameter of `params` (module `name`'s trainable ones, in
        order) the flat range of it that each member of its `grad_group` owns, in member order ((0, 0):
        none). Collective: one all-gather of a [params, 2] table over each kind of group, DP x CP first."""
        kinds = [_grad_kind(p) for p in params]
        spans: List[List[Tuple[int, int]]] = [[] for _ in params]
        for kind in ("dp_cp", "expt_dp"):  # the same order on every rank: every rank's params have the same kinds
            rows = [i for i, k in enumerate(kinds) if k == kind]
            if not rows:
                continue
            group = self.topo.grid(name).groups[kind]
            mine = torch.tensor([owned.get(id(params[i]), (None, (0, 0)))[1] for i in rows], dtype=torch.int64,
                                device=self.runtime.device)
            tables = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(tables, mine, group=group)
            tables = [t.tolist() for t in tables]  # host copies, once per save
            for j, i in enumerate(rows):
                spans[i] = [tuple(t[j]) for t in tables]
        return spans

    def param_state(self, name: str) -> Dict[int, Dict[str, torch.Tensor]]:
        """id(model param) -> {"exp_avg", "exp_avg_sq" (Adam, once stepped), "master" (bf16): fp32 tensors
        shaped like the model param; "step": scalar} for module `name`'s trainable params. Collective over
        the module's DP x CP group with the distributed optimizer: one DP rank per parameter (its writer)
        receives each owner's piece and gets the whole state; the others get no entry for it."""
        opt, owned = self.optimizers[name], self._owned(name)
        dist_opt = isinstance(opt, DistributedOptimizer)
        inners = [o.optimizer for o in self._module_optimizers(name)]  # dense, then experts'
        group = self.topo.grid(name).groups["dp_cp"]

        def state_of(key) -> dict:
            return next((i.state[key] for i in inners if key in i.state), {})

        states = [state_of(key) for key, _ in owned.values()]
        # Adam's moments exist once the module has stepped; with the distributed optimizer a DP rank
        # may own no piece of the module, so the owners tell it.
        seen = torch.tensor([max([float("exp_avg" in st) for st in states], default=0.0),
                             # torch's Adam counts steps per parameter; fused Adams (Transformer Engine,
                             # apex) per param group.
                             max([float(st["step"]) for st in states if "step" in st]
                                 + [float(g["step"]) for i in inners for g in i.param_groups if "step" in g],
                                 default=0.0)],
                            device=self.runtime.device)
        if dist_opt:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        stepped, step = bool(seen[0]), seen[1].reshape(()).float().cpu()
        names = (["exp_avg", "exp_avg_sq"] if stepped else []) + (["master"] if opt.config.bf16 else [])
        out = {}
        me = dist.get_rank()
        params = list(trainable(self.ddp[name].module.parameters()))
        spans = self._owner_spans(name, params, owned) if dist_opt else []
        for i, p in enumerate(params):
            key, rng = owned.get(id(p), (None, None))
            state = state_of(key) if key is not None else {}
            # With the distributed optimizer one rank of the parameter's reduction group (`grad_group`)
            # per parameter (in turn) gathers and writes it, so a rank holds about 1/DP of the module
            # part's state while saving, and sends only the pieces it owns (about 1/DP of it too).
            # Every rank walks the same parameter list (EP ranks hold the same number of experts) and
            # the writer lists its receives in member order, so each pair's messages match by order.
            members = dist.get_process_group_ranks(self.grad_group(name, p))
            writer = members[i % len(members)]
            tensors = {}
            for s in names:
                local = key if s == "master" else state.get(s)
                if not dist_opt:
                    tensors[s] = local.detach().view(p.shape)
                    continue
                ops, full = [], None
                if me == writer:
                    full = torch.zeros(p.numel(), dtype=torch.float32, device=self.runtime.device)
                    if rng is not None:
                        full[rng[0]:rng[1]] = local.detach().view(-1)
                    ops = [dist.P2POp(dist.irecv, full[a:b], m) for m, (a, b) in zip(members, spans[i])
                           if m != me and b > a]
                elif rng is not None and rng[1] > rng[0]:
                    ops = [dist.P2POp(dist.isend, local.detach().view(-1).float(), writer)]
                if ops:
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                if full is not None:  # to host memory at once: the device holds one parameter's state at a time
                    tensors[s] = full.view(p.shape).cpu()
            if stepped and (not dist_opt or me == writer):
                tensors["step"] = step.clone()
            if tensors:
                out[id(p)] = tensors
        return out

    def load_param_state(self, name: str, states: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """Install this rank's part of `param_state`-named entries into module `name`'s optimizer: whole
        tensors shaped like each param, or with the distributed optimizer the flat piece of its
        `owned_ranges` range (the checkpoint loads only that)."""
        owned = self._owned(name)
        # Which megatron optimizer steps each inner param (an MoE module's experts have their own).
        opt_of = {id(q): o for o in self._module_optimizers(name)
                  for g in o.optimizer.param_groups for q in g["params"]}
        for p in trainable(self.ddp[name].module.parameters()):
            if id(p) not in states or id(p) not in owned:
                continue
            key, _ = owned[id(p)]
            opt = opt_of[id(key)]
            full = states[id(p)]
            state = {s: t.to(key.device, torch.float32).reshape(key.shape).clone() for s, t in full.items()
                     if s != "step"}
            if "master" in state:
                key.data.copy_(state.pop("master"))
            if "step" in full:
                # torch keeps Adam's step on the host, but on the parameter's device for its fused step.
                fused = any(g.get("fused") or g.get("capturable") for g in opt.optimizer.param_groups)
                state["step"] = full["step"].reshape(()).to(key.device if fused else "cpu", torch.float32)
            if state:
                opt.optimizer.state[key] = state
            if "step" in full:
                for g in opt.optimizer.param_groups:
                    if "step" in g:
                        g["step"] = type(g["step"])(full["step"]) if not torch.is_tensor(g["step"]) \
                            else full["step"].reshape(()).to(g["step"])
