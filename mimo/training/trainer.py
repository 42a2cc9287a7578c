"""The trainer: data in, plan built, plan run, optimizer step, metrics out.

One trainer runs every layout mimo accepts. At start it builds the step plan
from the config (`mimo.schedule.build_plan`) and checks it before any
collective (`check_plan`: a plan that would deadlock stops here, naming ranks
and actions), builds this rank's parts of the model, megatron-core's DDP and
optimizers per module, and the boundary communicators. Each step it loads the
step's data, and the executor runs this rank's actions of the plan against a
`RankStep`, which holds the step's tensors; the plan ends with the step's
reductions and every module's optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

from mimo.attention import enable_context_parallel_rope
from mimo.balance.step import StepBalancer
from mimo.comm import build_communicator
from mimo.config import LANGUAGE, MimoConfig, placement
from mimo.data import build_dataset, shard_indices
from mimo.hf import check_hf_weights, hf_modules
from mimo.model.transformer_config import dtype_of
from mimo.runtime import ParameterOffload, Runtime, StepTimer, megatron_scope, synchronize
from mimo.schedule.check import check_plan
from mimo.schedule.executor import run_plan
from mimo.schedule.plan import LOSS, build_plan
from mimo.schedule.plan_build import HOMOGENEOUS, num_microbatches
from mimo.topology import Layout, Topology, build_topology

from .metrics import StepTimes, reduce_step
from .optimizer import ModelOptimizer, trainable
from .parts import build_parts
from .step_data import shard_step, whole_step
from .step_work import RankStep


def layout_problems(cfg: MimoConfig) -> List[str]:
    """Why the trainer cannot run the layout (empty when it can), as `path: reason` lines.

    Every layout the config contract accepts runs; these checks repeat the contract's rules the
    boundary relies on, for configs built without `mimo.config.validate`."""
    problems = []
    par = cfg.parallelism
    if par[LANGUAGE].ep != 1 and cfg.model.encoders:
        problems.append("parallelism.language.ep: expert parallelism is not supported at the encoder boundary")
    for name in cfg.model.encoders:
        if par[name].cp != 1 or par[name].ep != 1:
            problems.append(f"parallelism.{name}.cp: encoders must use cp = 1 and ep = 1")
    return problems


def check_loss_tokens(step: int, n_tokens) -> None:
    """After a step (where the trainer reads the loss anyway, so no extra wait for the device): a global
    batch without one token that carries a loss has nothing to learn from. Every rank holds the same
    count, so every rank stops, before the step could be saved; the loss divided by at least one
    token meanwhile, so the step's gradients were zeros, not NaN."""
    if int(n_tokens) == 0:
        raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    tokens: int          # sequence positions in the global batch
    loss_tokens: int     # positions that carry a loss
    step_time_s: float
    times: Optional[StepTimes] = None  # per-module times, peak memory, skipped samples (max over ranks)
    lr: float = 0.0                    # the learning rate this step trained with (the schedule's)


class Trainer:
    def __init__(self, cfg: MimoConfig, runtime: Runtime):
        problems = layout_problems(cfg)
        if problems:  # before any collective
            raise ValueError("\n".join(problems))
        self.plan = build_plan(cfg)
        check_plan(self.plan)
        self.cfg, self.runtime = cfg, runtime
        self.dtype = dtype_of(cfg.training.precision)
        self.num_microbatches = num_microbatches(cfg)
        self.homogeneous = self.plan.family == HOMOGENEOUS
        lang_par = cfg.parallelism[LANGUAGE]
        self.colocated = [n for n in cfg.model.encoders if placement(cfg.parallelism[n], lang_par) == "colocated"]
        # HF weights: every rank checks every needed tensor before building anything.
        self.hf_modules = hf_modules(cfg)
        self.hf_sources = check_hf_weights(cfg)
        self.topo: Topology = build_topology(cfg, backend=runtime.backend)
        self.rank = dist.get_rank()
        self.timer = StepTimer(runtime)  # spans of the plan's actions (module times, timeline)

        with megatron_scope(runtime):
            self.parts, self.layer_offsets = build_parts(cfg, self.topo, self.hf_modules, self.hf_sources)
        llm = self.parts.get(LANGUAGE)
        if llm is not None and lang_par.cp > 1:
            enable_context_parallel_rope(llm)  # RoPE at each token's global position under CP
        for m in self.parts.values():
            m.to(runtime.device)
        self.params = {name: trainable(m.parameters()) for name, m in self.parts.items()}
        self.optim = ModelOptimizer(cfg, self.parts, self.topo, runtime)

        self.dataset = build_dataset(cfg)
        self.balancer = StepBalancer(cfg)
        self.held = [n for n in cfg.model.encoders if n in self.parts]
        self.dataset.prefetch(self._prefetched, pin_memory=runtime.is_cuda, encoders=self.held)
        self.offload = None
        if cfg.training.offload_encoders and self.colocated:
            self.offload = ParameterOffload([p for n in self.colocated if n in self.parts
                                             for p in self.parts[n].parameters()], runtime)
        # Collective: every rank builds every edge, in config order. Homogeneous plans have none:
        # each rank feeds its own encoders' outputs to its LLM.
        self.comms = {} if self.homogeneous else {
            name: build_communicator(Layout.from_config(cfg.parallelism[name]), Layout.from_config(lang_par), None,
                                     cfg.model.language.hidden_size, self.dtype, device=runtime.device)
            for name in cfg.model.encoders}

    @property
    def optimizers(self):
        """module -> megatron-core optimizer, for the trainable module parts this rank holds."""
        return self.optim.optimizers

    def _prefetched(self, step: int) -> List[int]:
        """Samples (indices within a step) whose items this rank decodes ahead."""
        tr, G = self.cfg.training, self.cfg.training.global_batch_size
        if self.homogeneous and self.balancer.policy == "none":
            g = self.topo.grid(LANGUAGE)
            return [i for mb in shard_indices(G, tr.micro_batch_size, g.coords["dp"], g.layout.dp) for i in mb]
        # Balanced steps, and encoder DP over items: which samples a rank encodes depends on the
        # whole step, so an encoder rank reads ahead all of it, a rank without an encoder none.
        return list(range(G)) if self.held else []

    def step_data(self, step: int):
        lg = self.topo.grid(LANGUAGE)
        if self.homogeneous:
            return shard_step(self.cfg, self.dataset, self.balancer, step, lg.coords["dp"], self.runtime.device,
                              self.dtype)
        return whole_step(self.cfg, self.dataset, self.balancer, step, self.comms, self.colocated, self.held,
                          lg.coords["dp"] if lg.is_member else None, self.runtime.device, self.dtype)

    def forward_backward(self, step: int) -> float:
        """The step's forwards and backwards and its loss, without reductions or update (evaluation,
        logits): the plan through its `loss` collective, the same prefix on every rank."""
        self.optim.zero_grad()
        work = RankStep(self, self.step_data(step))
        with megatron_scope(self.runtime):
            run_plan(self.plan.through(LOSS), self.rank, work)
        loss = float(work.loss)
        check_loss_tokens(step, work.data.n_tokens)
        return loss

    def train_step(self, step: int) -> StepResult:
        synchronize(self.runtime)
        start = time.perf_counter()
        self.timer.reset()
        self.optim.zero_grad()
        lr = self.optim.lr
        data = self.step_data(step)
        work = RankStep(self, data)
        with megatron_scope(self.runtime):
            run_plan(self.plan, self.rank, work)
        self.optim.end_step()
        loss, norm, n_tokens = float(work.loss), float(work.grad_norm), int(data.n_tokens)
        check_loss_tokens(step, data.n_tokens)
        synchronize(self.runtime)
        elapsed = time.perf_counter() - start
        tr = self.cfg.training
        # Records the data side skipped so far (cumulative; mock data skips none).
        times = reduce_step(self.timer, self.cfg, self.runtime, self.dataset.metrics(step)["skipped_samples"])
        return StepResult(step, loss, norm, tr.global_batch_size * self.cfg.data.seq_length, n_tokens,
                          elapsed, times, lr)
