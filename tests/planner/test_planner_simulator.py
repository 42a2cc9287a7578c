import pytest

from mimo.planner.simulator import SimStage, chain, pipeline_pass_time, simulate_1f1b, simulate_colocated


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 4), (1, 5)])
def test_equal_stages_match_textbook_1f1b(p, m):
    f, b = 1.0, 2.0
    result = simulate_1f1b(chain("s", [f] * p, [b] * p), m)
    assert result.iteration_time == pytest.approx((m + p - 1) * (f + b))
    # the bubble is the (p - 1) fill/drain slots out of m + p - 1
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_hand_timeline_two_stages():
    # stage 0: F0 F1 B0 F2 B1 F3 B2 B3 ; stage 1: F0 B0 F1 B1 ...
    f, b, m = 1.0, 1.0, 4
    res = simulate_1f1b(chain("s", [f, f], [b, b]), m, record=True)
    ev = {(s, k, mb): (t0, t1) for s, k, mb, t0, t1 in res.events}
    assert ev[("s1", "F", 0)] == (f, 2 * f)
    assert ev[("s1", "B", 0)] == (2 * f, 2 * f + b)
    assert ev[("s0", "B", 0)] == (2 * f + b, 2 * f + 2 * b)
    assert res.iteration_time == pytest.approx((m + 2 - 1) * (f + b))


def test_slow_stage_paces_pipeline():
    fs, bs, m = [1.0, 3.0], [1.0, 3.0], 5
    t = simulate_1f1b(chain("s", fs, bs), m).iteration_time
    # fill through every stage once, then the slowest stage repeats m - 1 times
    assert t == pytest.approx(sum(fs) + sum(bs) + (m - 1) * (3.0 + 3.0))


def test_transfer_time_adds_on_every_edge_crossing():
    f, b, x, m = 1.0, 1.0, 0.5, 1
    t = simulate_1f1b(chain("s", [f, f], [b, b], transfer=x), m).iteration_time
    assert t == pytest.approx(2 * f + 2 * b + 2 * x)


def test_join_waits_for_all_encoders():
    m = 3
    enc_a = SimStage("a", 2.0, 0.0)
    enc_b = SimStage("b", 1.0, 0.0)
    llm = SimStage("l", 1.0, 1.0, {"a": 0.0, "b": 0.0})
    t = simulate_1f1b([enc_a, enc_b, llm], m).iteration_time
    # frozen encoders run forwards back to back; the LLM follows the slower one
    expected = max(2.0 * (k + 1) for k in range(m)) + 1.0 + 1.0
    assert t == pytest.approx(expected)


def test_backward_flows_back_into_trainable_encoder():
    m = 2
    enc = SimStage("e", 1.0, 1.0)
    llm = SimStage("l", 1.0, 1.0, {"e": 0.0})
    t = simulate_1f1b([enc, llm], m).iteration_time
    assert t == pytest.approx((m + 2 - 1) * 2.0)  # same as a 2-stage chain


def test_pipeline_pass_and_colocated_phases_add():
    fs, bs, n = [1.0, 2.0], [0.5, 1.5], 4
    assert pipeline_pass_time(fs, n) == pytest.approx(sum(fs) + (n - 1) * max(fs))
    llm = chain("l", [1.0], [2.0])
    total = simulate_colocated(llm, 3, [(fs, bs, n, 0.0)])
    expected = (sum(fs) + (n - 1) * max(fs)) + 3 * (1.0 + 2.0) + (sum(bs) + (n - 1) * max(bs))
    assert total == pytest.approx(expected)


def test_graph_errors():
    with pytest.raises(ValueError):
        simulate_1f1b([SimStage("a", 1, 1, {"zz": 0.0})], 1)
    with pytest.raises(ValueError):
        simulate_1f1b([SimStage("a", 1, 1), SimStage("b", 1, 1)], 1)  # two sinks
