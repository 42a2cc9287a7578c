"""`check_plan(plan)`: prove a step plan completes under rendezvous semantics, before it runs.

The model is the strictest one a backend may apply (NCCL, gloo on large
messages): a send completes only once its matching receive is posted, and
the other way round; a group of point-to-point actions (one
`batch_isend_irecv`) completes when all of its actions have; a collective
completes when every rank it spans has reached it. Collectives are the
plan's `collective` actions and those inside forward, backward and
optimizer actions (tensor/context-parallel calls, the distributed
optimizer's all-gather; `collectives.meets` derives them from the plan's
layouts), so TP peers that skip a forward or run two microbatches in
different orders are caught like a collective one member never reaches.
Work that holds no collective always completes. Messages between two ranks
match in posting order only (the backends ignore tags), so the k-th send
from A to B must be the k-th receive on B from A, with the same tensor kind
and microbatch.

Any mismatch or deadlock raises `PlanError` naming the ranks and actions.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import replace
from typing import Dict, FrozenSet, List, Optional, Tuple, Union

from .collectives import Meet, meets
from .plan_types import ACTIVATION, P2P, SEND, Action, PlanError, StepPlan

# One step of a rank that may wait for other ranks: a group of sends and receives, or one meet.
Step = Union[List[Action], Meet]
Where = Tuple[int, int]  # (rank, index of the step in that rank's list)


def check_plan(plan: StepPlan) -> None:
    """Raise `PlanError` unless every rank of `plan` reaches the end of its actions."""
    members = _Members(plan.world_size)
    steps = [rank_steps(plan, r, members) for r in range(plan.world_size)]
    sim = _Rendezvous(steps, _match_messages(plan, steps))
    stuck = sim.run()
    if stuck:
        raise _deadlock(plan, sim, stuck)


class _Members:
    """One shared tuple per distinct set of meet ranks, checked once. A world-wide meet lists every
    rank; each rank's copy of it would be hashed and scanned again at every look (quadratic in the
    world size), while the shared one is known by its identity."""

    def __init__(self, world: int):
        self.world = world
        self.shared: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
        self.sets: Dict[int, FrozenSet[int]] = {}  # id(shared tuple) -> its ranks, once they lie in the world

    def check(self, rank: int, meet: Meet) -> Meet:
        """The meet with its shared ranks tuple, after checking that it spans `rank` and ranks of the
        plan only."""
        ranks = self.shared.setdefault(meet.ranks, meet.ranks)
        known = self.sets.get(id(ranks))
        if known is None and ranks and min(ranks) >= 0 and max(ranks) < self.world:
            known = self.sets[id(ranks)] = frozenset(ranks)
        if known is None or rank not in known:
            raise PlanError(f"rank {rank}: {meet.describe()} spans ranks {list(meet.ranks)}, "
                            f"which must include rank {rank} and lie in [0, {self.world})")
        return meet if ranks is meet.ranks else replace(meet, ranks=ranks)


def rank_steps(plan: StepPlan, rank: int, members: _Members) -> List[Step]:
    """Rank `rank`'s steps in order: each group of sends and receives, and every meet its other actions
    make. Work without a collective is left out: it always completes, so it cannot hold anyone up.
    Meets over the same ranks share one ranks tuple (`members`, shared by the ranks of one check)."""
    out: List[Step] = []
    for group in plan.groups(rank):
        if group[0].op in P2P:
            _check_p2p_group(rank, group)
            out.append(group)
            continue
        if len(group) > 1:
            raise PlanError(f"rank {rank}: `{group[0].describe()}` is posted in a group with other actions")
        for meet in meets(plan, group[0]):
            out.append(members.check(rank, meet))
    return out


def _check_p2p_group(rank: int, group: List[Action]) -> None:
    """Only sends and receives may share a group (one `batch_isend_irecv`)."""
    for a in group:
        if a.op not in P2P:
            raise PlanError(f"rank {rank}: `{a.describe()}` is posted in a group with other actions")


def _match_messages(plan: StepPlan, steps: List[List[Step]]) -> Dict[Tuple[int, int, int], Where]:
    """For each send or receive (rank, step index, position in its group), the step of its counterpart.

    Between two ranks the k-th send is the k-th receive (no tags), so pairing them in posting order is
    what the backends do; a pair that differs in kind, microbatch or module is a crossed message."""
    out: Dict[Tuple[int, int, int], Where] = {}
    sends, recvs = defaultdict(list), defaultdict(list)
    world = plan.world_size
    for r, ss in enumerate(steps):
        for si, step in enumerate(ss):
            if isinstance(step, Meet):
                continue
            for k, a in enumerate(step):
                if a.peer is None or not 0 <= a.peer < world or a.peer == r:
                    raise PlanError(f"rank {r}: `{a.describe()}` names no valid peer rank (world of {world})")
                pair = (r, a.peer) if a.op == SEND else (a.peer, r)
                (sends if a.op == SEND else recvs)[pair].append((r, si, k))
    for pair in set(sends) | set(recvs):
        src, dst = pair
        s, v = sends[pair], recvs[pair]
        for n, (ws, wr) in enumerate(zip(s, v)):
            a, b = steps[ws[0]][ws[1]][ws[2]], steps[wr[0]][wr[1]][wr[2]]
            # Same kind, microbatch and module (encoders sharing ranks must not cross their
            # messages), and the receiver is the sender's neighbouring stage in the flow's direction.
            step = 1 if a.tensor == ACTIVATION else -1
            if (a.tensor, a.mb, a.module) != (b.tensor, b.mb, b.module) or (
                    a.stage is not None and b.stage is not None and b.stage != a.stage + step):
                raise PlanError(f"message #{n} from rank {src} to rank {dst} does not match: rank {src} posts "
                                f"`{a.describe()}` but rank {dst} posts `{b.describe()}` (messages between two "
                                "ranks match in posting order; tags are not used)")
            out[ws], out[wr] = wr[:2], ws[:2]
        if len(s) != len(v):
            extra = s[len(v)] if len(s) > len(v) else v[len(s)]
            a = steps[extra[0]][extra[1]][extra[2]]
            other = dst if a.op == SEND else src
            raise PlanError(f"rank {src} posts {len(s)} sends to rank {dst}, rank {dst} posts {len(v)} receives "
                            f"from rank {src}: rank {extra[0]}'s `{a.describe()}` has no matching "
                            f"{'recv' if a.op == SEND else 'send'} on rank {other}")
    return out


class _Rendezvous:
    """Runs the steps: a worklist of ranks, each advancing while its current step can complete.

    A rank is looked at again only when a rank it waits for moved, and a meet counts the members
    that reached it rather than asking each member where it is on every wake-up (which made meets
    over the whole world cubic in its size). A meet is known by its key and the identity of its
    shared ranks tuple (`_Members`), not by hashing every rank in it."""

    def __init__(self, steps: List[List[Step]], partner: Dict[Tuple[int, int, int], Where]):
        self.steps, self.partner = steps, partner
        self.pos = [0] * len(steps)
        self.arrived: Dict[Tuple, int] = {}  # a meet's `_meet_key` -> members whose current step it is
        for r in range(len(steps)):
            self._arrive(r)

    def _arrive(self, r: int) -> None:
        step = self.current(r)
        if isinstance(step, Meet):  # one of its ranks: `rank_steps` checked that
            k = _meet_key(step)
            self.arrived[k] = self.arrived.get(k, 0) + 1

    def current(self, r: int) -> Optional[Step]:
        return self.steps[r][self.pos[r]] if self.pos[r] < len(self.steps[r]) else None

    def can_complete(self, r: int) -> bool:
        """Whether rank r's current step completes now: every member at this meet, or every message's
        counterpart posted (its peer at or past the counterpart's step)."""
        step = self.current(r)
        if isinstance(step, Meet):
            return self.arrived.get(_meet_key(step), 0) == len(step.ranks)
        return all(self.pos[pr] >= ps for pr, ps in (self.partner[(r, self.pos[r], k)] for k in range(len(step))))

    def waits(self, r: int) -> List[str]:
        """Why rank r's current step cannot complete yet, for the error (empty: it can)."""
        step = self.current(r)
        why = []
        if isinstance(step, Meet):
            for m in step.ranks:
                if not _same_meet(self.current(m), step):
                    why.append(f"rank {m} is at {_at(self.current(m))}")
            return why
        for k, a in enumerate(step):
            pr, ps = self.partner[(r, self.pos[r], k)]
            if self.pos[pr] < ps:
                why.append(f"`{a.describe()}` waits for rank {pr}, which is at {_at(self.current(pr))}")
        return why

    def run(self) -> List[int]:
        """Advance every rank as far as it goes; the ranks that never reach their plan's end."""
        world = len(self.steps)
        todo, queued = deque(range(world)), set(range(world))

        def wake(rs):
            for x in rs:
                if x not in queued:
                    queued.add(x)
                    todo.append(x)

        while todo:
            r = todo.popleft()
            queued.discard(r)
            while self.current(r) is not None and self.can_complete(r):
                step = self.current(r)
                # A meet completes for all of its ranks at once; a p2p group for this rank (its peers'
                # halves complete when they are looked at).
                movers = list(step.ranks) if isinstance(step, Meet) else [r]
                if isinstance(step, Meet):
                    del self.arrived[_meet_key(step)]
                for m in movers:
                    old = self.current(m)
                    self.pos[m] += 1
                    self._arrive(m)
                    # A mover looks at its own next step (r goes on in this loop); a meet needs no other
                    # wake-up, since its last member to arrive completes it. Messages wake their peers.
                    wake(_peers(old) + _peers(self.current(m)) + ([m] if m != r else []))
        return [r for r in range(world) if self.current(r) is not None]


def _meet_key(meet: Meet) -> Tuple:
    return meet.key, id(meet.ranks)


def _same_meet(step: Optional[Step], meet: Meet) -> bool:
    return isinstance(step, Meet) and _meet_key(step) == _meet_key(meet)


def _peers(step: Optional[Step]) -> List[int]:
    """The peers of a step's messages (to look at again once this rank moved past or onto it)."""
    if step is None or isinstance(step, Meet):
        return []
    return [a.peer for a in step]


def _deadlock(plan: StepPlan, sim: _Rendezvous, stuck: List[int]) -> PlanError:
    """The error naming where each stuck rank stopped and what it waits for (the first 8 ranks)."""
    lines = [f"rank {r} blocks at {_at(sim.current(r))}: " + "; ".join(sim.waits(r)) for r in stuck[:8]]
    more = f"\n  ... and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""
    return PlanError(f"the step plan deadlocks ({plan.family}; ranks {stuck} never finish):\n  "
                    + "\n  ".join(lines) + more)


def _at(step: Optional[Step]) -> str:
    if step is None:
        return "the end of its plan"
    if isinstance(step, Meet):
        return f"group {step.action.group} [{step.describe()}]"
    return f"group {step[0].group} [" + ", ".join(f"`{a.describe()}`" for a in step) + "]"
