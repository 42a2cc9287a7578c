"""The resume verdict: every rank ends with the same first problem, found in O(1) data per rank."""

import pytest

from mimo.checkpoint import verdict
from mimo.runtime import run_on_ranks

# Per rank: its problems as (order, message); rank 3 has none.
PROBLEMS = [
    [((1, 0, 5), "r0 module 1")],
    [((0, 3, 9), "r1 layer 3"), ((0, 1, 7), "r1 layer 1")],
    [((0, 1, 2), "r2 layer 1")],   # the first in model order
    [],
]
TIE = [[((0, 0, 1), f"rank {r}")] for r in range(4)]  # the same position on every rank: the lowest rank's
FILE = [[], [], [(verdict.FILE_PROBLEM, "f: missing")], [((0, 0, 0), "p")]]


def _verdicts(problems_by_rank, keys, held_by_rank):
    import torch.distributed as dist

    r = dist.get_rank()
    return (verdict.first_problem(problems_by_rank[r]), verdict.first_problem([]),
            verdict.held_by_none(keys, held_by_rank[r]))


@pytest.mark.parametrize("case,want", [(PROBLEMS, ((0, 1, 2), "r2 layer 1")), (TIE, ((0, 0, 1), "rank 0")),
                                       (FILE, (verdict.FILE_PROBLEM, "f: missing"))])
def test_first_problem_is_the_same_on_every_rank(case, want):
    keys = ["a", "b", "c", "d"]
    held = [["a"], ["b", "a"], [], ["zz"]]  # no rank holds c or d; zz is not in the checkpoint
    out = run_on_ranks(_verdicts, 4, case, keys, held, timeout_s=120)
    assert [o[0] for o in out] == [want] * 4
    assert [o[1] for o in out] == [None] * 4  # no rank has a problem
    assert [o[2] for o in out] == [["c", "d"]] * 4


def test_problem_positions_pack_in_model_order():
    orders = [verdict.FILE_PROBLEM, (0, -1, 0), (0, 0, 0), (0, 0, 1), (0, 2, 0), (1, -1, 0), (3, 999, 70000)]
    codes = [verdict._code(o) for o in orders]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    with pytest.raises(ValueError):
        verdict._code((0, 1 << 21, 0))
