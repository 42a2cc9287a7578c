"""Edge plans: pure Python, no processes."""

import pytest

from mimo.comm import COLOCATED, EQUAL, FAN_IN, FAN_OUT, NON_COLOCATED, make_plan
from mimo.topology import Layout


def leader_routes(p):
    """Non-colocated forward routes, one per piece: (source leader, destination leader)."""
    return [(p.src_leader(q.i), p.dst_leader(q.j)) for q in p.pieces]


def test_intervals_and_pieces_fan_in():
    p = make_plan(Layout(dp=4), Layout(tp=2, dp=2, rank_offset=4), 8)
    assert (p.placement, p.relation, p.ratio) == (NON_COLOCATED, FAN_IN, 2)
    assert [p.src_interval(i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.dst_interval(j) for j in range(2)] == [(0, 4), (4, 8)]
    assert [(q.i, q.j, q.start, q.stop) for q in p.pieces] == [(0, 0, 0, 2), (1, 0, 2, 4), (2, 1, 4, 6), (3, 1, 6, 8)]
    # Leaders: tp=0 rank of the source's last stage / destination's first stage.
    assert [p.src_leader(i) for i in range(4)] == [0, 1, 2, 3]
    assert [p.dst_leader(j) for j in range(2)] == [4, 6]
    assert p.dst_receivers(1) == [6, 7]
    assert leader_routes(p) == [(0, 4), (1, 4), (2, 6), (3, 6)]


def test_fan_out_pieces_and_leaders_with_pp_and_tp():
    src = Layout(tp=2, dp=1, pp=2)           # ranks 0-3, last stage = ranks 2, 3
    dst = Layout(tp=2, cp=2, dp=2, pp=2, rank_offset=4)  # first stage = ranks 4-11
    p = make_plan(src, dst, 4)
    assert (p.relation, p.ratio) == (FAN_OUT, 2)
    assert p.src_holders(0) == [2, 3] and p.src_leader(0) == 2
    assert p.dst_receivers(0) == [4, 5, 6, 7] and p.dst_receivers(1) == [8, 9, 10, 11]
    assert [(q.i, q.j, q.start, q.stop) for q in p.pieces] == [(0, 0, 0, 2), (0, 1, 2, 4)]
    assert p.role(3).src_shard == 0 and not p.role(3).is_src_leader
    assert p.role(0).src_shard is None  # first encoder stage holds no boundary tensor
    assert p.role(12).dst_shard is None  # second LLM stage receives nothing
    g = p.groups()
    assert g["src_tp"] == [[2, 3]]
    assert g["dst_tpcp"] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert g["dst_cp"] == [[4, 6], [8, 10]]  # only the leaders' CP groups reduce gradients


def test_cross_routes_follow_batch_shards_not_tp_widths():
    p = make_plan(Layout(tp=4, dp=2), Layout(tp=4, dp=2, rank_offset=8), 4)
    assert p.relation == EQUAL and len(leader_routes(p)) == 2


def test_colocated_equal_is_rank_local():
    p = make_plan(Layout(tp=2, dp=2), Layout(tp=2, dp=2), 4)
    assert p.placement == COLOCATED
    moves, local = p.colocated_forward_routes()
    bmoves, _ = p.colocated_backward_routes()
    assert moves == [] and bmoves == [] and len(local) == 4


def test_colocated_fan_in_moves_siblings_and_backward_is_local():
    p = make_plan(Layout(dp=4), Layout(tp=2, dp=2), 8)
    moves, _ = p.colocated_forward_routes()
    # Ranks {0,1} form destination shard 0 and exchange their intervals; same for {2,3}.
    assert sorted((m.src, m.dst) for m in moves) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert p.colocated_backward_routes()[0] == []


def test_colocated_fan_out_is_local_forward_and_sibling_backward():
    p = make_plan(Layout(tp=2), Layout(dp=2), 4)
    assert p.colocated_forward_routes()[0] == []
    assert sorted((m.src, m.dst) for m in p.colocated_backward_routes()[0]) == [(0, 1), (1, 0)]


def test_colocated_destination_pp2_ships_later_stage_shards():
    # Encoder DP4 on the ranks of LLM PP2 x DP2: ranks 2, 3 are LLM stage 1 but hold encoder shards 2, 3.
    p = make_plan(Layout(dp=4), Layout(dp=2, pp=2), 4)
    assert [p.dst_shard_of(r) for r in range(4)] == [0, 1, None, None]
    moves, _ = p.colocated_forward_routes()
    assert sorted((p.pieces[m.piece].i, m.src, m.dst) for m in moves) == [(1, 1, 0), (2, 2, 1), (3, 3, 1)]
    back, _ = p.colocated_backward_routes()
    assert sorted((p.pieces[m.piece].i, m.src, m.dst) for m in back) == [(1, 0, 1), (2, 1, 2), (3, 1, 3)]


@pytest.mark.parametrize("src,dst,B,words", [
    (Layout(dp=2), Layout(dp=2, rank_offset=1), 4, "partially overlap"),
    (Layout(dp=4), Layout(dp=2, rank_offset=4), 6, "not divisible by the source DP"),
    (Layout(cp=2), Layout(dp=2, rank_offset=2), 4, "cp=1"),
    (Layout(dp=2), Layout(dp=2, rank_offset=2), 0, "positive"),
])
def test_invalid_edges_are_rejected(src, dst, B, words):
    with pytest.raises(ValueError, match=words):
        make_plan(src, dst, B)


def test_window_plans_route_items_whatever_the_dp_sizes():
    # 7 items over encoder dp 3 (ranks 2-4) and LLM dp 2 (ranks 0-1) whose samples hold items [0, 4) and [4, 7).
    base = make_plan(Layout(dp=3, rank_offset=2), Layout(dp=2), None)
    p = base.for_window([0, 2, 5, 7], [0, 4, 7])
    assert [(q.i, q.j, q.start, q.stop) for q in p.pieces] == [(0, 0, 0, 2), (1, 0, 2, 4), (1, 1, 4, 5), (2, 1, 5, 7)]
    assert leader_routes(p) == [(2, 0), (3, 0), (3, 1), (4, 1)]
    # An encoder rank with no item has no piece and no route.
    q = base.for_window([0, 0, 1, 1], [0, 0, 1])
    assert [(x.i, x.j) for x in q.pieces] == [(1, 1)] and q.pieces_of_src(0) == []
    with pytest.raises(ValueError, match="bounds"):
        base.for_window([0, 2, 1, 3], [0, 1, 3])
    # The static sample-level plan is the special case of equal bounds (fan-in 2:1 here).
    fan_in = make_plan(Layout(dp=4), Layout(dp=2, rank_offset=4), 8)
    assert fan_in.src_bounds == [0, 2, 4, 6, 8] and fan_in.dst_bounds == [0, 4, 8]
    assert [(x.i, x.j) for x in fan_in.pieces] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_window_pieces_are_every_nonempty_intersection_in_window_order():
    """The one-pass merge of the bound lists gives what intersecting every pair gives (random bounds,
    empty shards included); `pieces_of_src` / `pieces_of_dst` are its pieces of one shard."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        sdp, ddp, b = rng.randint(1, 7), rng.randint(1, 7), rng.randint(0, 12)
        sb = [0] + sorted(rng.randint(0, b) for _ in range(sdp - 1)) + [b]
        db = [0] + sorted(rng.randint(0, b) for _ in range(ddp - 1)) + [b]
        p = make_plan(Layout(dp=sdp, rank_offset=ddp), Layout(dp=ddp), None).for_window(sb, db)
        brute = sorted((max(sb[i], db[j]), min(sb[i + 1], db[j + 1]), i, j) for i in range(sdp) for j in range(ddp)
                       if max(sb[i], db[j]) < min(sb[i + 1], db[j + 1]))
        assert [(q.start, q.stop, q.i, q.j) for q in p.pieces] == brute, (sb, db)
        assert [q.index for q in p.pieces] == list(range(len(brute)))
        for i in range(sdp):
            assert p.pieces_of_src(i) == [q for q in p.pieces if q.i == i]
        for j in range(ddp):
            assert p.pieces_of_dst(j) == [q for q in p.pieces if q.j == j]


def test_window_unit_sizes_must_cover_the_window():
    base = make_plan(Layout(dp=2, rank_offset=2), Layout(dp=2), None)
    assert base.for_window([0, 1, 3], [0, 2, 3], [4, 4, 4]).unit_tokens == [4, 4, 4]
    with pytest.raises(ValueError, match="unit_tokens has 2 entries for a batch window of 3 units"):
        base.for_window([0, 1, 3], [0, 2, 3], [4, 4])


def test_a_ranks_own_moves_are_its_part_of_the_edges_routes_in_order():
    """What a rank exchanges, found from its own shards, is exactly its sends and receives in the whole
    edge's routes, in their order (the order both peers post), over random colocated layouts and windows."""
    import random

    from mimo.topology.layout import Layout

    rng, checked = random.Random(0), 0
    while checked < 300:
        src = Layout(tp=rng.choice([1, 2]), dp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2]))
        dst = Layout(tp=rng.choice([1, 2]), cp=rng.choice([1, 2]), dp=rng.choice([1, 2, 3]), pp=rng.choice([1, 2]))
        world = src.tp * src.dp * src.pp
        if dst.tp * dst.cp * dst.dp * dst.pp != world:
            continue
        p = make_plan(src, dst, rng.choice([1, 2, 3]) * src.dp * dst.dp)
        fwd, bwd = p.colocated_forward_routes()[0], p.colocated_backward_routes()[0]
        for r in range(world):
            assert p.colocated_forward_moves_of(r) == ([m for m in fwd if m.src == r], [m for m in fwd if m.dst == r])
            assert p.colocated_backward_moves_of(r) == ([m for m in bwd if m.src == r], [m for m in bwd if m.dst == r])
            checked += 1
