"""Training for the layouts mimo can run today.

* every module on one shared layout with PP = 1 (each rank holds a TP shard
  of every module for its DP shard of the batch), or
* a text-only model (no encoders) with any TP x CP x DP x PP: the LLM's
  stages driven by the 1F1B engine of mimo.schedule, its sequence dealt to
  CP ranks in balanced blocks (mimo.attention's CP plumbing).

Per-module layouts (different rank ranges or shapes) need the boundary
communicators of mimo.comm in the schedule and are refused with a clear
message until they are wired in.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo.attention import enable_context_parallel_rope, plan_context_parallel, shard_microbatch
from mimo.balance.step import StepBalancer
from mimo.config import LANGUAGE, MimoConfig
from mimo.data import PAD_ID, build_dataset, collate, move, shard_indices
from mimo.hf import check_hf_weights, hf_modules, load_hf_part
from mimo.model import MultimodalModel, build_encoder, build_llm, encode
from mimo.model.reference_init import load_shard
from mimo.model.sharded_init import init_sharded
from mimo.model.transformer_config import dtype_of
from mimo.model.sequence_parallel import shard_len
from mimo.model.stages import build_llm_stage, stage_layer_offset
from mimo.runtime import Runtime, StepTimer, synchronize
from mimo.schedule.check import check_plan
from mimo.schedule.one_f_one_b import run_1f1b
from mimo.schedule.p2p import StagePeers
from mimo.schedule.plan import build_plan
from mimo.topology import Topology, build_topology

from .metrics import StepTimes, reduce_step
from .optimizer import ModelOptimizer, trainable


def unsupported_layout(cfg: MimoConfig) -> List[str]:
    """Why this trainer cannot run the layout (empty when it can), as `path: reason` lines."""
    problems = []
    lang = cfg.parallelism[LANGUAGE]
    for name, p in cfg.parallelism.items():
        if (p.tp, p.cp, p.pp, p.dp, p.ep, p.rank_offset) != (lang.tp, lang.cp, lang.pp, lang.dp, lang.ep,
                                                             lang.rank_offset):
            problems.append(f"parallelism.{name}: per-module layouts that differ from parallelism.language "
                            "are not supported by this trainer yet (heterogeneous schedules are pending)")
    if lang.pp != 1 and cfg.model.encoders:
        problems.append("parallelism.language.pp: pipeline parallelism with encoders needs the heterogeneous "
                        "schedules, which are pending (text-only models support any pp)")
    if lang.cp != 1 and cfg.model.encoders:
        problems.append("parallelism.language.cp: context parallelism with encoders needs the heterogeneous "
                        "schedules (encoders keep cp = 1), which are pending (text-only models support any cp)")
    return problems


def module_seed(seed: int, module: str) -> int:
    """Each module is initialised from its own seed, so its weights do not depend on
    which other modules a rank builds (or in which order)."""
    return (seed * 1_000_003 + zlib.crc32(module.encode())) % (2 ** 63)


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


class TrainerBase:
    """What every mimo trainer shares: initialisation of a module part, the optimizer
    step (per-module gradient reduction, the global norm, per-module optimizers) and timing.
    Subclasses call `_start`, build `parts`, call `_build_optimizer` and provide
    `forward_backward`."""

    def _start(self, cfg: MimoConfig, runtime: Runtime, problems: List[str]) -> None:
        """Refuse a layout the subclass cannot run (before any collective), then build the topology."""
        if problems:
            raise ValueError("\n".join(problems))
        check_plan(build_plan(cfg))  # a plan that would deadlock stops here, naming ranks and actions
        self.cfg, self.runtime = cfg, runtime
        self.dtype = dtype_of(cfg.training.precision)
        # HF weights: every rank checks every needed tensor before building anything.
        self.hf_modules = hf_modules(cfg)
        self.hf_sources = check_hf_weights(cfg)
        self.topo: Topology = build_topology(cfg, backend=runtime.backend)
        # Spans of the schedule's actions in the current step (module times, timeline).
        self.timer = StepTimer(runtime)

    def _timed(self, module: str, action: str, fn):
        """fn(mb, ...) recorded as a span of `module`'s `action` (F / B / comm) for microbatch mb."""
        def run(mb, *args):
            with self.timer.span(module, action, mb):
                return fn(mb, *args)
        return run

    def _init(self, name: str, build, pgs: ProcessGroupCollection, layer_offset: int = 0) -> torch.nn.Module:
        """Build this rank's part of a module, initialised as `training.init` says.

        `layer_offset`: global index of the part's first layer (pipeline stages).
        """
        seed = module_seed(self.cfg.training.seed, name)
        torch.manual_seed(seed)
        part = build(pgs)  # under `sharded` megatron leaves the weights unset (see initialized_by_megatron)
        grid = self.topo.grid(name)
        tp_rank, tp_size = grid.coords["tp"], grid.layout.tp
        hf = self.hf_modules.get(name)
        init = self.cfg.training.init
        if not (hf and hf.complete):  # a module wholly loaded from HF needs no initial weights
            if init == "sharded":
                init_sharded(part, self.cfg, name, layer_offset, tp_rank, tp_size)
            elif init == "reference":
                torch.manual_seed(seed)
                full = self._reference_module(name)
                load_shard(part, full.state_dict(keep_vars=False), layer_offset, tp_rank, tp_size)
        if hf:
            load_hf_part(part, hf, self.hf_sources[hf.directory], layer_offset, tp_rank, tp_size)
        return part

    def _reference_module(self, name: str) -> torch.nn.Module:
        """The whole module, unsharded, built on this rank alone from the module's seed."""
        me = self.topo.self_group
        pgs = ProcessGroupCollection()
        for key in ("tp", "cp", "pp", "dp", "ep", "tp_cp", "dp_cp", "tp_dp_cp", "mp", "embd", "pos_embd",
                    "expt_tp", "tp_ep", "expt_dp"):
            setattr(pgs, key, me)
        layout = self.topo.grid(name).layout.__class__()  # every size 1
        if name == LANGUAGE:
            return build_llm(self.cfg, layout, pgs)
        return build_encoder(self.cfg, name, layout, pgs)

    def _build_optimizer(self) -> None:
        """Per-module DDP wrappers and megatron optimizers over this rank's `parts` (frozen: none)."""
        self.params = {name: trainable(m.parameters()) for name, m in self.parts.items()}
        self.optim = ModelOptimizer(self.cfg, self.parts, self.topo, self.runtime)

    @property
    def optimizers(self):
        """module -> megatron-core optimizer, for the trainable module parts this rank holds."""
        return self.optim.optimizers

    def train_step(self, step: int) -> StepResult:
        synchronize(self.runtime)
        start = time.perf_counter()
        self.timer.reset()
        self.optim.zero_grad()
        lr = self.optim.lr
        loss, n_tokens = self.forward_backward(step)
        norm = float(self.optim.step())
        synchronize(self.runtime)
        elapsed = time.perf_counter() - start
        tr = self.cfg.training
        # Records the data side skipped so far (cumulative; mock data skips none).
        times = reduce_step(self.timer, self.cfg, self.runtime, self.dataset.metrics(step)["skipped_samples"])
        return StepResult(step, loss, norm, tr.global_batch_size * self.cfg.data.seq_length, n_tokens,
                          elapsed, times, lr)


class Trainer(TrainerBase):
    def __init__(self, cfg: MimoConfig, runtime: Runtime):
        self._start(cfg, runtime, unsupported_layout(cfg))
        self.grid = self.topo.grid(LANGUAGE)
        c = self.grid.coords
        self.stage, self.num_stages = c["pp"], self.grid.layout.pp
        lang_par = cfg.parallelism[LANGUAGE]
        # Global index of this stage's first LLM layer, per module (names in full-state dicts).
        self.layer_offsets = {LANGUAGE: stage_layer_offset(cfg.model.language.num_layers, lang_par, self.stage)}

        self.parts: Dict[str, torch.nn.Module] = {}
        for name in cfg.model.encoders:
            g = self.topo.grid(name)
            self.parts[name] = self._init(name, lambda pgs, g=g, name=name: build_encoder(cfg, name, g.layout, pgs),
                                          g.pg_collection())
            self.layer_offsets[name] = 0
        if self.num_stages == 1:
            llm = self._init(LANGUAGE, lambda pgs: build_llm(cfg, self.grid.layout, pgs), self.grid.pg_collection())
        else:
            llm = self._init(LANGUAGE, lambda pgs, stage=self.stage: build_llm_stage(
                cfg, lang_par, self.grid.layout, stage, pgs, self.topo.self_group), self.grid.pg_collection(),
                self.layer_offsets[LANGUAGE])
        self.parts[LANGUAGE] = llm
        self.cp = self.grid.layout.cp
        if self.cp > 1:
            # RoPE at each token's global position, whatever slots CP gave it.
            enable_context_parallel_rope(llm)
        for m in self.parts.values():
            m.to(runtime.device)
        self.model = MultimodalModel(cfg, {n: self.parts[n] for n in cfg.model.encoders}, llm)
        self._build_optimizer()
        self.dataset = build_dataset(cfg)
        self.balancer = StepBalancer(cfg)
        tr, mine = cfg.training, self.grid.coords["dp"]
        shard = [i for mb in shard_indices(tr.global_batch_size, tr.micro_batch_size, mine, self.grid.layout.dp)
                 for i in mb]
        if self.balancer.policy != "none":  # the step's order decides the shard: every rank sizes every sample
            shard = list(range(tr.global_batch_size))
        self.dataset.prefetch(lambda step: shard, pin_memory=runtime.device.type == "cuda")

    # -- construction ---------------------------------------------------------------------------

    # -- one step -------------------------------------------------------------------------------

    def microbatches(self, step: int):
        tr, c = self.cfg.training, self.grid.coords
        G = tr.global_batch_size
        order = (None if self.balancer.policy == "none"
                 else self.balancer.order([self.dataset.sample(step * G + i) for i in range(G)], PAD_ID))
        for idx in shard_indices(G, tr.micro_batch_size, c["dp"], self.grid.layout.dp):
            samples = [self.dataset.sample(step * G + (i if order is None else order[i])) for i in idx]
            yield move(collate(samples, self.cfg.placeholder_ids), self.runtime.device, self.dtype)

    def forward_backward(self, step: int):
        """Accumulate this rank's gradients for one global batch; returns (loss, loss tokens)."""
        batches = list(self.microbatches(step))
        n_tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
        # CP ranks of a DP shard hold the same samples: count over DP only.
        dist.all_reduce(n_tokens, group=self.grid.groups["dp"])
        if n_tokens.item() == 0:
            raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.runtime.device)

        def loss_of(per_token, b):
            # Normalised by the global batch's token count: the DP sum of these
            # gradients is then exactly the single-rank per-token mean.
            loss = (per_token.float() * b["loss_mask"]).sum() / n_tokens.float()
            nonlocal loss_sum
            loss_sum += loss.detach().double()
            return loss

        if self.num_stages == 1 and self.cp == 1:
            for mb, b in enumerate(batches):
                self._microbatch(mb, b, loss_of)
        else:
            self._pipeline(batches, loss_of)
        # Only the last stage's TP-rank-0 ranks hold the loss; one world sum gives the global loss.
        last = self.stage == self.num_stages - 1 and self.grid.coords["tp"] == 0
        total = loss_sum if last else torch.zeros_like(loss_sum)
        dist.all_reduce(total)
        return float(total), int(n_tokens.item())

    def _microbatch(self, mb: int, b, loss_of) -> None:
        """Forward and backward of one microbatch through every module, timed per module.

        One backward call covers all modules; the LLM's part of it ends when the gradient
        reaches the first encoder output, each encoder's part starts when its own output's
        gradient arrives (an approximate split: autograd may interleave encoders)."""
        t = self.timer
        tokens = {}
        for name in self.cfg.model.encoders:
            with t.span(name, "F", mb):
                tokens[name] = encode(self.model.encoders[name], b.get(name))
        with t.span(LANGUAGE, "F", mb):
            loss = loss_of(self.model(b, tokens), b)
        arrivals = []
        for name, y in tokens.items():
            if y.requires_grad:
                y.register_hook(lambda g, name=name: arrivals.append((name, t.now())))
        start = t.now()
        loss.backward()
        end = t.now()
        marks = [(LANGUAGE, start)] + arrivals + [(None, end)]
        for (name, a), (_, b_) in zip(marks, marks[1:]):
            t.add(name, "B", mb, a, b_)

    def _cp_local(self, b):
        """This CP rank's slots of a microbatch: the assignment is computed from the
        mask alone, identically on every CP rank and every pipeline stage."""
        lang = self.cfg.model.language
        mask = self.model.attention_mask(b["input_ids"], b.get("document_ids"))
        bits = mask.bits
        slots = plan_context_parallel(bits, self.cp, lang.cp_block_size, lang.cp_policy)
        return shard_microbatch(slots, self.grid.coords["cp"], bits=bits, document_ids=mask.document_ids,
                                input_ids=b["input_ids"],
                                position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"])

    def _pipeline(self, batches, loss_of) -> None:
        """Text-only LLM over its pipeline stages (1F1B) and/or context-parallel ranks."""
        llm, lay, c = self.parts[LANGUAGE], self.grid.layout, self.grid.coords
        views = [self._cp_local(b) for b in batches] if self.cp > 1 else [
            {**b, "attention_mask": self.model.attention_mask(b["input_ids"], b.get("document_ids"))}
            for b in batches]
        hidden = self.cfg.model.language.hidden_size
        shape = lambda mb: (shard_len(views[mb]["input_ids"].shape[1], llm.config),  # noqa: E731
                            views[mb]["input_ids"].shape[0], hidden)
        neighbour = lambda s: lay.rank(**{**c, "pp": s})  # noqa: E731
        peers = StagePeers(neighbour(self.stage - 1) if self.stage > 0 else None,
                           neighbour(self.stage + 1) if self.stage < self.num_stages - 1 else None,
                           shape, self.dtype, self.runtime.device)
        last = self.stage == self.num_stages - 1

        def forward_step(mb: int, x: Optional[torch.Tensor]) -> torch.Tensor:
            v = views[mb]
            labels = v["labels"] if last else None
            if x is None:  # first stage embeds
                out = llm(input_ids=v["input_ids"], position_ids=v["position_ids"],
                          attention_mask=v["attention_mask"], labels=labels)
            else:
                llm.set_input_tensor(x)
                out = llm(input_ids=None, position_ids=v["position_ids"], attention_mask=v["attention_mask"],
                          labels=labels)
            return loss_of(out, v) if last else out

        run_1f1b(len(batches), self.stage, self.num_stages, peers, forward_step,
                 span=lambda action, mb: self.timer.span(LANGUAGE, action, mb))
