"""`check_plan(plan)`: prove a step plan completes under rendezvous semantics, before it runs.

The model is the strictest one a backend may apply (NCCL, gloo on large
messages): a send completes only once its matching receive is posted, and
the other way round; a group of point-to-point actions (one
`batch_isend_irecv`) completes when all of its actions have; a collective
completes when every rank it lists has reached it; local work always
completes. Messages between two ranks match in posting order only (the
backends ignore tags), so the k-th send from A to B must be the k-th
receive on B from A, with the same tensor kind and microbatch.

Any mismatch or deadlock raises `PlanError` naming the ranks and actions.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, Tuple

from .plan import ACTIVATION, COLLECTIVE, RECV, SEND, Action, PlanError, StepPlan

Where = Tuple[int, int]  # (rank, index of the group in that rank's list)


def _match(plan: StepPlan, groups: List[List[List[Action]]]) -> Dict[Tuple[int, int, int], Where]:
    """For each p2p action (rank, group index, position), where its counterpart is posted."""
    out: Dict[Tuple[int, int, int], Where] = {}
    sends, recvs = defaultdict(list), defaultdict(list)
    world = plan.world_size
    for r, gs in enumerate(groups):
        for gi, g in enumerate(gs):
            for k, a in enumerate(g):
                if a.op == COLLECTIVE:
                    if len(g) > 1:
                        raise PlanError(f"rank {r}: collective {a.name!r} is posted in a group with other actions")
                    if r not in a.ranks or any(not 0 <= m < world for m in a.ranks):
                        raise PlanError(f"rank {r}: collective {a.name!r} lists ranks {list(a.ranks)}, "
                                        f"which must include rank {r} and lie in [0, {world})")
                if a.op not in (SEND, RECV):
                    continue
                if a.peer is None or not 0 <= a.peer < world or a.peer == r:
                    raise PlanError(f"rank {r}: `{a.describe()}` names no valid peer rank (world of {world})")
                pair = (r, a.peer) if a.op == SEND else (a.peer, r)
                (sends if a.op == SEND else recvs)[pair].append((r, gi, k))
    for pair in set(sends) | set(recvs):
        src, dst = pair
        s, v = sends[pair], recvs[pair]
        for n, (ws, wr) in enumerate(zip(s, v)):
            a, b = groups[ws[0]][ws[1]][ws[2]], groups[wr[0]][wr[1]][wr[2]]
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
            a = groups[extra[0]][extra[1]][extra[2]]
            other = dst if a.op == SEND else src
            raise PlanError(f"rank {src} posts {len(s)} sends to rank {dst}, rank {dst} posts {len(v)} receives "
                            f"from rank {src}: rank {extra[0]}'s `{a.describe()}` has no matching "
                            f"{'recv' if a.op == SEND else 'send'} on rank {other}")
    return out


def check_plan(plan: StepPlan) -> None:
    groups = [plan.groups(r) for r in range(plan.world_size)]
    partner = _match(plan, groups)
    pos = [0] * plan.world_size

    def current(r):
        return groups[r][pos[r]] if pos[r] < len(groups[r]) else None

    def waits(r) -> List[str]:
        """Why rank r's current group cannot complete (empty: it can)."""
        g, why = current(r), []
        if g[0].op == COLLECTIVE:
            a = g[0]
            for m in a.ranks:
                c = current(m)
                if c is None or c[0].op != COLLECTIVE or (c[0].name, c[0].ranks) != (a.name, a.ranks):
                    why.append(f"rank {m} is at {_at(c)}")
            return why
        for k, a in enumerate(g):
            if a.op in (SEND, RECV):
                pr, pg = partner[(r, pos[r], k)]
                if pos[pr] < pg:
                    why.append(f"`{a.describe()}` waits for rank {pr}, which is at {_at(current(pr))}")
        return why

    def neighbours(g) -> List[int]:
        if g is None:
            return []
        return list(g[0].ranks) if g[0].op == COLLECTIVE else [a.peer for a in g if a.op in (SEND, RECV)]

    todo, queued = deque(range(plan.world_size)), set(range(plan.world_size))

    def wake(rs):
        for x in rs:
            if x not in queued:
                queued.add(x)
                todo.append(x)

    while todo:
        r = todo.popleft()
        queued.discard(r)
        while current(r) is not None and not waits(r):
            g = current(r)
            movers = list(g[0].ranks) if g[0].op == COLLECTIVE else [r]
            for m in movers:
                old = current(m)
                pos[m] += 1
                wake(neighbours(old) + neighbours(current(m)) + ([m] if m != r else []))
    stuck = [r for r in range(plan.world_size) if current(r) is not None]
    if stuck:
        lines = [f"rank {r} blocks at {_at(current(r))}: " + "; ".join(waits(r)) for r in stuck[:8]]
        more = f"\n  ... and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""
        raise PlanError(f"the step plan deadlocks ({plan.family}; ranks {stuck} never finish):\n  "
                        + "\n  ".join(lines) + more)


def _at(g) -> str:
    if g is None:
        return "the end of its plan"
    return f"group {g[0].group} [" + ", ".join(f"`{a.describe()}`" for a in g) + "]"
