"""Loading part of a parameter: the boxes of the full tensor that hold some rows of a rank's shard."""

import random

import pytest
import torch

from mimo.checkpoint.shards import ParamShard


def _local(full, dim, stride, tp_rank, tp_size):
    """What a TP rank holds of `full`: piece `tp_rank` of each of the `stride` parts along `dim`."""
    parts = full.chunk(stride, dim=dim)
    return torch.cat([part.chunk(tp_size, dim=dim)[tp_rank] for part in parts], dim=dim)


@pytest.mark.parametrize("shape,dim,stride,tp_size", [
    ((12, 5), 0, 1, 1),    # not split
    ((12, 5), 0, 1, 2),    # column parallel (QKV, FC1)
    ((12, 5), 0, 2, 2),    # gated FC1: [gate_r; up_r]
    ((6, 8), 1, 1, 2),     # row parallel (projection, FC2)
    ((16,), 0, 1, 2),      # a split bias
    ((9,), 0, 1, 1),       # a norm weight
    ((4, 6, 3), 0, 2, 2),  # more than two axes
])
def test_row_boxes_read_back_any_flat_range_of_a_shard(shape, dim, stride, tp_size):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    rng = random.Random(0)
    for tp_rank in range(tp_size):
        local = _local(full, dim, stride, tp_rank, tp_size)
        s = ParamShard("k", torch.nn.Parameter(local.clone()), "language", tuple(shape), dim, stride, tp_rank,
                       tp_size, (0, 0, 0))
        row = local[0].numel() if local.dim() > 1 else 1
        for _ in range(20):
            a = rng.randrange(local.numel())
            b = rng.randrange(a + 1, local.numel() + 1)
            r0, r1 = a // row, -(-b // row)
            boxes = s.row_boxes(r0, r1)
            got = s.join([full[tuple(slice(o, o + n) for o, n in zip(off, size))] for off, size in boxes])
            assert torch.equal(got.reshape(-1)[a - r0 * row:b - r0 * row], local.reshape(-1)[a:b])
            # only the rows asked for: the boxes hold (r1 - r0) rows' worth of elements
            assert sum(torch.Size(size).numel() for _, size in boxes) == (r1 - r0) * row


def test_row_boxes_of_the_other_tp_rank_read_other_values():
    """Negative control: the boxes of the other TP rank's shard do not read this rank's rows."""
    full = torch.arange(48.0).reshape(12, 4)
    mine = _local(full, 0, 2, 0, 2)
    other = ParamShard("k", torch.nn.Parameter(_local(full, 0, 2, 1, 2)), "language", (12, 4), 0, 2, 1, 2, (0, 0, 0))
    got = other.join([full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]] for o, n in other.row_boxes(2, 4)])
    assert not torch.equal(got, mine[2:4])
