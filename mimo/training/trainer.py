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
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mimo.attention import enable_context_parallel_rope
from mimo.balance.step import StepBalancer
from mimo.comm import build_communicator
from mimo.config import LANGUAGE, MimoConfig, placement
from mimo.data import PAD_ID, build_dataset, shard_indices
from mimo.data.llava import MediaError
from mimo.hf import check_hf_weights, hf_modules
from mimo.model.transformer_config import dtype_of
from mimo.runtime import NextStep, ParameterOffload, Runtime, StepTimer, megatron_scope, synchronize
from mimo.schedule.check import check_plan
from mimo.schedule.executor import run_plan
from mimo.schedule.plan import LOSS, build_plan
from mimo.schedule.plan_build import HOMOGENEOUS, num_microbatches
from mimo.topology import Layout, Topology, build_topology

from .agreement import PlanAgreement
from .flops import rank_work
from .metrics import StepTimes, reduce_step
from .optimizer import ModelOptimizer, trainable
from .parts import build_parts
from .step_data import StepData, encoded_item_ids, item_sources, shard_step, step_windows, whole_step
from .step_work import BAD_MEDIA_SLOT, LOSS_SLOT, MEDIA_ERROR_SLOT, MOE_SLOTS, STOP_SLOT, RankStep
from .stop import StopRequest


def layout_problems(cfg: MimoConfig) -> List[str]:
    """Why the trainer cannot run the layout (empty when it can), as `path: reason` lines.

    Every layout the config contract accepts runs; these checks repeat the contract's rules the
    boundary relies on, for configs built without `mimo.config.validate`."""
    problems = []
    par = cfg.parallelism
    # The LLM's expert parallelism re-divides its own ranks (docs/moe.md): the boundary sees its dense grid.
    for name in cfg.model.encoders:
        if par[name].cp != 1 or par[name].ep != 1 or par[name].etp != 1:
            problems.append(f"parallelism.{name}.cp: encoders must use cp = 1, ep = 1 and etp = 1")
    return problems


def check_media_errors(step: int, failed, own: List[str]) -> None:
    """After a step, from its loss sum: `failed` items of the step failed to decode over all ranks (under
    `on_bad_record: error`, or the filesystem failed a rank's read), `own` of them here (their lines).
    Every rank stops alike (the step is not saved); the ranks that decoded them name the records."""
    if int(failed):
        raise MediaError("\n".join(own), own=True) if own else MediaError(
            f"error: data: step {step + 1}: {int(failed)} media item(s) failed to decode on other ranks (under "
            "data.on_bad_record: error, or a filesystem read error; the ranks that decoded them name the records)",
            own=False)


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
    bad_media: int = 0                 # media items replaced by zeros so far in this run (all ranks)
    moe: Optional[dict] = None         # an MoE LLM's moe_aux_loss, expert_load_max_over_mean (moe_metrics)
    stop: bool = False                 # some rank asked to stop after this step (mimo.training.stop)


class Trainer:
    def __init__(self, cfg: MimoConfig, runtime: Runtime):
        problems = layout_problems(cfg)
        if problems:  # before any collective
            raise ValueError("\n".join(problems))
        # First: exit_duration_minutes counts from here, and a signal received while the model is
        # built stops the run after its first step.
        self.stop = StopRequest(cfg.training)
        plan = build_plan(cfg)
        check_plan(plan)  # every rank's actions, proven to match; then this rank keeps its own
        self.plan = plan.of_rank(dist.get_rank())
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
        self.moe_metrics = None
        if cfg.model.language.is_moe:  # on every rank: the loss all-reduce carries its slots
            from .moe_metrics import MoEMetrics

            self.moe_metrics = MoEMetrics(cfg.model.language, lang_par.tp, lang_par.cp, llm,
                                          self.layer_offsets.get(LANGUAGE, 0), runtime.device)

        self.dataset = build_dataset(cfg)
        if hasattr(self.dataset, "defer_media_errors"):  # mock data decodes nothing
            # A decode failure under on_bad_record: error stops every rank after its step (check_media_errors).
            self.dataset.defer_media_errors()
        self.agreement = PlanAgreement(self.dataset, cfg.training.timeout_minutes)  # collective: a group over all ranks
        if self.agreement.group is not None and hasattr(self.dataset, "build_index"):
            # Collective: each rank tokenises 1/W of the records, so that none tokenises every step's.
            self.dataset.build_index(self.agreement.group)
        self.balancer = StepBalancer(cfg)
        self.held = [n for n in cfg.model.encoders if n in self.parts]
        # The encoders whose items this rank decodes: those of which it holds the first stage (later
        # stages receive activations). The TP ranks of a stage decode the same items: TP rank 0 (of the
        # LLM's grid in a homogeneous plan, where every rank decodes its own samples) counts bad ones.
        self.decoding = [n for n in self.held if self.topo.grid(n).coords["pp"] == 0]
        self.counting = [n for n in self.decoding
                         if self.topo.grid(LANGUAGE if self.homogeneous else n).coords["tp"] == 0
                         and self.topo.grid(LANGUAGE if self.homogeneous else n).coords["cp"] == 0]
        self.bad_media = 0  # over the run so far, summed over the ranks (the same on every rank)
        # step -> its boundary windows (heterogeneous plans) or its balancing assignment (homogeneous
        # ones), made once for the step's read-ahead, agreement and load; dropped once it is loaded.
        self._windows: Dict[int, object] = {}
        self._assignments: Dict[int, object] = {}
        if self.decoding:
            self.dataset.prefetch(self._prefetched, pin_memory=runtime.is_cuda)
        self.next_step = NextStep(runtime, self.step_data)  # step k + 1's data, loaded while step k runs
        self.offload = None
        if cfg.training.offload_encoders and self.colocated:
            self.offload = ParameterOffload([p for n in self.colocated if n in self.parts
                                             for p in self.parts[n].parameters()], runtime)
        # Every edge's local collectives run over its modules' own groups (no new process group).
        # Homogeneous plans have no edge: each rank feeds its own encoders' outputs to its LLM.
        self.comms = {} if self.homogeneous else {
            name: build_communicator(Layout.from_config(cfg.parallelism[name]), Layout.from_config(lang_par), None,
                                     cfg.model.language.hidden_size, self.dtype, device=runtime.device,
                                     module_groups=(self.topo.grid(name).groups, self.topo.grid(LANGUAGE).groups))
            for name in cfg.model.encoders}

    @property
    def optimizers(self):
        """module -> megatron-core optimizer, for the trainable module parts this rank holds."""
        return self.optim.optimizers

    def _prefetched(self, step: int) -> List[Tuple[str, int, int]]:
        """(encoder, sample, item) of the items this rank decodes in `step`, ahead of it."""
        return self._items(step, self.decoding)

    def _items(self, step: int, encoders: List[str]) -> List[Tuple[str, int, int]]:
        """(encoder, sample, item) of the items of `encoders` this rank's step data holds: in a
        homogeneous plan those of its own samples, else those it encodes."""
        if not self.homogeneous:
            return [(n, j, k) for n, ids in self._encoded(step).items() if n in encoders
                    for j, k in item_sources(self._planned(step), n, ids)]
        samples = self._planned(step)
        return [(n, j, k) for j in self._trained(step) for n in encoders for k in range(samples[j].count(n))]

    def _trained(self, step: int) -> List[int]:
        """Step sample indices of this rank's LLM microbatches (none on a rank without an LLM stage)."""
        return [i for mb in self._llm_microbatches(step) for i in mb]

    def _llm_microbatches(self, step: int) -> List[List[int]]:
        """Step sample indices of each of this rank's LLM microbatches."""
        g = self.topo.grid(LANGUAGE)
        if not g.is_member:
            return []
        if not self.homogeneous:
            return self._step_windows(step).llm_indices(g.coords["dp"])
        if self.balancer.policy == "none":
            tr = self.cfg.training
            return shard_indices(tr.global_batch_size, tr.micro_batch_size, g.coords["dp"], g.layout.dp)
        if step not in self._assignments:
            self._assignments[step] = self.balancer.assignment(self._planned(step), PAD_ID)
        return self._assignments[step].llm[g.coords["dp"]]

    def _planned(self, step: int) -> List:
        """The samples of `step` as planned (metadata only: nothing decoded, nothing taken)."""
        G = self.cfg.training.global_batch_size
        plan = getattr(self.dataset, "sample_plan", self.dataset.sample)
        return [plan(step * G + i) for i in range(G)]

    def _step_windows(self, step: int):
        """The windows of `step`, computed once for both its read-ahead and its run (`step_data` drops
        them once the step is loaded; the read-ahead only asks for steps not yet loaded)."""
        if step not in self._windows:
            self._windows[step] = step_windows(self.cfg, self._planned(step), self.balancer, self.comms,
                                               self.colocated)
        return self._windows[step]

    def _encoded(self, step: int) -> Dict[str, List[int]]:
        """Per encoder this rank decodes, the step item ids it encodes in `step`."""
        windows = self._step_windows(step)
        return {n: encoded_item_ids(windows, n, self.topo.grid(n).coords["dp"], self.colocated,
                                    self.num_microbatches) for n in self.decoding}

    def step_data(self, step: int) -> StepData:
        if self.agreement.checks(self.dataset):  # before any of the step's data moves
            self.agreement.check(step, *self._plan_locally(step))
        bad = getattr(self.dataset, "bad_media", {})  # mock data has none
        before = {n: bad.get(n, 0) for n in self.counting}
        data = self._load_step(step)
        data.bad_media = sum(bad.get(n, 0) - before[n] for n in self.counting)
        if hasattr(self.dataset, "take_media_errors"):  # mock data decodes nothing
            data.media_errors = self.dataset.take_media_errors()
        return data

    def _plan_locally(self, step: int) -> Tuple[int, Optional[BaseException]]:
        """(the digest of this rank's plan of `step`, None), with the tokens of its own sequences made
        (they must tokenise as the record index counted) and the records of the items it decodes read;
        or (0, the failure), which the agreement flags to the other ranks instead of leaving them
        waiting."""
        try:
            digest = self.dataset.plan_digest(step)
            # A homogeneous rank's microbatches hold every encoder's items of its samples.
            self.dataset.tokenise(step, self._trained(step),
                                  self._items(step, list(self.cfg.model.encoders) if self.homogeneous else self.decoding))
        except Exception as exc:  # local work only: the agreement's reduction runs outside, on every rank
            return 0, exc
        return digest, None

    def _load_step(self, step: int) -> StepData:
        lg = self.topo.grid(LANGUAGE)
        if self.homogeneous:
            shard = self._llm_microbatches(step)
            for done in [s for s in self._assignments if s <= step]:
                del self._assignments[done]
            return shard_step(self.cfg, self.dataset, shard, step, self.runtime.device, self.dtype)
        G = self.cfg.training.global_batch_size
        samples = [self.dataset.sample(step * G + i) for i in range(G)]  # takes the step's decoded-ahead items
        windows = self._step_windows(step)
        encoded = self._encoded(step)
        for done in [s for s in self._windows if s <= step]:
            del self._windows[done]
        return whole_step(self.cfg, step, samples, windows, encoded, lg.coords["dp"] if lg.is_member else None,
                          self.runtime.device, self.dtype)

    def forward_backward(self, step: int) -> float:
        """The step's forwards and backwards and its loss, without reductions or update (evaluation,
        logits): the plan through its `loss` collective, the same prefix on every rank."""
        self.optim.zero_grad()
        work = RankStep(self, self.next_step.take(step))
        with megatron_scope(self.runtime):
            run_plan(self.plan.through(LOSS), self.rank, work)
        loss = float(work.loss[LOSS_SLOT])
        check_media_errors(step, work.loss[MEDIA_ERROR_SLOT], work.data.media_errors)
        check_loss_tokens(step, work.data.n_tokens)
        return loss

    def close(self) -> None:
        """The training loop is over: the stop signal's previous handler back, and the background
        loader and the data workers ended. The workers ignore the stop signal, so they must end here:
        at the interpreter's exit, Python would stop them with that signal and wait for them forever."""
        self.stop.close()
        self.next_step.close()
        if hasattr(self.dataset, "close"):  # mock data has no workers
            self.dataset.close()

    def train_step(self, step: int) -> StepResult:
        synchronize(self.runtime)
        start = time.perf_counter()
        self.timer.reset()
        self.optim.zero_grad()
        lr = self.optim.lr
        data = self.next_step.take(step)
        work = RankStep(self, data)
        if step + 1 < self.cfg.training.train_iters:
            self.next_step.start(step + 1)
        with megatron_scope(self.runtime):
            run_plan(self.plan, self.rank, work)
        # This rank's share of the step's FLOP count (host work, own microbatches only), summed inside
        # reduce_step's all-reduce.
        lg = self.topo.grid(LANGUAGE)
        share = rank_work(self.cfg, lg.coords if lg.is_member else None, data.llm_batches)
        # The dataset is the loader's until it is done (the metrics and a save read it next).
        self.next_step.settle()
        self.optim.end_step()
        # The step's one read from the device: the loss sum's slots, the gradient norm, the loss tokens.
        read = torch.cat([work.loss, work.grad_norm.reshape(1).double(), data.n_tokens.reshape(1)]).tolist()
        slots, norm, n_tokens = read[:-2], read[-2], int(read[-1])
        loss = slots[LOSS_SLOT]
        self.bad_media += int(slots[BAD_MEDIA_SLOT])
        stop = slots[STOP_SLOT] > 0
        moe = self.moe_metrics.summarize(slots[MOE_SLOTS:]) if self.moe_metrics is not None else None
        check_media_errors(step, slots[MEDIA_ERROR_SLOT], data.media_errors)
        check_loss_tokens(step, n_tokens)
        synchronize(self.runtime)
        elapsed = time.perf_counter() - start
        tr = self.cfg.training
        # Records the data side skipped so far (cumulative; mock data skips none).
        times = reduce_step(self.timer, self.cfg, self.runtime, self.dataset.skipped_samples(step), share)
        return StepResult(step, loss, norm, tr.global_batch_size * self.cfg.data.seq_length, n_tokens,
                          elapsed, times, lr, self.bad_media, moe, stop)
