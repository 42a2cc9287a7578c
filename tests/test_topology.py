"""Topology: coordinate math, and the real process groups each rank ends up in."""

import pytest
import torch
import torch.distributed as dist

from mimo.config import load_config
from mimo.runtime import run_on_ranks
from mimo.topology import GROUP_DIMS, Layout, build_topology


def test_layout_coords_round_trip_and_tp_fastest():
    lay = Layout(tp=2, cp=1, dp=3, pp=2, rank_offset=4)
    assert list(lay.ranks) == list(range(4, 16))
    for r in lay.ranks:
        assert lay.rank(**lay.coords(r)) == r
    # Expert parallelism is no dense grid dim (an MoE LLM's second decomposition: tests/test_moe.py).
    assert lay.coords(5) == dict(tp=1, cp=0, dp=0, pp=0)
    assert lay.coords(6) == dict(tp=0, cp=0, dp=1, pp=0)
    assert lay.coords(10) == dict(tp=0, cp=0, dp=0, pp=1)
    with pytest.raises(ValueError):
        lay.coords(3)


def test_layout_groups_partition_the_range():
    lay = Layout(tp=2, cp=2, dp=2, pp=2)
    for dims in GROUP_DIMS.values():
        groups = lay.groups(dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(lay.ranks)
        size = 1
        for d in dims:
            size *= getattr(lay, d)
        assert all(len(g) == size for g in groups)
        # Members of a group agree on every coordinate outside `dims`, and are listed with the first
        # of `dims` (in tp, cp, dp, pp order) fastest: member k's coordinates spell k in mixed radix.
        inner = [d for d in ("tp", "cp", "dp", "pp") if d in dims]
        for g in groups:
            others = {tuple(v for k, v in lay.coords(r).items() if k not in dims) for r in g}
            assert len(others) == 1
            for k, r in enumerate(g):
                c, spelled, radix = lay.coords(r), 0, 1
                for d in inner:
                    spelled += c[d] * radix
                    radix *= getattr(lay, d)
                assert spelled == k, (dims, g)


@pytest.mark.parametrize("lay", [Layout(tp=2, cp=3, dp=2, pp=2, rank_offset=5),
                                 Layout(tp=2, cp=1, dp=4, pp=1, ep=4, etp=2, rank_offset=1)])
def test_group_of_is_the_enumerated_group_holding_the_rank(lay):
    """`group_of` builds a rank's group from its coordinates (not by searching every group, which made
    the plan check quadratic in the world size): the same list, members in the same order."""
    from itertools import combinations

    from mimo.topology.layout import DIMS, EXPERT_DIMS

    for n in range(1, len(DIMS) + 1):
        for dims in combinations(DIMS, n):
            for r in lay.ranks:
                assert lay.group_of(r, dims) == next(g for g in lay.groups(dims) if r in g), (dims, r)
    for n in range(1, len(EXPERT_DIMS) + 1):
        for dims in combinations(EXPERT_DIMS, n):
            for r in lay.ranks:
                assert lay.expert_group_of(r, dims) == next(g for g in lay.expert_groups(dims) if r in g)
    with pytest.raises(ValueError, match="outside ranks"):
        lay.group_of(lay.ranks.stop, ["tp"])


def _cfg(language, images):
    return {
        "model": {
            "language": dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=64,
                             max_sequence_length=32),
            "encoders": {"images": dict(kind="vision", num_layers=1, hidden_size=8, num_attention_heads=2,
                                        image_size=8, patch_size=4)},
        },
        "parallelism": {"language": language, "images": images},
        "data": {"seq_length": 32},
        "training": {"global_batch_size": 8, "micro_batch_size": 2},
    }


def _membership(raw):
    cfg = load_config(raw)
    topo = build_topology(cfg)
    out = {"roles": topo.roles, "edges": [(e.src, e.dst, e.placement) for e in topo.edges], "groups": {}}
    for name in topo.roles:
        grid = topo.grid(name)
        for key, pg in grid.groups.items():
            # Ask the real group who is in it: all-gather global ranks over it.
            ranks = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(ranks, torch.tensor([dist.get_rank()]), group=pg)
            out["groups"][(name, key)] = sorted(int(t) for t in ranks)
    return out


# The colocated case runs with -m slow: the non-colocated one checks the same group building for both
# modules, and every colocated parity test (e.g. test_heterogeneous_parity.py::test_colocated_fan_in_three_phase)
# trains on colocated groups.
@pytest.mark.parametrize("language,images,placement", [
    pytest.param(dict(tp=2, dp=2), dict(tp=2, dp=2), "colocated", marks=pytest.mark.slow),
    (dict(tp=2, dp=1), dict(tp=1, dp=2, rank_offset=2), "non-colocated"),
])
def test_real_groups_match_layout(language, images, placement):
    raw = _cfg(language, images)
    cfg = load_config(raw)
    results = run_on_ranks(_membership, cfg.world_size, raw)
    for rank, res in enumerate(results):
        assert res["edges"] == [("images", "language", placement)]
        for name in ("language", "images"):
            lay = Layout.from_config(cfg.parallelism[name])
            assert (name in res["roles"]) == lay.contains(rank)
            if lay.contains(rank):
                for key, dims in GROUP_DIMS.items():
                    assert res["groups"][(name, key)] == sorted(lay.group_of(rank, dims)), (rank, name, key)
                assert res["groups"][(name, "ep")] == [rank]  # no experts: megatron's ep group is this rank
