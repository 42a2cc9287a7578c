"""The collectives inside a plan's actions (TP/CP in forward and backward, the distributed optimizer's
all-gather) and the checker meeting them; the schedule package's imports point one way.

Pure Python, no process group. Each negative control also checks the broken plan against its
layouts removed (`layouts={}`: every forward, backward and optimizer step local, the checker's old
model), which accepts it: the catch is the model of the collectives inside the actions."""

import ast
import os
from dataclasses import replace

import pytest

from mimo.config import load_config
from mimo.schedule.check import check_plan
from mimo.schedule.collectives import meets
from mimo.schedule.plan import PlanError, build_plan
from tiny import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# LLM tp2 pp2 on ranks 0-3 (TP pairs {0, 1} and {2, 3}), images dp2 on 4-5
NONCOLOCATED = os.path.join(ROOT, "examples", "configs", "cpu_noncolocated.yaml")


def _index(plan, rank, op, module, mb):
    return next(i for i, a in enumerate(plan.actions[rank]) if (a.op, a.module, a.mb) == (op, module, mb))


def _accepted_without_layouts(plan):
    check_plan(replace(plan, layouts={}))


def test_meets_of_compute_and_optimizer_actions():
    """A forward meets its stage's TP x CP block, keyed by microbatch; with the distributed optimizer an
    optimizer step meets its module's DP x CP group; DP = 1 or no TP/CP: nothing to meet."""
    cfg = load_config(tiny(tp=2, dp=2), ["training.use_distributed_optimizer=true"])
    plan = build_plan(cfg)
    fwd = plan.actions[3][_index(plan, 3, "forward", "language", 1)]
    (m,) = meets(plan, fwd)
    assert (m.ranks, m.key) == ((2, 3), ("forward", "language", 0, 1))
    assert "tp collectives over ranks [2, 3]" in m.describe()
    opt = next(a for a in plan.actions[3] if a.op == "optimizer" and a.module == "language")
    assert [x.ranks for x in meets(plan, opt)] == [(1, 3)]
    assert meets(replace(plan, distributed_optimizer=False), opt) == []
    # text-only tp2 cp2 pp2: the forward's block is tp x cp of its stage (the next stage is ranks 4-7)
    text = tiny(tp=2, cp=2, pp=2)
    text["model"]["encoders"], text["parallelism"] = {}, {"language": dict(tp=2, cp=2, pp=2)}
    text["model"]["language"].update(num_layers=4, attention="bitfield")
    plan = build_plan(load_config(text))
    check_plan(plan)
    fwd = next(a for a in plan.actions[5] if a.op == "forward")
    assert [x.ranks for x in meets(plan, fwd)] == [(4, 5, 6, 7)]
    assert "tp x cp collectives" in meets(plan, fwd)[0].what
    # TP = CP = 1: a forward waits for no one
    plan = build_plan(load_config(tiny(dp=2)))
    assert meets(plan, next(a for a in plan.actions[0] if a.op == "forward")) == []
    assert plan.through("loss").layouts == plan.layouts  # the trainer's loss-only prefix keeps them


def test_checker_catches_tp_peer_skipping_a_forward():
    plan = build_plan(load_config(NONCOLOCATED))
    check_plan(plan)
    # rank 1 (LLM stage 0, TP rank 1) loses its forward of microbatch 0; its messages are unchanged
    del plan.actions[1][_index(plan, 1, "forward", "language", 0)]
    _accepted_without_layouts(plan)
    with pytest.raises(PlanError, match=r"(?s)deadlocks.*rank 0 blocks at group \d+ \[`forward language stage 0 mb 0` "
                                        r"\(its tp collectives over ranks \[0, 1\]\)\]: rank 1 is at .*boundary"):
        check_plan(plan)


def test_checker_catches_tp_peers_in_different_microbatch_orders():
    plan = build_plan(load_config(NONCOLOCATED))
    # rank 1 runs microbatch 1's forward where its TP peer rank 0 runs microbatch 0's, and the other way round
    i, j = _index(plan, 1, "forward", "language", 0), _index(plan, 1, "forward", "language", 1)
    acts = plan.actions[1]
    acts[i], acts[j] = replace(acts[i], mb=1), replace(acts[j], mb=0)
    _accepted_without_layouts(plan)
    with pytest.raises(PlanError, match=r"(?s)rank 0 blocks at .*`forward language stage 0 mb 0`.*"
                                        r"rank 1 is at group \d+ \[`forward language stage 0 mb 1`"):
        check_plan(plan)


def test_checker_catches_tp_peers_in_different_backward_orders():
    plan = build_plan(load_config(tiny(tp=2, dp=2)))  # homogeneous: every module's TP group is ranks {0, 1}
    check_plan(plan)
    # rank 0 runs the encoders' backwards of microbatch 0 audio first, its TP peer rank 1 images first
    i, j = _index(plan, 0, "backward", "images", 0), _index(plan, 0, "backward", "audio", 0)
    acts = plan.actions[0]
    acts[i], acts[j] = replace(acts[j], group=acts[i].group), replace(acts[i], group=acts[j].group)
    _accepted_without_layouts(plan)
    with pytest.raises(PlanError, match=r"(?s)rank 0 blocks at .*`backward (images|audio) stage 0 mb 0`.*"
                                        r"rank 1 is at .*`backward (images|audio) stage 0 mb 0`"):
        check_plan(plan)


def test_checker_catches_distributed_optimizer_steps_in_different_orders():
    cfg = load_config(tiny(dp=2), ["training.use_distributed_optimizer=true"])
    plan = build_plan(cfg)
    check_plan(plan)
    steps = [i for i, a in enumerate(plan.actions[1]) if a.op == "optimizer"]
    assert len(steps) == 3  # images, audio (its projector), language
    acts = plan.actions[1]
    first, last = acts[steps[0]], acts[steps[-1]]
    acts[steps[0]], acts[steps[-1]] = replace(last, group=first.group), replace(first, group=last.group)
    check_plan(replace(plan, distributed_optimizer=False))  # without it, optimizer steps are local
    with pytest.raises(PlanError, match=r"(?s)rank 0 blocks at .*`optimizer images` \(the distributed optimizer's "
                                        r"parameter all-gather over dp x cp ranks \[0, 1\]\).*rank 1 is at .*"
                                        r"`optimizer language`"):
        check_plan(plan)


def test_schedule_imports_point_one_way():
    """No import circle in mimo.schedule, lazy (function-level) imports included."""
    pkg = os.path.join(ROOT, "mimo", "schedule")
    graph = {}
    for f in os.listdir(pkg):
        if not f.endswith(".py"):
            continue
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(pkg, f)).read())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 1:
                    deps.add(mod.split(".")[0] if mod else None)
                elif mod.startswith("mimo.schedule."):
                    deps.add(mod.split(".")[2])
        graph[f[:-3]] = {d for d in deps if d}

    def reaches(start, goal, seen):
        for d in graph.get(start, ()):
            if d == goal or (d not in seen and not seen.add(d) and reaches(d, goal, seen)):
                return True
        return False

    assert graph["plan_types"] == set()
    assert [m for m in graph if reaches(m, m, set())] == []
