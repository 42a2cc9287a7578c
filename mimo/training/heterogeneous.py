"""Training with per-module layouts: encoders on their own layouts, colocated or not with the LLM.

* non-colocated encoders (ranks disjoint from the LLM's): the module graph is
  expanded into pipeline-stage nodes and every rank runs 1F1B over its node
  (mimo.schedule.graph); boundary communicators move one LLM microbatch's
  items per call, divided over the encoder's DP ranks by tokens. Encoders that share a rank range among
  themselves run their nodes in lock-step on those ranks (mimo.schedule.fused),
  or, with different pp, all forwards then all backwards (an island, `run_island`).
* colocated encoders (on the LLM's ranks, under a different logical grid): the
  three-phase schedule (mimo.schedule.three_phase): the step's items, in
  LLM-major sample order, are divided over the encoder's DP ranks by tokens
  and move in one call; a pipelined encoder streams its items through its
  stages in one chunk per LLM microbatch.
* both kinds in one model: the LLM ranks run the three-phase schedule for the
  colocated encoders, and in phase 2 the LLM's first stage also joins the live
  boundary communicators of the non-colocated ones.

Same interface and numerics as mimo.training.trainer.Trainer: layout-independent
initialisation, loss normalised by the global batch's loss-token count, per-module
DP(x CP) gradient sums and optimizers, one global gradient norm.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from mimo.attention import enable_context_parallel_rope, plan_context_parallel, shard_microbatch
from mimo.balance.step import StepBalancer
from mimo.comm import build_communicator
from mimo.config import LANGUAGE, MimoConfig, placement
from mimo.data import PAD_ID, build_dataset, collate, move, shard_indices
from mimo.data.items import divide_items, sample_item_bounds
from mimo.model import MultimodalModel, assemble_embeddings, build_encoder, build_llm, encode, llm_loss
from mimo.model.encoder_stages import build_encoder_stage
from mimo.model.multimodal import embed_text
from mimo.model.sequence_parallel import llm_input_layout, shard_len
from mimo.model.stages import build_llm_stage, stage_layer_offset
from mimo.runtime import ParameterOffload, Runtime
from mimo.schedule.fused import Member, fuse
from mimo.schedule.graph import Node, UpstreamUnion, run_node, stage_nodes
from mimo.schedule.noncolocated import BoundaryJoin, BoundarySource, StageLink, run_island
from mimo.schedule.three_phase import SlicedBoundary, StagedPass, WholePass, microbatch_offsets, run_three_phase
from mimo.topology import Layout

from .trainer import Trainer, TrainerBase, unsupported_layout

COLOCATED, NON_COLOCATED = "colocated", "non-colocated"


def make_trainer(cfg: MimoConfig, runtime: Runtime):
    """The homogeneous Trainer where it can run the layout, else the heterogeneous one."""
    return Trainer(cfg, runtime) if not unsupported_layout(cfg) else HeterogeneousTrainer(cfg, runtime)


def layout_problems(cfg: MimoConfig) -> List[str]:
    """Why no mimo trainer can run the layout (empty when one can), as `path: reason` lines."""
    return [] if not unsupported_layout(cfg) else heterogeneous_problems(cfg)


def heterogeneous_problems(cfg: MimoConfig) -> List[str]:
    """Why HeterogeneousTrainer cannot run the layout (empty when it can), as `path: reason` lines.

    Every layout the config contract accepts runs; these checks repeat the contract's
    rules the schedules rely on, for configs built without `mimo.config.validate`."""
    problems = []
    par = cfg.parallelism
    lang = par[LANGUAGE]
    if lang.ep != 1:
        problems.append("parallelism.language.ep: expert parallelism is not supported at the encoder boundary")
    for name in cfg.model.encoders:
        p = par[name]
        if p.cp != 1 or p.ep != 1:
            problems.append(f"parallelism.{name}.cp: encoders must use cp = 1 and ep = 1")
    return problems


def island_encoders(cfg: MimoConfig) -> List[str]:
    """Non-colocated encoders on a rank range shared with a non-colocated encoder of another pp.

    Their ranks hold stage nodes of different warm-ups, so they run all forwards, then all
    backwards (`run_island`) instead of 1F1B. Ranges are identical or disjoint (config contract).
    """
    par, lang = cfg.parallelism, cfg.parallelism[LANGUAGE]
    remote = [n for n in cfg.model.encoders if placement(par[n], lang) == NON_COLOCATED]
    out = []
    for a in remote:
        if any(par[b].ranks == par[a].ranks and par[b].pp != par[a].pp for b in remote):
            out.append(a)
    return out


def tokens_per_item(cfg: MimoConfig, name: str) -> int:
    enc = cfg.model.encoders[name]
    if enc.kind == "vision":
        return (enc.image_size // enc.patch_size) ** 2
    return enc.clip_frames // enc.frames_per_token


def encoder_trainable(cfg: MimoConfig, name: str) -> bool:
    """Whether any gradient must cross the encoder's boundary (known on both sides from the config)."""
    enc = cfg.model.encoders[name]
    return not (enc.frozen and enc.projector.frozen)


class TimedComm:
    """A boundary communicator whose calls are recorded as `comm` spans of the encoder's edge."""

    def __init__(self, comm, timer, name: str):
        self.comm, self.timer, self.name = comm, timer, name
        self.calls = 0

    def __getattr__(self, key):  # received_counts and the rest
        return getattr(self.comm, key)

    def _run(self, fn, *args):
        with self.timer.span(self.name, "comm", self.calls):
            self.calls += 1
            return fn(*args)

    def forward(self, tensor, counts, window=None):
        return self._run(self.comm.forward, tensor, counts, window)

    def backward(self, grad):
        return self._run(self.comm.backward, grad)


class TimedPass:
    """A three-phase encoder pass (WholePass / StagedPass) whose phases are recorded as F / B spans."""

    def __init__(self, inner, timer, name: str):
        self.inner, self.timer, self.name = inner, timer, name

    def forward(self):
        with self.timer.span(self.name, "F", 0):
            return self.inner.forward()

    def backward(self, grad) -> None:
        with self.timer.span(self.name, "B", 0):
            self.inner.backward(grad)


class HeterogeneousTrainer(TrainerBase):
    def __init__(self, cfg: MimoConfig, runtime: Runtime):
        self._start(cfg, runtime, heterogeneous_problems(cfg))
        self.encoders = list(cfg.model.encoders)
        lang_par = cfg.parallelism[LANGUAGE]
        kind = {n: placement(cfg.parallelism[n], lang_par) for n in self.encoders}
        self.colocated = [n for n in self.encoders if kind[n] == COLOCATED]
        self.remote = [n for n in self.encoders if kind[n] == NON_COLOCATED]
        self.island = island_encoders(cfg)
        self.llm_grid = self.topo.grid(LANGUAGE)
        tr = cfg.training
        self.num_microbatches = tr.global_batch_size // (tr.micro_batch_size * lang_par.dp)
        self.trainable_edge = {n: encoder_trainable(cfg, n) for n in self.encoders}
        self.on_boundary_grad = None  # tests: tamper with a boundary gradient (name, grad) -> grad

        self.parts: Dict[str, torch.nn.Module] = {}
        self.layer_offsets: Dict[str, int] = {}
        for name in self.encoders:
            g = self.topo.grid(name)
            if g.is_member:
                par, stage = cfg.parallelism[name], g.coords["pp"]
                offset = stage_layer_offset(cfg.model.encoders[name].num_layers, par, stage)
                if g.layout.pp == 1:
                    build = lambda pgs, g=g, name=name: build_encoder(cfg, name, g.layout, pgs)  # noqa: E731
                else:
                    build = lambda pgs, g=g, name=name, par=par, stage=stage: build_encoder_stage(  # noqa: E731
                        cfg, name, par, g.layout, stage, pgs, self.topo.self_group)
                self.parts[name] = self._init(name, build, g.pg_collection(), offset)
                self.layer_offsets[name] = offset
        if self.llm_grid.is_member:
            lay, stage = self.llm_grid.layout, self.llm_grid.coords["pp"]
            offset = stage_layer_offset(cfg.model.language.num_layers, lang_par, stage)
            if lay.pp == 1:
                build = lambda pgs: build_llm(cfg, lay, pgs)  # noqa: E731
            else:
                build = lambda pgs: build_llm_stage(cfg, lang_par, lay, stage, pgs, self.topo.self_group)  # noqa: E731
            self.parts[LANGUAGE] = self._init(LANGUAGE, build, self.llm_grid.pg_collection(), offset)
            self.layer_offsets[LANGUAGE] = offset
            self._masker = MultimodalModel(cfg, {}, self.parts[LANGUAGE])
            if lay.cp > 1:
                # RoPE at each token's global position, whatever slots CP gave it.
                enable_context_parallel_rope(self.parts[LANGUAGE])
        for m in self.parts.values():
            m.to(runtime.device)
        self._build_optimizer()
        self.dataset = build_dataset(cfg)
        self.balancer = StepBalancer(cfg)
        self._order = None  # data.balance: step sample index of each trainer position (None: identity)
        self.dataset.prefetch(lambda step, mine=self._encoded_indices(): mine,
                              pin_memory=runtime.device.type == "cuda", encoders=self._held_encoders)
        self.offload = None
        if tr.offload_encoders and self.colocated:
            self.offload = ParameterOffload([p for n in self.colocated if n in self.parts
                                             for p in self.parts[n].parameters()], runtime)

        # Collective: every rank builds every edge, in config order. A colocated edge moves
        # the step's items at once (phase 1), a non-colocated one an LLM microbatch's per call;
        # each call gets the plan of its window's items (`_window`).
        self.comms = {name: build_communicator(Layout.from_config(cfg.parallelism[name]), Layout.from_config(lang_par),
                                               None, cfg.model.language.hidden_size, self.dtype,
                                               device=runtime.device)
                      for name in self.encoders}
        self.comms = {name: TimedComm(c, self.timer, name) for name, c in self.comms.items()}

    def _batch(self, step: int, indices, items: bool = True) -> Dict[str, torch.Tensor]:
        """The samples' batch; `items=False`: without encoder inputs (LLM side: no image is decoded)."""
        G = self.cfg.training.global_batch_size
        samples = [self.dataset.sample(step * G + i) for i in indices]
        return move(collate(samples, self.cfg.placeholder_ids, items), self.runtime.device, self.dtype)

    @property
    def _held_encoders(self) -> List[str]:
        return [n for n in self.encoders if n in self.parts]

    @property
    def _holds_encoder(self) -> bool:
        return bool(self._held_encoders)

    def _encoded_indices(self) -> List[int]:
        """Samples (indices within a step) whose items this rank may encode: with encoder DP over
        items the division depends on the step's item counts, so an encoder rank prefetches the
        whole step and a rank without an encoder none."""
        return list(range(self.cfg.training.global_batch_size)) if self._holds_encoder else []

    def _token_counts(self, batch, name: str) -> torch.Tensor:
        return batch[f"{name}_counts"].to(torch.int64) * tokens_per_item(self.cfg, name)

    def _placed(self, positions: List[int]) -> List[int]:
        """Step sample indices at trainer positions (data.balance reorders the step)."""
        return positions if self._order is None else [self._order[p] for p in positions]

    def _llm_indices(self) -> List[List[int]]:
        tr, c = self.cfg.training, self.llm_grid.coords
        return [self._placed(mb) for mb in
                shard_indices(tr.global_batch_size, tr.micro_batch_size, c["dp"], self.llm_grid.layout.dp)]

    def _window_order(self, name: str, mb: int) -> List[int]:
        """The samples of a boundary window, in the order the LLM DP shards hold them (shard-major).

        Non-colocated: LLM microbatch mb (window of m * dL samples). Colocated (mb ignored): the
        whole step in LLM-major order, so that LLM DP shard j receives its own microbatches
        back to back."""
        tr, dL = self.cfg.training, self.cfg.parallelism[LANGUAGE].dp
        if name in self.colocated:
            return self._placed([i for j in range(dL)
                                 for m in shard_indices(tr.global_batch_size, tr.micro_batch_size, j, dL) for i in m])
        W = tr.micro_batch_size * dL
        return self._placed(list(range(mb * W, (mb + 1) * W)))

    def _window(self, name: str, mb: int = 0):
        """(edge plan, step-batch item ids in window order) of one boundary window of `name`.

        Every rank derives it from the step's data alone: the window's items, in batch order,
        are divided over the encoder's DP ranks by tokens (`divide_items`); LLM DP shard j
        owns the items of its samples."""
        key = (name, mb)
        if key not in self._windows:
            counts = self._item_counts[name]
            first = [0]
            for c in counts:
                first.append(first[-1] + int(c))
            order = self._window_order(name, mb)
            ids = [first[s] + k for s in order for k in range(int(counts[s]))]
            dE, dL = self.cfg.parallelism[name].dp, self.cfg.parallelism[LANGUAGE].dp
            per_shard = len(order) // dL
            src = divide_items([tokens_per_item(self.cfg, name)] * len(ids), dE)
            dst = sample_item_bounds([counts[s] for s in order], [j * per_shard for j in range(dL + 1)])
            self._windows[key] = (self.comms[name].plan.for_window(src, dst), ids)
        return self._windows[key]

    def _encoder_items(self, name: str, mb: int = 0, chunk: slice = slice(None)):
        """{name: raw inputs} of this encoder rank's items of a window (optionally one chunk of them)."""
        plan, ids = self._window(name, mb)
        a, b = plan.src_interval(self.topo.grid(name).coords["dp"])
        mine = ids[a:b][chunk]
        return {name: self._step_batch[name][torch.tensor(mine, dtype=torch.long, device=self.runtime.device)]}

    def _unit_counts(self, name: str, items: int) -> torch.Tensor:
        """Per-item token counts of a packed boundary tensor of `items` items."""
        return torch.full((items,), tokens_per_item(self.cfg, name), dtype=torch.int64, device=self.runtime.device)

    # -- one step ---------------------------------------------------------------------------

    def forward_backward(self, step: int):
        G = self.cfg.training.global_batch_size
        # Every rank can load any sample, so the global normaliser needs no communication.
        # A rank collates (and so decodes) only the items of the encoders it holds.
        samples = [self.dataset.sample(step * G + i) for i in range(G)]
        self._order = self.balancer.order(samples, PAD_ID)
        host = collate(samples, self.cfg.placeholder_ids, self._held_encoders)
        # Item counts per sample, on the host: every rank plans the step's boundary windows from them.
        self._item_counts = {n: host[f"{n}_counts"].tolist() for n in self.encoders}
        self._step_batch = move(host, self.runtime.device, self.dtype)
        self._windows = {}
        n_tokens = float(self._step_batch["loss_mask"].sum())
        if n_tokens == 0:
            raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        self._n_tokens = n_tokens
        if self.llm_grid.is_member:
            self._run_llm_rank(step)
        else:
            self._run_encoder_rank(step)
        is_last = (self.llm_grid.is_member and self.llm_grid.is_last_stage and self.llm_grid.coords["tp"] == 0)
        total = self._loss_sum if is_last else torch.zeros_like(self._loss_sum)
        dist.all_reduce(total)
        return float(total), int(n_tokens)

    # LLM stage node (shared by both placements) -----------------------------------------------

    def _llm_node(self, step: int, up, run_warmup: bool = True):
        llm, g = self.parts[LANGUAGE], self.llm_grid
        stage, pp = g.coords["pp"], g.layout.pp
        last = stage == pp - 1
        indices = self._llm_indices()
        cache: Dict[int, Dict[str, torch.Tensor]] = {}
        placeholders = self.cfg.placeholder_ids
        bitfield = self.cfg.model.language.attention == "bitfield"

        cp, cp_rank = g.layout.cp, g.coords["cp"]
        lang = self.cfg.model.language

        def cp_view(b, decoder_input=None):
            """This CP rank's balanced slots of the microbatch (the same plan on every stage)."""
            bits = b["attention_mask"].bits
            slots = plan_context_parallel(bits, cp, lang.cp_block_size, lang.cp_policy)
            return shard_microbatch(slots, cp_rank, bits=bits, document_ids=b["attention_mask"].document_ids,
                                    input_ids=b["input_ids"],
                                    position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"],
                                    decoder_input=decoder_input)

        def batch(mb):
            if mb not in cache:
                b = self._batch(step, indices[mb], items=False)
                if bitfield:
                    b["attention_mask"] = self._masker.attention_mask(b["input_ids"], b.get("document_ids"))
                if cp > 1:
                    b = {**cp_view(b), "full": b}
                cache[mb] = b
            return cache[mb]

        def forward_step(mb, x):
            b = batch(mb)
            labels = b["labels"] if last else None
            tokens_by_id = {placeholders[n]: t for n, t in x.items()} if stage == 0 else None
            if stage == 0 and cp > 1:
                # Assemble the whole fused sequence (every CP rank received the whole
                # boundary shard), then keep this rank's slots of it.
                full = b["full"]
                text = embed_text(llm, full["input_ids"], full["position_ids"])
                fused = assemble_embeddings(text.transpose(0, 1), full["input_ids"], tokens_by_id)
                local = cp_view(full, fused.transpose(0, 1).contiguous())
                out = llm(input_ids=local["input_ids"], position_ids=local["position_ids"],
                          attention_mask=local["attention_mask"],
                          decoder_input=llm_input_layout(llm, local["decoder_input"]), labels=labels)
            elif stage == 0:
                out = llm_loss(llm, {**b, "labels": labels}, tokens_by_id)
            else:
                llm.set_input_tensor(x)
                out = llm(input_ids=None, position_ids=b["position_ids"], attention_mask=b.get("attention_mask"),
                          labels=labels)
            if not last:
                return out
            cache.pop(mb, None)
            loss = (out.float() * b["loss_mask"]).sum() / self._n_tokens
            self._loss_sum += loss.detach().double()
            return loss

        def backward_step(mb, x, y, grad):
            if grad is None:
                y.backward()
            else:
                torch.autograd.backward(y, grad_tensors=grad)
            if stage == 0:
                return {n: (t.grad if t.grad is not None else torch.zeros_like(t))
                        for n, t in x.items() if self.trainable_edge[n]}
            return x.grad if x.grad is not None else torch.zeros_like(x)

        shape = lambda mb: (shard_len(batch(mb)["input_ids"].shape[1], llm.config),  # noqa: E731
                            self.cfg.training.micro_batch_size, self.cfg.model.language.hidden_size)
        neighbour = lambda s: g.layout.rank(**{**g.coords, "pp": s})  # noqa: E731
        link = StageLink(neighbour(stage - 1) if stage > 0 else None, neighbour(stage + 1) if not last else None,
                         shape, shape, self.dtype, self.runtime.device)
        if stage > 0:
            up = link
        down = link if not last else None
        run_node(self.num_microbatches, pp - 1 - stage, up, down, self._timed(LANGUAGE, "F", forward_step),
                 self._timed(LANGUAGE, "B", backward_step))

    def _run_llm_rank(self, step: int) -> None:
        join = None
        if self.llm_grid.coords["pp"] == 0 and self.remote:
            def expect(mb):
                out = {}
                for n in self.remote:
                    plan, _ = self._window(n, mb)
                    a, b = plan.dst_interval(self.llm_grid.coords["dp"])
                    out[n] = (plan, self._unit_counts(n, b - a))
                return out

            join = BoundaryJoin([(n, self.comms[n], self.trainable_edge[n]) for n in self.remote], expect,
                                self.on_boundary_grad, all_at_once=self.island,
                                num_microbatches=self.num_microbatches)
        if not self.colocated:
            return self._llm_node(step, join)
        m = self.cfg.training.micro_batch_size

        def llm_phase(received, counts):
            ports, sliced = [], None
            if received:  # a first LLM stage: the colocated boundary tensors arrived in phase 1
                mine = [i for mb in self._llm_indices() for i in mb]  # this shard's samples, in order
                offsets = {n: microbatch_offsets(self._token_counts(self._step_batch, n)[mine], m)
                           for n in received}
                sliced = SlicedBoundary(received, offsets, self.trainable_edge)
                ports.append((list(received), sliced))
            if join is not None:
                ports.append((self.remote, join))
            self._llm_node(step, UpstreamUnion(ports) if ports else None)
            return sliced

        edges = [(n, self.comms[n], self.trainable_edge[n]) for n in self.colocated]
        passes = {n: TimedPass(self._colocated_pass(step, n), self.timer, n) for n in self.colocated}
        run_three_phase(edges, passes, llm_phase, offload=self.offload, on_grad=self.on_boundary_grad,
                        windows={n: self._window(n)[0] for n in self.colocated})

    # Encoder stages (shared by both placements) -----------------------------------------------

    def _stage(self, name: str, batch_of):
        """forward_step(mb, x), the StageLink to the neighbouring stages, first, last of this rank's
        stage of `name`; batch_of(mb) -> the collated samples of unit mb (microbatch or chunk)."""
        part, g = self.parts[name], self.topo.grid(name)
        stage, pp = g.coords["pp"], g.layout.pp
        first, last = stage == 0, stage == pp - 1
        enc = self.cfg.model.encoders[name]
        # Between pipeline stages an item travels as this rank's sequence-parallel shard; a vision
        # class token travels with the patches (the last stage drops it).
        tokens = shard_len(tokens_per_item(self.cfg, name) + (1 if enc.class_token else 0), part.encoder.config)
        hidden = enc.hidden_size

        def items(mb) -> int:
            x = batch_of(mb).get(name)
            return 0 if x is None else x.shape[0]

        def forward_step(mb, x):
            if pp == 1:
                return encode(part, batch_of(mb).get(name))
            if items(mb) == 0:  # nothing to encode: every stage skips, identically
                if last:
                    return torch.zeros(0, self.cfg.model.language.hidden_size, dtype=self.dtype,
                                       device=self.runtime.device)
                return torch.zeros(tokens, 0, hidden, dtype=self.dtype, device=self.runtime.device)
            return part(batch_of(mb)[name] if first else x)

        shape = lambda mb: (tokens, items(mb), hidden)  # noqa: E731
        neighbour = lambda s: g.layout.rank(**{**g.coords, "pp": s})  # noqa: E731
        link = StageLink(neighbour(stage - 1) if not first else None, neighbour(stage + 1) if not last else None,
                         shape, shape, self.dtype, self.runtime.device)
        return forward_step, link, first, last

    def _colocated_pass(self, step: int, name: str):
        if self.topo.grid(name).layout.pp == 1:
            def run():
                x = self._encoder_items(name)[name]
                return encode(self.parts[name], x), self._unit_counts(name, x.shape[0])
            return WholePass(run)
        # One chunk per LLM microbatch (some may be empty); every stage of this encoder
        # pipeline holds the same items, so all of them cut the same chunks.
        plan, _ = self._window(name)
        a, b = plan.src_interval(self.topo.grid(name).coords["dp"])
        k = self.num_microbatches
        cuts = [(c * (b - a)) // k for c in range(k + 1)]
        cache: Dict[int, Dict[str, torch.Tensor]] = {}

        def batch(c):
            if c not in cache:
                cache[c] = self._encoder_items(name, chunk=slice(cuts[c], cuts[c + 1]))
            return cache[c]

        forward_step, link, first, last = self._stage(name, batch)
        return StagedPass(k, forward_step, link, first, last, lambda: self._unit_counts(name, b - a))

    def _encoder_member(self, step: int, name: str) -> Member:
        """This rank's stage node of non-colocated encoder `name`, over LLM microbatch windows."""
        cache: Dict[int, Dict[str, torch.Tensor]] = {}

        def batch(mb):
            if mb not in cache:
                cache[mb] = self._encoder_items(name, mb)
            return cache[mb]

        stage_forward, link, first, last = self._stage(name, batch)
        trainable = self.trainable_edge[name]

        def forward_step(mb, x):
            with torch.set_grad_enabled(trainable):
                return stage_forward(mb, x)

        def backward_step(mb, x, y, grad):
            if y.requires_grad and y.numel():
                torch.autograd.backward(y, grad_tensors=grad)
            if x is None:
                cache.pop(mb, None)
                return None
            return x.grad if x.grad is not None else torch.zeros_like(x)

        down = (BoundarySource(self.comms[name], lambda mb: self._unit_counts(name, batch(mb)[name].shape[0]),
                               lambda mb: self._window(name, mb)[0]) if last
                else link)
        return Member(name, self._timed(name, "F", forward_step), self._timed(name, "B", backward_step),
                      None if first else link, down, trainable)

    def _run_encoder_rank(self, step: int) -> None:
        """A rank away from the LLM: its non-colocated encoder stage node(s)."""
        names = [n for n in self.remote if self.topo.grid(n).is_member]
        pp_of = {n: self.cfg.parallelism[n].pp for n in [LANGUAGE] + self.encoders}
        distance = stage_nodes(pp_of, self.encoders)
        level = {n: distance[Node(n, self.topo.grid(n).coords["pp"], self.topo.grid(n).layout.pp)] for n in names}
        members = [self._encoder_member(step, n) for n in names]
        if names[0] in self.island:  # the rank's encoders all share its range, so all are in the island
            return run_island(self.num_microbatches, members, level,
                              {n: self.encoders.index(n) for n in names})
        # Encoders sharing ranks outside an island have the same pp, hence the same warm-up.
        warmup = level[names[0]]
        if len(members) == 1:
            m = members[0]
            return run_node(self.num_microbatches, warmup, m.up, m.down, m.forward_step, m.backward_step,
                            with_backward=m.with_backward)
        forward_step, backward_step, up, down, with_backward = fuse(members)
        run_node(self.num_microbatches, warmup, up, down, forward_step, backward_step, with_backward=with_backward)
