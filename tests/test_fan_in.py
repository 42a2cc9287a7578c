"""Two-level host collectives (node, then leaders) give what one group of every rank would."""

import pytest
import torch
import torch.distributed as dist

from mimo.runtime import run_on_ranks
from mimo.runtime.fan_in import FanIn


def _collectives(per_node):
    fan = FanIn(5, per_node=per_node)
    r = dist.get_rank()
    high = torch.tensor([r * 10, -r], dtype=torch.int64)
    fan.all_reduce(high, op=dist.ReduceOp.MAX)
    low = torch.tensor([r + 3], dtype=torch.int64)
    fan.all_reduce(low, op=dist.ReduceOp.MIN)
    total = torch.tensor([r + 1], dtype=torch.int64)
    fan.all_reduce(total, op=dist.ReduceOp.SUM)
    gathered = fan.all_gather_object({"rank": r, "payload": list(range(r))})
    return high.tolist(), low.tolist(), total.tolist(), gathered, fan.leader


@pytest.mark.parametrize("per_node", [1, 2, 3, 5, None])
def test_fan_in_equals_one_group_of_every_rank(per_node):
    world = 5
    out = run_on_ranks(_collectives, world, per_node, timeout_s=120)
    for r, (high, low, total, gathered, leader) in enumerate(out):
        assert high == [40, 0] and low == [3] and total == [15]
        assert gathered == [{"rank": q, "payload": list(range(q))} for q in range(world)]  # rank order
        per = per_node or world  # None: LOCAL_WORLD_SIZE (one node under run_on_ranks)
        assert leader == r - r % per


def _with_local_size(sizes):
    """FanIn from LOCAL_WORLD_SIZE, which this rank sees as `sizes[rank]` (nodes launched unevenly)."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(sizes[dist.get_rank()])
    fan = FanIn(5)
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    fan.all_reduce(total, op=dist.ReduceOp.SUM)
    return fan.leader, total.tolist(), fan.all_gather_object(dist.get_rank())


def test_ranks_that_see_different_node_sizes_still_build_the_same_groups():
    """Without agreeing on the node size, ranks would create different groups and hang; they take the
    smallest, so blocks of 2 here."""
    out = run_on_ranks(_with_local_size, 5, [3, 3, 3, 2, 2], timeout_s=120)
    assert [leader for leader, _, _ in out] == [0, 0, 2, 2, 4]
    assert all(total == [10] and gathered == list(range(5)) for _, total, gathered in out)
