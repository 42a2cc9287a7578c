"""The step plan, its checker and `python -m mimo.schedule show` (pure Python, no process group)."""

import copy
import json
import os
import runpy
import sys

import pytest
import torch
import yaml

from mimo.config import LANGUAGE, is_homogeneous, load_config
from mimo.schedule.__main__ import main
from mimo.schedule.check import check_plan
from mimo.schedule.plan import PlanError, RankActions, StepPlan, build_plan
from mimo.schedule.plan_build import num_microbatches
from mimo.schedule.plan_nodes import Node, stage_nodes
from tiny import TINY, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")
KEYS = ["rank", "op", "module", "stage", "mb", "peer", "tensor", "group"]


def text_only(**layout):
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["num_layers"] = 4
    raw["model"]["encoders"] = {}
    raw["parallelism"] = {"language": dict(layout)}
    if layout.get("cp", 1) > 1:
        raw["model"]["language"]["attention"] = "bitfield"
    return raw


def example(name):
    return os.path.join(CONFIGS, name)


def as_file(tmp_path, raw):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def show_json(capsys, path, *extra):
    assert main(["show", path, "--json", *extra]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


FAMILIES = {
    "homogeneous_tp2_dp2": lambda tmp: as_file(tmp, tiny(tp=2, dp=2)),
    "text_pp2": lambda tmp: as_file(tmp, text_only(pp=2)),
    "text_pp4_cp2": lambda tmp: as_file(tmp, text_only(pp=4, cp=2)),
    "noncolocated": lambda tmp: example("cpu_noncolocated.yaml"),
    "island": lambda tmp: example("cpu_island.yaml"),
    "shared_encoders": lambda tmp: example("cpu_shared_encoders.yaml"),
    "colocated_llm_pp2": lambda tmp: example("cpu_pipelined_colocated.yaml"),
    "mixed": lambda tmp: example("cpu_mixed_placement.yaml"),
    "offload": lambda tmp: example("cpu_colocated.yaml"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_show_json_each_family(family, tmp_path, capsys):
    path = FAMILIES[family](tmp_path)
    extra = ["--set", "training.offload_encoders=true"] if family == "offload" else []
    rows = show_json(capsys, path, *extra)
    cfg = load_config(path, extra[1:])
    assert [r["rank"] for r in rows] == sorted(r["rank"] for r in rows)  # ranks in order
    assert {r["rank"] for r in rows} == set(range(cfg.world_size))
    for r in rows:
        assert list(r)[:len(KEYS)] == KEYS
        if r["op"] == "collective":
            assert r["rank"] in r["ranks"] and r["name"]
        if r["op"] in ("send", "recv"):
            assert r["tensor"] in ("activation", "gradient") and r["peer"] != r["rank"]
    for rank in range(cfg.world_size):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["group"] for r in mine] == sorted(r["group"] for r in mine)
        assert mine[-1]["op"] == "optimizer"
        assert sum(r["op"] == "collective" and r["name"] == "grad norm" for r in mine) == 1
    # --rank R prints exactly that rank's rows
    assert show_json(capsys, path, *extra, "--rank", "1") == [r for r in rows if r["rank"] == 1]
    # the plan checker agrees and the trainers' choice of family agrees
    plan = build_plan(cfg)
    check_plan(plan)
    assert plan.family == ("homogeneous" if is_homogeneous(cfg) else "heterogeneous")


def test_show_text_and_bad_input(tmp_path, capsys):
    assert main(["show", example("cpu_island.yaml"), "--rank", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out and all(line.startswith("rank   0") for line in out)
    assert any("recv activation mb 0 <- rank 1" in line or "boundary" in line for line in out)
    bad = tiny(tp=2, dp=2)
    bad["parallelism"]["language"]["tp"] = "two"
    assert main(["show", as_file(tmp_path, bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "parallelism.language.tp" in err
    assert main(["show", example("cpu_island.yaml"), "--rank", "9"]) == 2
    assert "--rank 9" in capsys.readouterr().err


def test_module_entry_point(monkeypatch, capsys):
    """`python -m mimo.schedule` (run in this process: importing megatron again costs seconds)."""
    monkeypatch.setattr(sys, "argv", ["mimo.schedule", "show", example("cpu_noncolocated.yaml"), "--rank", "2",
                                      "--json"])
    monkeypatch.delitem(sys.modules, "mimo.schedule.__main__")  # imported above for `main`; run it afresh
    with pytest.raises(SystemExit) as done:
        runpy.run_module("mimo.schedule", run_name="__main__")
    assert done.value.code == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    # LLM stage 1 (tp 0) first receives microbatch 0's activation from stage 0 (tp 0)
    assert (first["op"], first["tensor"], first["mb"], first["peer"]) == ("recv", "activation", 0, 0)


def test_show_into_a_closed_pipe_is_quiet():
    """`python -m mimo.schedule show FILE | head -1`: the reader leaving early is no traceback."""
    import subprocess

    # 64 ranks: far more output than a pipe buffers, so the writes after `head` left do fail
    p = subprocess.Popen([sys.executable, "-m", "mimo.schedule", "show", example("balance_llava7b_64gpu.yaml")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert p.stdout.readline().startswith(b"rank   0")
    p.stdout.close()  # like `head -1`: every further write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _forwards_before_first_backward(actions):
    n = 0
    for a in actions:
        if a.op == "backward":
            return n
        n += a.op == "forward"
    return n


def test_1f1b_warmups_and_first_messages():
    M, pp = 8, 4
    cfg = load_config(text_only(pp=pp, cp=2), [f"training.global_batch_size={2 * M}"])
    plan = build_plan(cfg)
    check_plan(plan)
    for rank, actions in enumerate(plan.actions):
        stage = rank // 2  # cp varies fastest
        assert _forwards_before_first_backward(actions) == min(pp - stage - 1, M) + 1
        if stage > 0:
            recv = next(a for a in actions if a.op == "recv")
            assert (recv.tensor, recv.mb, recv.peer) == ("activation", 0, rank - 2)


def test_graph_warmups_match_stage_nodes():
    cfg = load_config(example("cpu_noncolocated.yaml"))  # LLM tp2 pp2 on 0-3, images dp2 on 4-5
    M = 4
    plan = build_plan(cfg)
    depth = stage_nodes({LANGUAGE: 2, "images": 1}, ["images"])
    expect = {0: depth[Node(LANGUAGE, 0, 2)], 2: depth[Node(LANGUAGE, 1, 2)], 4: depth[Node("images", 0, 1)]}
    for rank, warmup in expect.items():
        assert _forwards_before_first_backward(plan.actions[rank]) == min(warmup, M) + 1


def test_island_join_takes_every_microbatch_first():
    plan = build_plan(load_config(example("cpu_island.yaml")))
    first = plan.actions[0]
    before = first[:next(i for i, a in enumerate(first) if a.op == "forward")]
    got = [(a.module, a.mb) for a in before if a.op == "collective"]
    # both encoders share ranks 2-3 with different pp (an island): every microbatch, (mb, config) order
    assert got == [(name, mb) for mb in range(4) for name in ("images", "audio")]


def _frozen_pipelined_images(frozen=True, **modules):
    """TINY with 2-layer encoders, images' encoder frozen (its projector trains), per-module layouts."""
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["num_layers"] = 2
    for name in ("images", "audio"):
        raw["model"]["encoders"][name]["num_layers"] = 2
        raw["model"]["encoders"][name]["frozen"] = False
        raw["model"]["encoders"][name]["projector"]["frozen"] = False
    raw["model"]["encoders"]["images"]["frozen"] = frozen
    raw["parallelism"] = {m: dict(modules.get(m, {})) for m in ("language", "images", "audio")}
    return raw


@pytest.mark.parametrize("placement", ["non-colocated", "colocated", "island"])
def test_a_frozen_encoders_stages_before_its_projector_run_forward_only(placement):
    """images: a frozen 2-stage encoder under a trainable projector (its last stage). Its first stage runs
    no backward and no gradient travels between its stages; the last stage runs backward (the projector).
    Control: the same layout with the encoder trainable has both."""
    modules = {"non-colocated": dict(language=dict(pp=2), images=dict(pp=2, rank_offset=2),
                                     audio=dict(pp=2, rank_offset=4)),
               "colocated": dict(language=dict(pp=2), images=dict(pp=2), audio=dict(pp=2)),
               "island": dict(language=dict(pp=2), images=dict(pp=2, rank_offset=2),
                              audio=dict(dp=2, rank_offset=2))}[placement]
    for frozen in (True, False):
        cfg = load_config(_frozen_pipelined_images(frozen, **modules))
        plan = build_plan(cfg)
        check_plan(plan)
        M = num_microbatches(cfg)
        acts = [a for rank in plan.actions for a in rank if a.module == "images"]
        backward = {a.stage for a in acts if a.op == "backward"}
        grads = [a for a in acts if a.op in ("send", "recv") and a.tensor == "gradient"]
        audio_grads = [a for rank in plan.actions for a in rank if a.module == "audio" and a.tensor == "gradient"
                       and a.op in ("send", "recv")]
        if frozen:
            assert backward == {1} and grads == [], (backward, grads)
        else:
            assert backward == {0, 1} and len(grads) == 2 * M  # a send and a receive per microbatch
        # audio trains in both: a pipelined audio encoder still sends its gradients back.
        assert bool(audio_grads) == (placement != "island")


def test_offload_between_phases():
    cfg = load_config(example("cpu_colocated.yaml"), ["training.offload_encoders=true"])
    ops = [(a.op, a.module) for a in build_plan(cfg).actions[0]]
    off, back = ops.index(("offload", None)), ops.index(("reload", None))
    assert ops.index(("forward", "images")) < off < ops.index(("forward", LANGUAGE))
    assert max(i for i, o in enumerate(ops) if o == ("backward", LANGUAGE)) < back < ops.index(("backward", "images"))


# -- the executor runs the plan ------------------------------------------------------------------

class RecordingWork:
    """An `ActionRunner` without models: records the calls; microbatch `empty` moves empty tensors."""

    def __init__(self, empty=None):
        self.log, self.empty = [], empty

    def _t(self, a):
        return torch.zeros(0 if a.mb == self.empty else 2)

    def forward(self, a):
        self.log.append(("F", a.module, a.mb))

    def backward(self, a):
        self.log.append(("B", a.module, a.mb))

    def outgoing(self, a):
        return self._t(a)

    def incoming(self, a):
        return self._t(a)

    def arrived(self, a, t):
        self.log.append(("arrived", a.tensor, a.mb))

    def collective(self, a):
        self.log.append(("C", a.name))

    def local(self, a):
        self.log.append((a.op, a.module))


class RecordingDist:
    """Stands in for torch.distributed in the executor: each batch_isend_irecv call is one batch."""

    def __init__(self):
        self.batches = []

    def isend(self, *args):
        pass

    def irecv(self, *args):
        pass

    def P2POp(self, op, tensor, peer):
        return ("send" if op == self.isend else "recv", peer, tensor.numel())

    def batch_isend_irecv(self, ops):
        self.batches.append(ops)
        return []


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_executor_posts_each_group_as_one_batch(rank, monkeypatch):
    """Every group of sends and receives is one batch_isend_irecv in plan order; an empty tensor is not
    posted (both peers skip it alike); compute, collectives and local work run in plan order."""
    import mimo.schedule.executor as executor

    plan = build_plan(load_config(text_only(pp=4)), num_microbatches=6)
    fake = RecordingDist()
    monkeypatch.setattr(executor, "dist", fake)
    work = RecordingWork(empty=2)
    executor.run_plan(plan, rank, work)
    p2p = [g for g in plan.groups(rank) if g[0].op in ("send", "recv")]
    want = [[(a.op, a.peer, 2) for a in g if a.mb != 2] for g in p2p]
    assert fake.batches == [ops for ops in want if ops]
    # microbatch 2 is empty: its messages are left out, and a group of only those posts nothing
    assert len(fake.batches) < len(p2p) or rank == 3
    steps = [(a.op[0].upper(), a.module, a.mb) if a.op in ("forward", "backward")
             else ("arrived", a.tensor, a.mb) if a.op == "recv"
             else ("C", a.name) if a.op == "collective" else (a.op, a.module)
             for a in plan.actions[rank] if a.op != "send"]
    # receives report after their whole group completes: compare with sends dropped, group by group
    assert sorted(work.log, key=str) == sorted(steps, key=str)
    assert [x for x in work.log if x[0] in ("F", "B")] == [x for x in steps if x[0] in ("F", "B")]


# -- the checker ------------------------------------------------------------------------------------

def _plan(*ranks):
    return StepPlan("test", [r.actions for r in ranks])


def test_checker_catches_swapped_recv():
    a, b = RankActions(0), RankActions(1)
    a.p2p_group("language", 0, [("send", "activation", 0, 1)])
    a.p2p_group("language", 0, [("send", "activation", 1, 1)])
    b.p2p_group("language", 1, [("recv", "activation", 1, 0)])
    b.p2p_group("language", 1, [("recv", "activation", 0, 0)])
    with pytest.raises(PlanError, match=r"from rank 0 to rank 1 does not match.*mb 0.*mb 1"):
        check_plan(_plan(a, b))


def test_checker_catches_missing_recv():
    a, b = RankActions(0), RankActions(1)
    for mb in range(2):
        a.p2p_group("language", 0, [("send", "activation", mb, 1)])
    b.p2p_group("language", 1, [("recv", "activation", 0, 0)])
    with pytest.raises(PlanError, match=r"rank 0's `send activation mb 1 -> rank 1.*no matching recv on rank 1"):
        check_plan(_plan(a, b))


def _send_send(batched):
    # Stage 0 sends an activation and receives a gradient; stage 1 the reverse; both send first.
    ranks = [RankActions(0), RankActions(1)]
    for me, out in enumerate(ranks):
        mine, theirs = ("activation", "gradient")[::1 - 2 * me]
        ops = [("send", mine, 0, 1 - me), ("recv", theirs, 0, 1 - me)]
        if batched:
            out.p2p_group("language", me, ops)
        else:
            for op in ops:
                out.p2p_group("language", me, [op])
    return _plan(*ranks)


def test_checker_catches_unbatched_send_send():
    check_plan(_send_send(batched=True))  # control: posted together, both complete
    with pytest.raises(PlanError, match=r"(?s)deadlocks.*rank 0 blocks.*waits for rank 1.*rank 1 blocks"):
        check_plan(_send_send(batched=False))


def test_checker_catches_messages_crossed_between_modules():
    # Two encoders' stage links between the same two ranks: without tags, the order is all that
    # keeps their messages apart, so both ranks must post them in the same module order.
    def plan(recv_order):
        a, b = RankActions(0), RankActions(1)
        for module in ("images", "audio"):
            a.p2p_group(module, 0, [("send", "activation", 0, 1)])
        for module in recv_order:
            b.p2p_group(module, 1, [("recv", "activation", 0, 0)])
        return _plan(a, b)

    check_plan(plan(("images", "audio")))  # control: same order on both ranks
    with pytest.raises(PlanError, match=r"from rank 0 to rank 1 does not match.*images.*audio"):
        check_plan(plan(("audio", "images")))


def test_checker_catches_broken_real_plan():
    plan = build_plan(load_config(example("cpu_noncolocated.yaml")))
    check_plan(plan)
    # rank 2 (LLM stage 1) loses its last activation receive: the message count no longer matches
    plan.actions[2] = [a for a in plan.actions[2] if not (a.op == "recv" and a.mb == 3 and a.tensor == "activation")]
    with pytest.raises(PlanError, match=r"rank 0 posts \d+ sends to rank 2"):
        check_plan(plan)


def test_checker_catches_collective_not_reached():
    plan = build_plan(load_config(example("cpu_noncolocated.yaml")))
    plan.actions[5] = [a for a in plan.actions[5] if a.name != "boundary images gradient mb 3"]
    with pytest.raises(PlanError, match=r"boundary images gradient mb 3.*rank 5"):
        check_plan(plan)


def test_checker_meets_by_ranks_and_checks_them():
    """Ranks made apart (their own tuples of the same ranks) meet; a collective over ranks that leave
    out its own rank, or lie outside the world, is an error; a built plan holds each set of
    collective ranks once, whichever rank's actions name it."""
    a, b = RankActions(0), RankActions(1)  # no shared ranks between them
    for out in (a, b):
        out.collective("loss", [1, 0])
    assert a.actions[0].ranks == b.actions[0].ranks and a.actions[0].ranks is not b.actions[0].ranks
    check_plan(_plan(a, b))
    for ranks, rank in (([1, 2], 0), ([0, 1, 2], 0), ([-1, 0, 1], 0)):
        a, b = RankActions(0), RankActions(1)
        a.collective("loss", ranks)
        b.collective("loss", [0, 1])
        with pytest.raises(PlanError, match=rf"rank {rank}: `collective 'loss' over ranks .* must include rank "
                                            rf"{rank} and lie in \[0, 2\)"):
            check_plan(_plan(a, b))
    plan = build_plan(load_config(example("cpu_noncolocated.yaml")))
    loss = [next(x for x in acts if x.name == "loss") for acts in plan.actions]
    assert loss[0].ranks == tuple(range(plan.world_size)) and all(x.ranks is loss[0].ranks for x in loss)


def test_random_heterogeneous_layouts_plan_and_check():
    """Random valid layouts (colocated, non-colocated, shared ranks, islands, frozen edges) all check,
    and the plan's reading of the config agrees with the heterogeneous trainer's."""
    import random

    from mimo.schedule.plan_build import island_encoders
    from test_heterogeneous_parity import random_layout

    islands = 0
    for seed in range(60):
        raw, world = random_layout(random.Random(seed))
        cfg = load_config(raw)
        plan = build_plan(cfg)
        assert plan.world_size == world and plan.family == "heterogeneous"
        check_plan(plan)
        remote = [n for n in cfg.model.encoders if not set(cfg.parallelism[n].ranks) & set(cfg.parallelism[LANGUAGE].ranks)]
        assert island_encoders(cfg, remote) == island_encoders(cfg)
        islands += bool(island_encoders(cfg))
    assert islands  # the sample covers islands


def test_trainer_checks_the_plan_before_anything_else(monkeypatch):
    """The trainer stops at start, before any process group, when the plan would deadlock."""
    import mimo.training.trainer as trainer

    monkeypatch.setattr(trainer, "build_plan", lambda cfg: _send_send(batched=False))
    with pytest.raises(PlanError, match="deadlocks"):
        trainer.Trainer(load_config(tiny()), runtime=None)


def test_a_rank_keeps_only_its_own_actions_after_the_check():
    """`of_rank`: the rank's actions as built, the others dropped; `through` cuts it as the full plan."""
    from mimo.schedule.plan import LOSS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plan = build_plan(load_config(os.path.join(root, "examples", "configs", "cpu_noncolocated.yaml")))
    check_plan(plan)
    for rank in range(plan.world_size):
        mine = plan.of_rank(rank)
        assert mine.world_size == plan.world_size and mine.actions[rank] == plan.actions[rank]
        assert all(acts == [] for r, acts in enumerate(mine.actions) if r != rank)
        assert mine.through(LOSS).actions[rank] == plan.through(LOSS).actions[rank]
        assert list(mine.groups(rank)) == list(plan.groups(rank))
