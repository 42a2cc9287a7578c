"""Boundary communicators on real gloo ranks, checked exactly against a single-process reference.

One 8-rank launch runs every case (spawning ranks dominates CI time); each
test below then reads its part of the results.
"""

import pytest
import torch

from mimo.comm import COLOCATED, FAN_IN, FAN_OUT, NON_COLOCATED, make_plan
from mimo.runtime import run_on_ranks
from mimo.topology import Layout

from comm_harness import BROKEN_CASES, DEFAULT_CASES, HIDDEN, WIRE, run_cases, shard_slice, slow_cases, window_data

WORLD = 8


def _plan(c):
    return make_plan(Layout(**c["src"]), Layout(**c["dst"]), c["B"])


def _by_case(results):
    out = {}
    for rank_results in results:
        for r in rank_results:
            out.setdefault(r["name"], []).append(r)
    return out


@pytest.fixture(scope="module")
def sweep():
    return _by_case(run_on_ranks(run_cases, WORLD, DEFAULT_CASES + BROKEN_CASES, timeout_s=600))


def test_sweep_covers_required_features():
    plans = [(c, _plan(c)) for c in DEFAULT_CASES]
    assert len({(str(c["src"]), str(c["dst"])) for c, _ in plans}) >= 20
    seen = set()
    for c, p in plans:
        seen.add(p.placement)
        if p.relation != "equal":
            seen.add((p.relation, p.ratio))
        if max(p.src.tp, p.dst.tp) == 4 and min(p.src.tp, p.dst.tp) == 1:
            seen.add("tp 1<->4")
        if p.dst.pp > 1:
            seen.add("dst pp")
        if p.dst.cp == 2:
            seen.add("dst cp2")
        if c["wire"] == "bf16":
            seen.add("bf16")
        if c["windows"] > 1:
            seen.add("windows in flight")
        seen.add(c["mode"])
    required = {COLOCATED, NON_COLOCATED, (FAN_IN, 2), (FAN_IN, 4), (FAN_OUT, 2), (FAN_OUT, 4), "tp 1<->4",
                "dst pp", "dst cp2", "bf16", "windows in flight", "halves", "autograd", "megatron_tp", "known"}
    assert required <= seen, required - seen
    for placement in (COLOCATED, NON_COLOCATED):  # PP / CP at the destination under both placements
        assert any(p.placement == placement and p.dst.pp > 1 for _, p in plans)
        assert any(p.placement == placement and p.dst.cp > 1 for _, p in plans)


@pytest.mark.parametrize("c", DEFAULT_CASES, ids=[c["name"] for c in DEFAULT_CASES])
def test_forward_and_backward_match_reference(sweep, c):
    results = sweep[c["name"]]
    assert len(results) == WORLD
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("c", BROKEN_CASES, ids=[c["name"] for c in BROKEN_CASES])
def test_checker_catches_swapped_shards(sweep, c):
    errors = [e for r in sweep[c["name"]] for e in r["errors"]]
    assert any("out mismatch" in e or "out counts" in e for e in errors), errors
    assert any("grad mismatch" in e for e in errors), errors


def _total(results, key):
    return sum(r["traffic"]["bytes"].get(key, 0) for r in results)


def _messages(results, key):
    return sum(r["traffic"]["messages"].get(key, 0) for r in results)


NC_HALVES = [c for c in DEFAULT_CASES if _plan(c).placement == NON_COLOCATED and c["mode"] == "halves"]


@pytest.mark.parametrize("c", NC_HALVES, ids=[c["name"] for c in NC_HALVES])
def test_noncolocated_cross_traffic_is_one_copy(sweep, c):
    """Cross-range bytes = one copy of the boundary tensor (each way) + its counts (forward only)."""
    results, plan = sweep[c["name"]], _plan(c)
    elem = torch.tensor([], dtype=WIRE[c["wire"]]).element_size()
    payload = meta = payload_msgs = intra = 0
    for w in range(c["windows"]):
        counts, X, _ = window_data(c, w)
        payload += X.numel() * elem
        meta += counts.numel() * 8
        for p in plan.pieces:
            t0, t1 = shard_slice(counts, p.start, p.stop)
            payload_msgs += t1 > t0
        for j in range(plan.dst.dp):  # the leader's broadcast reaches the other TP x CP ranks
            t0, t1 = shard_slice(counts, *plan.dst_interval(j))
            intra += (t1 - t0) * HIDDEN * elem * (plan.dst.tp * plan.dst.cp - 1)
    assert _total(results, "fwd/cross/payload") == payload
    assert _total(results, "fwd/cross/meta") == meta
    assert _total(results, "bwd/cross/payload") == payload
    assert _total(results, "bwd/cross/meta") == 0
    # Cross-range messages follow the batch-shard relation (one per piece), not the TP widths.
    assert _messages(results, "fwd/cross/meta") == len(plan.pieces) * c["windows"]
    assert _messages(results, "fwd/cross/payload") == payload_msgs
    assert _messages(results, "bwd/cross/payload") == payload_msgs
    assert _total(results, "fwd/intra/payload") == intra


KNOWN = [c for c in DEFAULT_CASES if c["mode"] == "known"]


@pytest.mark.parametrize("c", KNOWN, ids=[c["name"] for c in KNOWN])
def test_known_unit_sizes_send_no_counts(sweep, c):
    """Windows whose unit sizes every rank knows (the trainer's) move the same rows with no
    metadata message; the run itself checked outputs, counts and gradients against the truth."""
    results = sweep[c["name"]]
    assert not [e for r in results for e in r["errors"]]
    assert not [k for r in results for k in r["traffic"]["messages"] if k.endswith("/meta")]
    assert _total(results, "fwd/cross/payload") + _total(results, "fwd/intra/payload") > 0


def test_colocated_traffic_stays_in_range(sweep):
    for c in DEFAULT_CASES:
        if _plan(c).placement == COLOCATED:
            results = sweep[c["name"]]
            assert _total(results, "fwd/cross/payload") == _total(results, "bwd/cross/payload") == 0, c["name"]


def test_colocated_equal_dp_is_rank_local(sweep):
    assert sum(sum(r["traffic"]["bytes"].values()) for r in sweep["c equal dp2"]) == 0


@pytest.mark.slow
def test_large_sweep():
    cases = slow_cases(WORLD)
    results = _by_case(run_on_ranks(run_cases, WORLD, cases, timeout_s=1800))
    errors = [e for c in cases for r in results[c["name"]] for e in r["errors"]]
    assert not errors, "\n".join(errors[:50])
