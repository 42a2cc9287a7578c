"""Boundary communicators on real gloo ranks, checked exactly against a single-process reference.

One 8-rank launch runs every case (spawning ranks dominates CI time); each
test below then reads its part of the results.

Traffic is checked at the wire: each rank logs the tensors it hands torch.distributed
(comm_harness.WireLog), and the tests compare those bytes with what the case's shapes say,
worked out here from the batch intervals and the window data, not from mimo's planner or its
`Traffic` counters (which are then only checked against the wire).
"""

from collections import Counter

import pytest
import torch

from mimo.comm import COLOCATED, FAN_IN, FAN_OUT, NON_COLOCATED, make_plan
from mimo.runtime import run_on_ranks
from mimo.topology import Layout

from comm_harness import (BROKEN_CASES, DEFAULT_CASES, EXTRA_ROW_CASE, HIDDEN, WIRE, run_cases, shard_slice, slow_cases,
                          window_data)

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
    return _by_case(run_on_ranks(run_cases, WORLD, DEFAULT_CASES + BROKEN_CASES + [EXTRA_ROW_CASE], timeout_s=600))


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


def _ranks(layout):
    n = layout["tp"] * layout["cp"] * layout["dp"] * layout["pp"]
    return set(range(layout["rank_offset"], layout["rank_offset"] + n))


def _intervals(B, dp):
    return [(k * B // dp, (k + 1) * B // dp) for k in range(dp)]


def _expected_nc(c):
    """Wire traffic of a non-colocated "halves" case, from its shapes alone: between the two rank
    ranges, one copy of the boundary tensor each way, one message per overlap of a source and a
    destination batch interval (its counts, int64, forward only; its rows, if any, both ways);
    in the destination range, each shard's rows broadcast to its other TP x CP ranks."""
    src, dst = c["src"], c["dst"]
    elem = torch.tensor([], dtype=WIRE[c["wire"]]).element_size()
    overlaps = [(max(a, x), min(b, y)) for a, b in _intervals(c["B"], src["dp"]) for x, y in _intervals(c["B"], dst["dp"])
                if max(a, x) < min(b, y)]
    exp = Counter()
    for w in range(c["windows"]):
        counts, _, _ = window_data(c, w)
        for a, b in overlaps:
            exp["fwd meta bytes"] += (b - a) * 8
            exp["fwd meta messages"] += 1
            t0, t1 = shard_slice(counts, a, b)
            if t1 > t0:
                for d in ("fwd", "bwd"):
                    exp[f"{d} payload bytes"] += (t1 - t0) * HIDDEN * elem
                    exp[f"{d} payload messages"] += 1
        for a, b in _intervals(c["B"], dst["dp"]):
            t0, t1 = shard_slice(counts, a, b)
            exp["fwd intra payload bytes"] += (t1 - t0) * HIDDEN * elem * (dst["tp"] * dst["cp"] - 1)
    return +exp


def _observed_nc(c, results):
    """The same quantities, from what the ranks handed torch.distributed."""
    src, dst = _ranks(c["src"]), _ranks(c["dst"])
    obs = Counter()
    sent, received = Counter(), Counter()
    for r in results:
        me = r["rank"]
        for rec in r["wire"]:
            kind = "meta" if rec["dtype"] == "int64" else "payload"
            if rec["op"] in ("send", "recv"):
                peer = rec["peer"]
                if (me in src) == (peer in src) and (me in dst) == (peer in dst):
                    continue  # not between the ranges
                pair = (me, peer) if rec["op"] == "send" else (peer, me)
                (sent if rec["op"] == "send" else received)[(rec["phase"], kind, pair)] += rec["nbytes"]
                if rec["op"] == "send":
                    obs[f"{rec['phase']} {kind} bytes"] += rec["nbytes"]
                    obs[f"{rec['phase']} {kind} messages"] += 1
            elif rec["op"] == "broadcast" and rec["root"] == me and rec["phase"] == "fwd" and kind == "payload":
                obs["fwd intra payload bytes"] += rec["nbytes"] * (len(rec["ranks"]) - 1)
    assert sent == received  # every byte sent across is received by the peer it names
    return +obs


NC_HALVES = [c for c in DEFAULT_CASES if _plan(c).placement == NON_COLOCATED and c["mode"] == "halves"]


@pytest.mark.parametrize("c", NC_HALVES, ids=[c["name"] for c in NC_HALVES])
def test_noncolocated_cross_traffic_is_one_copy(sweep, c):
    """Cross-range bytes on the wire = one copy of the boundary tensor (each way) + its counts
    (forward only), one message per batch-interval overlap, not per TP rank; mimo's own counters
    report what the wire carried."""
    results = sweep[c["name"]]
    observed, expected = _observed_nc(c, results), _expected_nc(c)
    assert observed == expected
    assert _total(results, "fwd/cross/payload") == observed["fwd payload bytes"]
    assert _total(results, "fwd/cross/meta") == observed["fwd meta bytes"]
    assert _total(results, "bwd/cross/payload") == observed["bwd payload bytes"]
    assert _total(results, "bwd/cross/meta") == observed["bwd meta bytes"] == 0
    assert _total(results, "fwd/intra/payload") == observed["fwd intra payload bytes"]


def test_wire_check_catches_one_extra_row(sweep):
    """Negative control: a communicator that sends one row too many per message (and drops it on
    receipt) still hands over exact outputs and gradients, and its own counters still report the
    expected bytes, so only the wire check catches it, off by exactly one row per message."""
    c = EXTRA_ROW_CASE
    results = sweep[c["name"]]
    assert not [e for r in results for e in r["errors"]]
    observed, expected = _observed_nc(c, results), _expected_nc(c)
    assert observed != expected
    row = HIDDEN * torch.tensor([], dtype=WIRE[c["wire"]]).element_size()
    for d in ("fwd", "bwd"):
        assert observed[f"{d} payload bytes"] - expected[f"{d} payload bytes"] == row * expected[f"{d} payload messages"]
    assert _total(results, "fwd/cross/payload") == expected["fwd payload bytes"]  # the counters are blind to it
    assert _total(results, "bwd/cross/payload") == expected["bwd payload bytes"]


KNOWN = [c for c in DEFAULT_CASES if c["mode"] == "known"]


@pytest.mark.parametrize("c", KNOWN, ids=[c["name"] for c in KNOWN])
def test_known_unit_sizes_send_no_counts(sweep, c):
    """Windows whose unit sizes every rank knows (the trainer's) move the same rows with no
    metadata message (no int64 tensor on the wire); the run itself checked outputs, counts and
    gradients against the truth."""
    results = sweep[c["name"]]
    assert not [e for r in results for e in r["errors"]]
    wire = [rec for r in results for rec in r["wire"]]
    assert not [rec for rec in wire if rec["dtype"] == "int64"]
    assert any(rec["op"] == "send" and rec["nbytes"] > 0 for rec in wire)


def test_known_sizes_cases_use_the_module_grids_groups(sweep):
    """The trainer's path ("known" cases): the edge's broadcasts and CP sums run over the two modules'
    own grid groups, so building it creates no process group. Control: the cases that build their own
    groups do create some (the count can see a new group)."""
    known = [c["name"] for c in DEFAULT_CASES if c["mode"] == "known"]
    assert len(known) >= 4
    for name in known:
        assert sum(r["new_groups"] for r in sweep[name]) == 0, name
    assert sum(r["new_groups"] for c in DEFAULT_CASES if c["mode"] != "known" for r in sweep[c["name"]]) > 0


def test_colocated_traffic_stays_in_range(sweep):
    """A colocated edge's messages never leave its ranks (the wire's peers and groups)."""
    for c in DEFAULT_CASES:
        if _plan(c).placement == COLOCATED:
            ranks = _ranks(c["src"])
            for r in sweep[c["name"]]:
                for rec in r["wire"]:
                    assert r["rank"] in ranks and rec.get("peer", r["rank"]) in ranks, (c["name"], rec)
                    assert set(rec.get("ranks", ())) <= ranks, (c["name"], rec)
            assert _total(sweep[c["name"]], "fwd/cross/payload") == _total(sweep[c["name"]], "bwd/cross/payload") == 0


def test_colocated_equal_dp_is_rank_local(sweep):
    """Equal DP sizes on the same ranks: nothing reaches torch.distributed at all."""
    results = sweep["c equal dp2"]
    assert [rec for r in results for rec in r["wire"]] == []
    assert sum(sum(r["traffic"]["bytes"].values()) for r in results) == 0


@pytest.mark.slow
def test_large_sweep():
    cases = slow_cases(WORLD)
    results = _by_case(run_on_ranks(run_cases, WORLD, cases, timeout_s=1800))
    errors = [e for c in cases for r in results[c["name"]] for e in r["errors"]]
    assert not errors, "\n".join(errors[:50])
