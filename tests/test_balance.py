"""Data-aware microbatching: workload estimate, the policies' rules, the algorithms against
brute force, tools/balance.py and the config checks (pure numpy, no process group)."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mimo.balance import POLICIES, Pipeline, WorkloadModel, assign, cv, microbatch_loads, violations
from mimo.balance.deferral import SubsetTable, bottleneck_pairs, closest_sums
from mimo.balance.entrain import entrain, stratified, swap_ties
from mimo.balance.lpt import dealt, snake
from mimo.balance.mmscale import bubble_order
from mimo.planner.simulator import SimStage, simulate_1f1b

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_balance_samples import skewed  # noqa: E402


@pytest.fixture(scope="module")
def work():
    return WorkloadModel.from_model()


def step(work, n, seed=0):
    text, image = skewed(n, seed)
    return work.from_tokens(text, image)


def test_workload_estimate(work):
    enc, llm = work.from_tokens(np.array([100, 100, 100, 200]), np.array([0, 576, 1152, 0]))
    assert enc[0] == 0 and enc[2] == pytest.approx(2 * enc[1])          # images x per-image cost
    assert llm[1] > llm[0] and llm[3] > 2 * llm[0]                       # image tokens count; attention term
    # Frozen-aware: a trainable tower pays its weight gradients too.
    raw = {"language": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
           "encoders": {"images": dict(kind="vision", num_layers=2, hidden_size=32, num_attention_heads=2,
                                       image_size=32, patch_size=8, frozen=True)}}
    frozen = WorkloadModel.from_model(raw).per_item["images"].total
    raw["encoders"]["images"]["frozen"] = False
    assert WorkloadModel.from_model(raw).per_item["images"].total > 1.5 * frozen


def positions(a):
    """The step's samples in trainer position order, for assignments of equal microbatches with
    llm == encoder (none, mmscale): LLM microbatch k of DP rank d at ``[k*D*m + d*m, k*D*m + (d+1)*m)``."""
    assert a.llm == a.encoder and len({len(mb) for rank in a.llm for mb in rank}) == 1
    return [i for k in range(a.microbatches) for rank in a.llm for i in rank[k]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dp,mbs,m", [(1, 4, 1), (2, 4, 3), (3, 8, 8)])
def test_rules(work, policy, dp, mbs, m):
    enc, llm = step(work, dp * mbs * m, seed=dp + m)
    a = assign(policy, enc, llm, dp, mbs, Pipeline(llm_stages=2))
    assert violations(a, len(llm)) == []
    assert a.dp == dp and all(len(r) == mbs for r in a.encoder + a.llm)
    if policy == "none":
        assert a.llm == a.encoder
        assert a.encoder[dp - 1][mbs - 1] == list(range(len(llm) - m, len(llm)))
        assert positions(a) == list(range(len(llm)))
    if policy == "mmscale":  # a permutation the trainer can slice: equal microbatches, llm == encoder
        assert sorted(positions(a)) == list(range(len(llm)))


def test_violations_catch_broken_assignments(work):
    a = assign("none", *step(work, 8), 1, 4)
    a.llm[0][0], a.llm[0][1] = a.llm[0][1], a.llm[0][0]   # LLM before encoder
    assert any("before its encoder" in v for v in violations(a, 8))
    b = assign("none", *step(work, 8), 2, 2)
    b.encoder[1][0] = b.encoder[0][0]                       # a sample twice, another nowhere
    assert violations(b, 8)


def test_policies_balance_the_skewed_distribution(work):
    enc, llm = step(work, 4 * 16 * 8)
    got = {p: assign(p, enc, llm, 4, 16) for p in POLICIES}
    llm_cv = {p: cv(microbatch_loads(llm, a.llm)) for p, a in got.items()}
    enc_cv = {p: cv(microbatch_loads(enc, a.encoder)) for p, a in got.items()}
    assert llm_cv["mmscale"] < llm_cv["none"] / 5 and llm_cv["entrain"] < llm_cv["none"] / 3
    assert enc_cv["entrain"] < enc_cv["none"] / 5
    # Entrain defers only to the partner right after: microbatch 2k+1 holds what 2k gave away.
    a = got["entrain"]
    for d in range(a.dp):
        for k in range(0, a.microbatches - 1, 2):
            moved = set(a.encoder[d][k]) - set(a.llm[d][k])
            assert moved <= set(a.llm[d][k + 1]) and set(a.llm[d][k]) <= set(a.encoder[d][k])


def test_dealt_keeps_counts_and_balances():
    w = np.random.default_rng(1).lognormal(0, 0.5, 256)
    bins = dealt(w, 32)
    assert np.bincount(bins, minlength=32).tolist() == [8] * 32
    loads = np.bincount(bins, weights=w, minlength=32)
    contiguous = w.reshape(32, 8).sum(1)
    assert loads.max() / loads.mean() < 1.08 < 1.2 < contiguous.max() / contiguous.mean()


def test_subset_sum_against_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(20):
        sets = [rng.integers(0, 30, rng.integers(1, 8)).tolist() for _ in range(int(rng.integers(1, 4)))]
        tables = [SubsetTable.build(units) for units in sets]
        targets = np.array([np.arange(0, 60, 0.5)] * len(sets))
        got = closest_sums(tables, targets)
        for r, units in enumerate(sets):
            # Any subset but the whole set (that would leave the microbatch's LLM side empty).
            every = {sum(c) for n in range(len(units)) for c in itertools.combinations(units, n)}
            for target, best in zip(targets[r], got[r]):
                assert best in every and abs(best - target) == min(abs(s - target) for s in every)
                assert best == min(s for s in every if abs(s - target) == abs(best - target))  # the smaller
                taken = tables[r].subset(int(best))
                assert sum(units[i] for i in taken) == best and len(taken) < len(units)


def test_bottleneck_matching_against_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(30):
        k = int(rng.integers(1, 5))
        over = np.sort(rng.uniform(5, 10, k))[::-1]
        under = np.sort(rng.uniform(0, 5, k + int(rng.integers(0, 2))))[::-1]
        V = np.maximum(over[:, None] - rng.uniform(0, 3, (k, len(under))), under[None, :] + 1)
        V = np.minimum(V, over[:, None])
        T, match = bottleneck_pairs(over, under, V)
        brute = min(max([V[i, p[i]] for i in range(k)] + [under.max()])
                    for p in itertools.permutations(range(len(under)), k))
        assert T == pytest.approx(brute)
        assert len(set(match.values())) == len(match)
        assert all(V[i, j] <= T for i, j in match.items()) and all(over[i] <= T for i in range(k) if i not in match)


def test_bubble_order_and_simulator_check():
    assert bubble_order([5, 1, 4, 2, 3, 6], 3) == [1, 5, 0, 2, 4, 3]
    assert bubble_order([3, 1, 2], 1) == [0, 1, 2]
    rng = np.random.default_rng(4)
    pipe = Pipeline(llm_stages=3, encoder_stages=1)
    enc, llm = rng.uniform(0, 1, 16), rng.uniform(0, 4, 16)
    mbs = [[i] for i in range(16)]
    ordered = [mbs[k] for k in bubble_order((enc + llm).tolist(), pipe.depth)]
    assert pipe.replica_time(enc, llm, ordered, ordered).iteration_time <= \
        pipe.replica_time(enc, llm, mbs, mbs).iteration_time


def test_simulator_takes_per_microbatch_times():
    same = simulate_1f1b([SimStage("a", 1.0, 2.0), SimStage("b", 1.0, 2.0, {"a": 0.0})], 4).iteration_time
    listed = simulate_1f1b([SimStage("a", [1.0] * 4, [2.0] * 4), SimStage("b", [1.0] * 4, [2.0] * 4, {"a": 0.0})],
                           4).iteration_time
    assert listed == same
    slow = simulate_1f1b([SimStage("a", [1.0, 5.0, 1.0, 1.0], 2.0), SimStage("b", 1.0, 2.0, {"a": 0.0})], 4)
    assert slow.iteration_time > same
    with pytest.raises(ValueError, match="3 microbatch times for 4"):
        simulate_1f1b([SimStage("a", [1.0] * 3, 0.0)], 4)


def _tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "balance.py"), *args],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})


def test_tool_contract(tmp_path):
    path = tmp_path / "s.jsonl"
    text, image = skewed(37)
    path.write_text("".join(json.dumps({"id": f"r{i}", "text_tokens": int(t), "image_tokens": int(m)}) + "\n"
                            for i, (t, m) in enumerate(zip(text, image))))
    cfg = os.path.join(ROOT, "examples", "configs", "balance_llava7b_64gpu.yaml")
    r = _tool("--samples", str(path), "--policy", "entrain", "--dp", "2", "--microbatches", "4",
              "--micro-batch-size", "2", "--config", cfg)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["steps"]) == 2                               # 37 // 16; the partial step is dropped
    for s, st in enumerate(out["steps"]):
        flat = [i for rank in st["dp"] for mb in rank["encoder"] for i in mb]
        assert sorted(flat) == sorted(f"r{i}" for i in range(16 * s, 16 * s + 16))
        for rank in st["dp"]:
            assert len(rank["encoder"]) == len(rank["llm"]) == 4
            for k in range(4):
                assert set(i for mb in rank["llm"][:k + 1] for i in mb) <= set(i for mb in rank["encoder"][:k + 1]
                                                                            for i in mb)
    assert "llm" in r.stderr and "predicted step time" in r.stderr
    r = _tool("--samples", str(path), "--policy", "none", "--dp", "2", "--microbatches", "2")
    st = json.loads(r.stdout)["steps"][0]["dp"]
    assert st[0]["encoder"] == st[0]["llm"] == [["r0"], ["r2"]] and st[1]["llm"] == [["r1"], ["r3"]]
    # With a config, the tool says where its run is not the trainer's: another DP, a refused policy.
    demo = os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")  # LLM dp 2, no pipeline
    r = _tool("--samples", str(path), "--policy", "entrain", "--dp", "3", "--microbatches", "2", "--config", demo)
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert r.returncode == 0 and len(notes) == 2, r.stderr
    assert notes[0] == f"note: --dp 3, but {demo} has parallelism.language.dp 2: the trainer deals each step over 2 DP ranks"
    assert notes[1].startswith("note: the trainer refuses it: data.balance: entrain defers LLM work")
    r = _tool("--samples", str(path), "--policy", "mmscale", "--dp", "2", "--microbatches", "2", "--config", demo)
    assert r.returncode == 0 and "note: " not in r.stderr, r.stderr


def test_tool_bad_input(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "text_tokens": 3, "image_tokens": 0}\n{"id": "b", "text_tokens": 5}\n')
    r = _tool("--samples", str(path), "--policy", "mmscale", "--dp", "1", "--microbatches", "1")
    assert r.returncode == 2 and r.stderr.startswith("error:") and "bad.jsonl:2" in r.stderr
    assert "'b'" in r.stderr and "image_tokens" in r.stderr and "Traceback" not in r.stderr
    r = _tool("--samples", str(path), "--policy", "fancy", "--dp", "1", "--microbatches", "1")
    assert r.returncode == 2 and "error:" in r.stderr


@pytest.mark.parametrize("policy,layout,message", [
    ("fancy", {"language": {"pp": 2}, "images": {"rank_offset": 2}}, "must be one of none, mmscale, entrain"),
    ("entrain", {"language": {}, "images": {}}, "has no pipeline"),
    ("mmscale", {"language": {"pp": 2}, "images": {"rank_offset": 2}}, None),
    ("entrain", {"language": {"pp": 2}, "images": {"rank_offset": 2}}, None),
])
def test_config_check(tmp_path, policy, layout, message):
    import yaml

    raw = {"model": {"language": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                      max_sequence_length=64),
                     "encoders": {"images": dict(kind="vision", num_layers=1, hidden_size=16,
                                                 num_attention_heads=2, image_size=8, patch_size=4)}},
           "parallelism": layout, "data": {"seq_length": 48, "balance": policy},
           "training": {"global_batch_size": 8, "micro_batch_size": 2}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if message is None:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 2 and r.stderr.startswith("error: data.balance:") and message in r.stderr


# A plain, per-replica reading of the same algorithm: the vectorised production path must give
# exactly its assignment (same floats, same tie rules).

def _closest_scalar(reach, target):
    t = max(0, int(np.floor(target)))
    below = (reach & ((2 << t) - 1)).bit_length() - 1
    rest = reach >> (t + 1)
    if not rest:
        return below
    above = t + (rest & -rest).bit_length()
    return below if target - below <= above - target else above


def _reference_entrain(enc, llm, dp, M, resolution=1024):
    encoder, llm_side = [], []
    for s in snake(np.lexsort((-llm, -enc)), dp):
        mbs = [[i for i in mb if i < len(llm)] for mb in stratified(enc, llm, s[None], M)[0].tolist()]
        loads = [sum(llm[i] for i in mb) for mb in mbs]
        for _ in range(M):                                  # tie swaps
            h, lo = int(np.argmax(loads)), int(np.argmin(loads))
            gap, best = loads[h] - loads[lo], None
            for i, a in enumerate(mbs[h]):
                for j, b in enumerate(mbs[lo]):
                    diff = llm[a] - llm[b]
                    if enc[a] == enc[b] and 0 < diff < gap and (best is None or abs(diff - gap / 2) < best[0]):
                        best = (abs(diff - gap / 2), i, j, diff)
            if best is None:
                break
            _, i, j, diff = best
            mbs[h][i], mbs[lo][j] = mbs[lo][j], mbs[h][i]
            loads[h] -= diff
            loads[lo] += diff
        loads = np.array([sum(llm[i] for i in mb) for mb in mbs])
        by_load = np.argsort(-loads, kind="stable")
        ol, ul = by_load[:M // 2], by_load[M // 2:]
        if len(ol) == 0 or loads.max() <= 0:                # nothing to pair
            encoder.append([mbs[k] for k in by_load])
            llm_side.append([mbs[k] for k in by_load])
            continue
        unit = loads.max() / resolution
        tables = [SubsetTable.build(np.maximum(0, np.rint(llm[mbs[i]] / unit)).astype(np.int64).tolist())
                  for i in ol]
        delta = (loads[ol][:, None] - loads[ul][None, :]) / 2 / unit
        sums = np.array([[_closest_scalar(t.movable, x) for x in row] for t, row in zip(tables, delta)])
        V = np.maximum(loads[ol][:, None] - sums * unit, loads[ul][None, :] + sums * unit)
        _, match = bottleneck_pairs(loads[ol], loads[ul], V)
        free = [c for c in range(len(ul))[::-1] if c not in match.values()]
        for r in range(len(ol)):
            if r not in match:
                match[r] = free.pop(0)
        e_out, l_out = [], []
        for r in range(len(ol)):
            c = match[r]
            moved = [mbs[ol[r]][p] for p in tables[r].subset(int(sums[r, c]))]
            exact = sum(llm[i] for i in moved)
            if max(loads[ol[r]] - exact, loads[ul[c]] + exact) >= loads[ol[r]]:
                moved = []                                  # no better on exact work: not made
            e_out += [mbs[ol[r]], mbs[ul[c]]]
            l_out += [[i for i in mbs[ol[r]] if i not in moved], mbs[ul[c]] + moved]
        e_out += [mbs[ul[c]] for c in free]
        l_out += [mbs[ul[c]] for c in free]
        encoder.append(e_out)
        llm_side.append(l_out)
    return encoder, llm_side


@pytest.mark.parametrize("dp,M,m,seed", [(1, 4, 3, 0), (2, 8, 8, 1), (3, 6, 5, 2), (4, 16, 8, 3), (2, 32, 2, 4),
                                         (2, 5, 3, 5), (1, 1, 4, 6)])
def test_entrain_fast_path_equals_reference(dp, M, m, seed):
    rng = np.random.default_rng(seed)
    n = dp * M * m
    enc = rng.integers(0, 4, n) * 0.37                      # few distinct values: many ties, some zeros
    llm = rng.lognormal(0, 1, n) + enc
    a = entrain(enc, llm, dp, M)
    assert violations(a, n) == []
    assert (a.encoder, a.llm) == _reference_entrain(enc, llm, dp, M)


def test_deferral_never_empties_an_llm_microbatch_nor_worsens_a_pair():
    """One sample per microbatch and a very long one in the step: on work rounded to 1/1024 of the
    heaviest microbatch, moving a whole microbatch to its partner once looked best, which left the
    LLM a microbatch of no sample (the step then failed in collate) and made the pair slower."""
    work = WorkloadModel.from_model()
    _, llm = work.from_tokens(np.array([16000, 5, 51, 36, 8, 329]), np.zeros(6))
    a = entrain(np.zeros(6), llm, 1, 6)
    assert violations(a, 6) == [] and all(a.llm[0])
    rng = np.random.default_rng(11)
    for _ in range(300):
        M, m = int(rng.integers(2, 9)), int(rng.integers(1, 3))
        tokens = np.exp(rng.uniform(np.log(4), np.log(16000), M * m)).astype(int)
        enc, llm = work.from_tokens(tokens, rng.integers(0, 2, M * m) * 576)
        a = entrain(enc, llm, 1, M)
        assert violations(a, M * m) == [], (tokens, a)
        # Each deferral pair: the overloaded microbatch and its partner run one after the other.
        for k in range(0, len(a.llm[0]) - 1):
            moved = [i for i in a.llm[0][k + 1] if i not in a.encoder[0][k + 1]]
            if moved:
                before = max(llm[a.encoder[0][k]].sum(), llm[a.encoder[0][k + 1]].sum())
                assert max(llm[a.llm[0][k]].sum(), llm[a.llm[0][k + 1]].sum()) < before, (tokens, a)


def test_violations_name_an_empty_llm_microbatch(work):
    a = assign("none", *step(work, 8), 1, 4)
    a.llm[0][1] += a.llm[0][0]
    a.llm[0][0] = []
    assert "dp 0 microbatch 0: the LLM runs no sample" in violations(a, 8)


def test_tie_swaps_keep_encoder_loads_and_narrow_llm():
    enc, llm = step(WorkloadModel.from_model(), 256, seed=5)
    before = stratified(enc, llm, np.lexsort((-llm, -enc))[None], 32)
    after, loads = swap_ties(enc, llm, before)
    lists = lambda mem: [[i for i in mb if i < 256] for mb in mem[0].tolist()]   # noqa: E731
    assert [sorted(enc[mb]) for mb in lists(after)] == [sorted(enc[mb]) for mb in lists(before)]  # encoder kept
    spread = lambda mem: np.ptp([llm[mb].sum() for mb in lists(mem)])          # noqa: E731
    assert spread(after) < 0.5 * spread(before)
    assert np.allclose(loads[0], [llm[mb].sum() for mb in lists(after)])


def test_packed_documents_pay_their_own_attention():
    """A sequence packing several documents costs the LLM its tokens' linear work plus each document's
    own attention (documents never attend to each other): four packed documents of 1,024 tokens are
    lighter than one document of 4,096, and the balancer sees that from the samples' document ids."""
    import copy

    import torch

    from mimo.balance.step import StepBalancer
    from mimo.config import build_config
    from mimo.data import PAD_ID, Sample
    from tiny import TINY

    work = WorkloadModel.from_model()
    got = work.llm_documents([[1024] * 4, [4096], []])
    assert got[0] == pytest.approx(4 * work.llm(np.array([1024.0]))[0], rel=1e-12)
    assert got[1] == pytest.approx(work.llm(np.array([4096.0]))[0], rel=1e-12) and got[2] == 0
    assert work.llm_quadratic > 0
    assert got[1] - got[0] == pytest.approx(work.llm_quadratic * (4096 ** 2 - 4 * 1024 ** 2), rel=1e-9)

    def sample(docs, S=64):
        ids = torch.cat([torch.full((n,), k) for k, n in enumerate(docs)] + [torch.full((S - sum(docs),), -1)])
        return Sample(torch.ones(S, dtype=torch.long), {}, torch.ones(S, dtype=torch.bool), ids,
                      torch.zeros(S, dtype=torch.long))

    assert sample([5, 3]).document_tokens() == [5, 3] and sample([]).document_tokens() == []
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["model"]["encoders"] = {}
    raw["parallelism"] = {"language": dict(dp=2)}
    raw["data"].update(balance="mmscale", packing=True)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    cfg, problems = build_config(raw)
    assert not problems, problems
    # Two whole 60-token documents and two sequences of fifteen 4-token ones: by total tokens all four
    # weigh the same, and the two heavy ones (0 and 2) went to one replica.
    step_samples = [sample([60]), sample([4] * 15), sample([60]), sample([4] * 15)]
    a = StepBalancer(cfg).assignment(step_samples, PAD_ID)
    holds = [sorted(i for mb in rank for i in mb) for rank in a.llm]
    assert all(len(set(h) & {0, 2}) == 1 for h in holds), holds
