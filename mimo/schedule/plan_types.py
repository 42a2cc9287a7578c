"""The step plan's data: `Action`, `StepPlan`, `RankActions`, the action kinds and collective names.

A plan is plain data, built from the config alone (no process group, no
tensor). Each action is one thing a rank does: run a forward or backward of
one microbatch of one module stage, send or receive an activation or a
gradient to or from a peer rank, take part in a collective, sync gradients,
step its optimizers. Actions of one rank that share a `group` number are
posted together (one `batch_isend_irecv`) and complete together; every other
action is a group of its own.

This module imports nothing else of `mimo.schedule`: the builders
(`plan_build`, `plan_nodes`), the checker and the executor all import it, and
`plan` re-exports it next to `build_plan`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from mimo.topology.layout import Layout

FORWARD, BACKWARD, SEND, RECV, COLLECTIVE, OPTIMIZER = "forward", "backward", "send", "recv", "collective", "optimizer"
ACTIVATION, GRADIENT = "activation", "gradient"
P2P = (SEND, RECV)
OFFLOAD, RELOAD = "offload", "reload"
# Collective names: the executor's work tells them apart by these prefixes.
LOSS_TOKENS, LOSS, GRAD_SYNC, GRAD_NORM, BOUNDARY = "loss tokens", "loss", "grad_sync", "grad norm", "boundary"


class PlanError(ValueError):
    """A plan that cannot run: unmatched or misordered messages, or a deadlock."""


@dataclass(frozen=True)
class Action:
    rank: int
    op: str
    module: Optional[str] = None
    stage: Optional[int] = None
    mb: Optional[int] = None
    peer: Optional[int] = None
    tensor: Optional[str] = None
    group: int = 0
    ranks: Optional[Tuple[int, ...]] = None  # collectives: every rank taking part
    name: Optional[str] = None               # collectives: the same on all of them

    def to_dict(self) -> Dict:
        d = asdict(self)
        if self.op != COLLECTIVE:
            del d["ranks"], d["name"]
        else:
            d["ranks"] = list(self.ranks)
        return d

    def describe(self) -> str:
        """One line a person can read, e.g. `send activation mb 3 -> rank 2 (language stage 0)`."""
        where = "" if self.module is None else self.module + ("" if self.stage is None else f" stage {self.stage}")
        mb = "" if self.mb is None else f" mb {self.mb}"
        if self.op in P2P:
            arrow = "->" if self.op == SEND else "<-"
            return f"{self.op} {self.tensor}{mb} {arrow} rank {self.peer} ({where})"
        if self.op == COLLECTIVE:
            return f"collective {self.name!r} over ranks {list(self.ranks)}"
        return f"{self.op} {where}{mb}".rstrip()


@dataclass
class StepPlan:
    """Per-rank action lists, ranks 0 .. world_size - 1; `family` names the schedule that made it.

    `layouts` (module -> its grid) and `distributed_optimizer` say which collectives run *inside*
    forward, backward and optimizer actions (tensor/context-parallel ones, the distributed
    optimizer's all-gather): the checker meets them like the plan's own collectives
    (`mimo.schedule.collectives`). A plan without layouts (a hand-made one) has none."""
    family: str
    actions: List[List[Action]] = field(default_factory=list)
    layouts: Dict[str, "Layout"] = field(default_factory=dict)
    distributed_optimizer: bool = False

    @property
    def world_size(self) -> int:
        return len(self.actions)

    def groups(self, rank: int) -> List[List[Action]]:
        """The rank's actions as posted: consecutive actions with one group number."""
        out: List[List[Action]] = []
        for a in self.actions[rank]:
            if out and out[-1][0].group == a.group:
                out[-1].append(a)
            else:
                out.append([a])
        return out

    def through(self, name: str) -> "StepPlan":
        """Every rank's actions up to and including collective `name` (on every rank, e.g. the loss:
        a forward and backward without the step's reductions and update)."""
        cut = []
        for acts in self.actions:  # (a rank's list is empty in a plan kept for another rank: `of_rank`)
            at = next((i for i, a in enumerate(acts) if a.op == COLLECTIVE and a.name == name), -1)
            cut.append(acts[:at + 1])
        return replace(self, actions=cut)

    def of_rank(self, rank: int) -> "StepPlan":
        """The plan as one rank runs it: its own actions, the other ranks' dropped (after the
        check, which needs them all), so a rank keeps what grows with its own share only."""
        return replace(self, actions=[acts if r == rank else [] for r, acts in enumerate(self.actions)])

    def lines(self, rank: Optional[int] = None) -> Iterator[str]:
        for r in range(self.world_size) if rank is None else [rank]:
            for a in self.actions[r]:
                yield f"rank {r:>3}  [{a.group:>4}]  {a.describe()}"

    def json_lines(self, rank: Optional[int] = None) -> Iterator[str]:
        for r in range(self.world_size) if rank is None else [rank]:
            for a in self.actions[r]:
                yield json.dumps(a.to_dict())


class SharedRanks:
    """Collective ranks as one sorted tuple per distinct set, for the ranks of a plan: a world-wide
    collective's ranks are held once for the plan, not once per rank (quadratic in the world size).
    A tuple passed again (a cached group) is known by its identity, without sorting or hashing it."""

    def __init__(self):
        self._by_set: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
        self._by_id: Dict[int, Tuple[tuple, Tuple[int, ...]]] = {}  # id(a tuple passed) -> (it, its shared tuple)

    def __call__(self, ranks: Sequence[int]) -> Tuple[int, ...]:
        seen = self._by_id.get(id(ranks))
        if seen is not None and seen[0] is ranks:
            return seen[1]
        key = tuple(sorted(ranks))
        shared = self._by_set.setdefault(key, key)
        if isinstance(ranks, tuple):  # kept alive here, so its id names it for the whole build
            self._by_id[id(ranks)] = (ranks, shared)
        return shared


class RankActions:
    """Appends one rank's actions, numbering the groups as they are posted. `shared` (one for the
    ranks of a plan) holds each distinct set of collective ranks once."""

    def __init__(self, rank: int, shared: Optional["SharedRanks"] = None):
        self.rank, self.actions, self._group = rank, [], 0
        self._shared = shared if shared is not None else SharedRanks()

    def _post(self, specs: Sequence[Dict]) -> None:
        if not specs:
            return
        for s in specs:
            self.actions.append(Action(rank=self.rank, group=self._group, **s))
        self._group += 1

    def local(self, op: str, module: Optional[str] = None, stage: Optional[int] = None,
              mb: Optional[int] = None) -> None:
        """One action that is not a message: a forward, backward, optimizer step, offload or reload."""
        self._post([dict(op=op, module=module, stage=stage, mb=mb)])

    def p2p_group(self, module: str, stage: int, ops: Sequence[Tuple[str, str, int, Optional[int]]]) -> None:
        """Sends and receives posted as one batch: ops are (send|recv, tensor kind, mb, peer) in posting
        order; a None peer (no neighbour on that side) drops the op."""
        self._post([dict(op=op, module=module, stage=stage, mb=mb, peer=peer, tensor=tensor)
                    for op, tensor, mb, peer in ops if peer is not None])

    def collective(self, name: str, ranks: Sequence[int], module: Optional[str] = None, mb: Optional[int] = None,
                   tensor: Optional[str] = None) -> None:
        self._post([dict(op=COLLECTIVE, module=module, mb=mb, tensor=tensor, ranks=self._shared(ranks), name=name)])
