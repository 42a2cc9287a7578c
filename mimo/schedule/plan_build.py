"""The step plan of a config, from layouts alone (no process group): `build_plan` and its per-rank builders.

Two families (the trainer loads a step's data differently for each, `mimo.training.step_data`):

* `homogeneous`: every module on the language's layout, with PP = CP = 1
  when there are encoders (one forward/backward per microbatch through all
  modules), or a text-only LLM with any PP/CP (1F1B over its stages);
* `heterogeneous`: per-module layouts. LLM ranks run 1F1B over their stage
  node (non-colocated encoders only) or the three phases (colocated encoders,
  mixed with live non-colocated edges in phase 2); ranks away from the LLM
  run their encoder stage node(s): alone, fused, or as an island.

Every plan ends with the step's reductions (the loss, per-module gradient
sums over DP x CP, one global gradient norm) and the optimizer steps.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from mimo.config import LANGUAGE, MimoConfig, is_homogeneous, placement
from mimo.topology.layout import Layout

from .plan_nodes import (Edge, Join, Link, Member, Node, Source, fused_node, island_actions, node_actions,
                         stage_nodes, work)
from .plan_types import (BACKWARD, FORWARD, GRAD_NORM, GRAD_SYNC, LOSS, LOSS_TOKENS, OFFLOAD, OPTIMIZER, RELOAD,
                         PlanError, RankActions, SharedRanks, StepPlan)

HOMOGENEOUS, HETEROGENEOUS = "homogeneous", "heterogeneous"


def trainable_edge(cfg: MimoConfig, name: str) -> bool:
    """Whether gradients cross the encoder's boundary (encoder or projector trainable)."""
    enc = cfg.model.encoders[name]
    return not (enc.frozen and enc.projector.frozen)


def stage_trainable(cfg: MimoConfig, name: str, stage: int) -> bool:
    """Whether a module's pipeline stage holds trainable weights (so gets gradients and an optimizer):
    an encoder's projector lives on its last stage only."""
    if name == LANGUAGE:
        return not cfg.model.language.frozen
    enc = cfg.model.encoders[name]
    return not enc.frozen or (not enc.projector.frozen and stage == cfg.parallelism[name].pp - 1)


def stage_input_grad(cfg: MimoConfig, name: str, stage: int) -> bool:
    """Whether a stage's backward computes the gradient of its input (and sends it to the stage before):
    some earlier stage of its module trains. An LLM stage's input always needs one (behind it are the
    LLM's earlier stages or trainable encoders: the config refuses a model with nothing to train)."""
    return name == LANGUAGE or any(stage_trainable(cfg, name, s) for s in range(stage))


def stage_backward(cfg: MimoConfig, name: str, stage: int) -> bool:
    """Whether a pipeline stage runs backward at all: it trains, or an earlier stage of its module does.
    A frozen encoder's stages before its trainable projector (last stage) run forward only."""
    return stage_input_grad(cfg, name, stage + 1)


def num_microbatches(cfg: MimoConfig) -> int:
    tr = cfg.training
    return tr.global_batch_size // (tr.micro_batch_size * cfg.parallelism[LANGUAGE].dp)


def build_plan(cfg: MimoConfig, num_microbatches: Optional[int] = None) -> StepPlan:
    """The plan of one step of `cfg`; `num_microbatches` overrides the step's LLM microbatch count
    (default: global batch / (micro batch x LLM dp)). Public as `mimo.schedule.plan.build_plan`."""
    if num_microbatches is not None:  # the same config with a global batch of that many LLM microbatches
        tr = cfg.training
        size = num_microbatches * tr.micro_batch_size * cfg.parallelism[LANGUAGE].dp
        cfg = replace(cfg, training=replace(tr, global_batch_size=size))
    layouts = {n: Layout.from_config(p) for n, p in cfg.parallelism.items()}
    family = HOMOGENEOUS if is_homogeneous(cfg) else HETEROGENEOUS
    # The layouts travel with the plan: the checker derives from them the collectives that run
    # inside forward, backward and optimizer actions.
    plan = StepPlan(family, layouts=layouts, distributed_optimizer=cfg.training.use_distributed_optimizer)
    shared = SharedRanks()  # each distinct set of collective ranks once, for every rank's actions
    for rank in range(cfg.world_size):
        out = RankActions(rank, shared)
        held = [n for n in list(cfg.model.encoders) + [LANGUAGE] if layouts[n].contains(rank)]
        if family == HOMOGENEOUS:
            _homogeneous(cfg, layouts[LANGUAGE], rank, out)
        else:
            _heterogeneous(cfg, layouts, rank, out)
        _reductions(cfg, layouts, rank, held, out)
        plan.actions.append(out.actions)
    return plan


def _link(cfg: MimoConfig, out: RankActions, module: str, lay: Layout, rank: int) -> Link:
    c = lay.coords(rank)
    at = lambda s: lay.rank(**{**c, "pp": s}) if 0 <= s < lay.pp else None  # noqa: E731
    return Link(out, module, c["pp"], at(c["pp"] - 1), at(c["pp"] + 1), stage_input_grad(cfg, module, c["pp"]))


def _homogeneous(cfg: MimoConfig, lay: Layout, rank: int, out: RankActions) -> None:
    M = num_microbatches(cfg)
    # The loss-token count is summed over the language's DP group first.
    dp = lay.group_of(rank, ["dp"])
    out.collective(f"{LOSS_TOKENS} dp", dp)
    if lay.pp == 1 and lay.cp == 1:
        # One backward call per microbatch covers every module: the LLM first, then the encoders.
        encoders = list(cfg.model.encoders)
        for mb in range(M):
            for name in encoders + [LANGUAGE]:
                out.local(FORWARD, name, 0, mb)
            for name in [LANGUAGE] + encoders:
                out.local(BACKWARD, name, 0, mb)
        return
    link = _link(cfg, out, LANGUAGE, lay, rank)
    stage = link.stage
    node_actions(M, lay.pp - 1 - stage, link, link, work(out, FORWARD, [(LANGUAGE, stage)]),
                 work(out, BACKWARD, [(LANGUAGE, stage)]))


@lru_cache(maxsize=None)  # the same on every rank of a plan
def _world(size: int) -> Tuple[int, ...]:
    return tuple(range(size))


@lru_cache(maxsize=None)  # the same on every rank of a plan
def _edge_ranks(src: Layout, dst: Layout) -> Tuple[int, ...]:
    """Ranks that take part in an edge's calls: the source's last stage and the LLM's first stage."""
    return tuple(sorted({r for r in src.ranks if src.coords(r)["pp"] == src.pp - 1}
                        | {r for r in dst.ranks if dst.coords(r)["pp"] == 0}))


def island_encoders(cfg: MimoConfig, remote: Optional[List[str]] = None) -> List[str]:
    """Non-colocated encoders (`remote`, default: all of them) sharing their rank range with one of
    another pp. Their ranks hold stage nodes of different 1F1B warm-ups, so they run all forwards,
    then all backwards (`island_actions`). Ranges are identical or disjoint (config contract)."""
    par = cfg.parallelism
    if remote is None:
        remote = [n for n in cfg.model.encoders if placement(par[n], par[LANGUAGE]) == "non-colocated"]
    return [a for a in remote if any(par[b].ranks == par[a].ranks and par[b].pp != par[a].pp for b in remote)]


def _heterogeneous(cfg: MimoConfig, layouts: Dict[str, Layout], rank: int, out: RankActions) -> None:
    par, lang = cfg.parallelism, layouts[LANGUAGE]
    encoders = list(cfg.model.encoders)
    if any(par[n].cp != 1 or par[n].ep != 1 for n in encoders):
        raise PlanError("parallelism: encoders need cp = ep = 1 at the boundary")
    M = num_microbatches(cfg)
    kinds = {n: placement(par[n], par[LANGUAGE]) for n in encoders}
    colocated = [n for n in encoders if kinds[n] == "colocated"]
    remote = [n for n in encoders if kinds[n] == "non-colocated"]
    island = island_encoders(cfg, remote)
    edge_ranks = {n: _edge_ranks(layouts[n], lang) for n in encoders}
    edge = lambda n: Edge(out, n, edge_ranks[n])  # noqa: E731
    depth = stage_nodes({n: layouts[n].pp for n in [LANGUAGE] + encoders}, encoders)

    if not lang.contains(rank):
        names = [n for n in remote if layouts[n].contains(rank)]
        members = []
        for n in names:
            lay = layouts[n]
            link = _link(cfg, out, n, lay, rank)
            last = link.stage == lay.pp - 1
            members.append(Member(n, link.stage, link if link.stage > 0 else None,
                                  Source(edge(n)) if last else link, stage_backward(cfg, n, link.stage)))
        if not members:
            return
        level = {m.name: depth[Node(m.name, m.stage, layouts[m.name].pp)] for m in members}
        if names[0] in island:
            return island_actions(out, M, members, level, {n: encoders.index(n) for n in names})
        return fused_node(out, M, level[names[0]], members)

    link = _link(cfg, out, LANGUAGE, lang, rank)
    stage = link.stage
    join = None
    if stage == 0 and remote:
        join = Join([(edge(n), trainable_edge(cfg, n), n in island) for n in remote], M)

    def llm_node(up) -> None:
        node_actions(M, lang.pp - 1 - stage, link if stage > 0 else up, link if stage < lang.pp - 1 else None,
                     work(out, FORWARD, [(LANGUAGE, stage)]), work(out, BACKWARD, [(LANGUAGE, stage)]))

    if not colocated:
        return llm_node(join)
    _three_phase(cfg, layouts, colocated, rank, out, edge, llm_node, join)


def _three_phase(cfg: MimoConfig, layouts, colocated: List[str], rank: int, out: RankActions, edge, llm_node,
                 join: Optional[Join]) -> None:
    """The three phases on an LLM rank with colocated encoders.

    Phase 1: every colocated encoder runs forward over this rank's items of the whole step (a
    pipelined one streams them through its stages, one chunk per LLM microbatch, GPipe order) and
    its boundary communicator moves the step at once. Phase 2: the LLM runs its microbatches on
    slices of what arrived (joined by the live non-colocated edges, if any). Phase 3: the gradients
    go back through the communicators and the encoders run backward. Encoder parameters are idle in
    phase 2, so they may be offloaded to host memory around it."""
    M = num_microbatches(cfg)
    for n in colocated:
        lay = layouts[n]
        link = _link(cfg, out, n, lay, rank)
        if lay.pp == 1:
            out.local(FORWARD, n, 0)
        else:  # one chunk per LLM microbatch, GPipe order
            for c in range(M):
                link.recv_forward(c)
                out.local(FORWARD, n, link.stage, c)
                link.send_forward(c)
        if rank in edge(n).ranks:
            edge(n).forward(None)
    if cfg.training.offload_encoders:
        out.local(OFFLOAD)
    # Phase 2: the first LLM stage slices the colocated tensors locally and joins the live edges.
    llm_node(join)
    if cfg.training.offload_encoders:
        out.local(RELOAD)
    for n in colocated:
        if not trainable_edge(cfg, n):
            continue
        if rank in edge(n).ranks:
            edge(n).backward(None)
        lay = layouts[n]
        link = _link(cfg, out, n, lay, rank)
        if lay.pp == 1:
            out.local(BACKWARD, n, 0)
        elif stage_backward(cfg, n, link.stage):  # a frozen encoder's stages before its projector: none
            for c in range(M):
                link.recv_backward(c)
                out.local(BACKWARD, n, link.stage, c)
                link.send_backward(c)


def _reductions(cfg: MimoConfig, layouts: Dict[str, Layout], rank: int, held: List[str], out: RankActions) -> None:
    """The loss sum, per-module gradient sums, the global norm and the optimizer steps.

    A module's gradient reductions are megatron-core's `finalize_model_grads`, which the executor
    runs at the module's first grad-sync action (the DP x CP sum, then the TP sum of the
    sequence-parallel weights). Their groups lie inside the module's ranks, and every rank of a
    module runs the same modules in the same order (rank ranges are identical or disjoint), so
    running them together keeps every group's members in step."""
    world = _world(cfg.world_size)
    out.collective(LOSS, world)
    stepped = [n for n in held if stage_trainable(cfg, n, layouts[n].coords(rank)["pp"])]
    for n in stepped:
        lay = layouts[n]
        dp_cp = lay.group_of(rank, ["cp", "dp"])
        if len(dp_cp) > 1:
            out.collective(f"{GRAD_SYNC} {n} dp_cp", dp_cp, n)
        transformer_trainable = not (cfg.model.language if n == LANGUAGE else cfg.model.encoders[n]).frozen
        if cfg.parallelism[n].sp and lay.tp > 1 and transformer_trainable:
            tp = lay.group_of(rank, ["tp"])
            out.collective(f"{GRAD_SYNC} {n} tp", tp, n)
    out.collective(GRAD_NORM, world)
    for n in stepped:
        out.local(OPTIMIZER, n)
