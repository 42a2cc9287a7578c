"""Tile classification vs brute force, work lists, and the plan cache."""

import gc

import pytest
import torch
from attn_scenarios import qkv, scenario
from host_reads import on_host_reads

from mimo.attention import KernelConfig, bitfield_attention, cache_stats, clear_block_cache, reference_attention
from mimo.attention.block_plan import EMPTY, FULL, PARTIAL, build_plan, classify
from mimo.attention.inputs import allowed_matrix, check_inputs
from mimo.attention.kernel_loader import kernels


def brute_force_status(inp, bm, bn):
    ok = allowed_matrix(inp)
    b, s_q, s_k = ok.shape
    n_qb, n_kb = -(-s_q // bm), -(-s_k // bn)
    padded = torch.zeros(b, n_qb * bm, n_kb * bn, dtype=torch.bool)
    in_range = torch.zeros_like(padded)
    padded[:, :s_q, :s_k] = ok
    in_range[:, :s_q, :s_k] = True
    tiles = lambda t: t.reshape(b, n_qb, bm, n_kb, bn).sum(dim=(2, 4))  # noqa: E731
    n_ok = tiles(padded)
    status = torch.full((b, n_qb, n_kb), PARTIAL, dtype=torch.int8)
    status[n_ok == 0] = EMPTY
    status[n_ok == bm * bn] = FULL
    return status


@pytest.mark.parametrize("name,bm,bn", [("packed_documents", 16, 16), ("padding_odd_length", 16, 32),
                                        ("embedded_image_audio", 32, 16)])
def test_classification_matches_brute_force(name, bm, bn):
    mask, docs = scenario(name)
    x = torch.zeros(*mask.shape, 1, 16)
    inp = check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs)
    plan = build_plan(inp, bm, bn, 2, kernels(interpret=True))
    expected = brute_force_status(inp, bm, bn)
    assert torch.equal(plan.status, expected)
    counts = plan.counts()
    assert counts == {"empty": int((expected == EMPTY).sum()), "partial": int((expected == PARTIAL).sum()),
                      "full": int((expected == FULL).sum())}
    assert counts["empty"] > 0 and counts["partial"] > 0  # the layouts exercise skipping

    # Work lists cover exactly the non-empty tiles, in order; empty tiles are never scheduled.
    b, n_qb, n_kb = plan.status.shape
    flat = plan.status.reshape(b * n_qb, n_kb)
    items = plan.items
    scheduled = torch.zeros_like(flat, dtype=torch.int32)
    for row, start, length in zip(items.row.tolist(), items.start.tolist(), items.length.tolist()):
        assert 1 <= length <= 2
        for t in range(start, start + length):
            col = plan.rows.idx[row, t]
            scheduled[row, col] += 1
            assert plan.rows.full[row, t] == int(flat[row, col] == FULL)
    assert torch.equal(scheduled, (flat != EMPTY).to(torch.int32))
    assert items.n_slots == int(items.slot.ge(0).sum())


def test_general_positions_classification():
    mask, _ = scenario("embedded_image_audio")
    q_pos = torch.arange(2, 70, 2)
    x = torch.zeros(2, q_pos.numel(), 1, 16)
    k = torch.zeros(2, 70, 1, 16)
    inp = check_inputs(x, k, k, mask[:, q_pos], mask, q_positions=q_pos)
    plan = build_plan(inp, 16, 16, None, kernels(interpret=True))
    assert torch.equal(plan.status, brute_force_status(inp, 16, 16))
    assert plan.items is None


def test_classification_grid_fits_any_key_count():
    """More key tiles than a grid's y or z axis allows (65535): the tile pairs go on axis x."""
    launches = []

    class Recorder:  # stands in for the kernel set: records the launch, runs nothing
        class classify_kernel:
            def __class_getitem__(cls, grid):
                launches.append(grid)
                return lambda *args, **kwargs: None

    s_k = 70_000
    mask = torch.ones(1, s_k, dtype=torch.int64)
    x = torch.zeros(1, 3, 1, 1)
    k = torch.zeros(1, s_k, 1, 1)
    inp = check_inputs(x, k, k, mask[:, :3], mask, q_positions=torch.arange(3))
    status = classify(inp, 1, 1, Recorder)
    assert status.shape == (1, 3, s_k)
    (grid,) = launches
    assert grid == (3 * s_k, 1)
    assert all(n <= 65535 for n in grid[1:]) and grid[0] < 2**31


def _run(mask, inputs, cfg):
    return bitfield_attention(*[t.detach() for t in inputs], mask, kernel_config=cfg)


def test_cache_hits_and_invalidation(tiny_config):
    clear_block_cache()
    mask, _ = scenario("text_blind_to_audio")
    inputs = qkv(*mask.shape, 2, 2, 16)
    out1 = _run(mask, inputs, tiny_config)
    misses = cache_stats()["misses"]
    _run(mask, inputs, tiny_config)
    _run(mask.detach(), inputs, tiny_config)  # an alias, as megatron's recomputation passes
    assert cache_stats()["misses"] == misses

    # In-place change: version counter bumps, plan rebuilt, result follows the new mask.
    mask[:, 40:] = 0
    out2 = _run(mask, inputs, tiny_config)
    assert cache_stats()["misses"] == misses + 1
    torch.testing.assert_close(out2, reference_attention(*inputs, mask).detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out1, out2)

    # Another microbatch: same shape, new tensor, different content.
    other = torch.roll(mask, 7, dims=1)
    out3 = _run(other, inputs, tiny_config)
    torch.testing.assert_close(out3, reference_attention(*inputs, other).detach(), atol=1e-5, rtol=1e-5)

    # A different length with the same mask values must not reuse a plan either.
    short = mask[:, :33].clone()
    out4 = _run(short, [t[:, :33] for t in inputs], tiny_config)
    torch.testing.assert_close(out4, reference_attention(*[t[:, :33] for t in inputs], short).detach(),
                               atol=1e-5, rtol=1e-5)

    # Different tile sizes are separate entries.
    before = cache_stats()["misses"]
    _run(mask, inputs, KernelConfig(32, 16, 32, 16, split_tiles=0))
    assert cache_stats()["misses"] > before
    clear_block_cache()
    assert cache_stats()["size"] == 0


def test_cache_keeps_the_plan_of_every_live_mask_and_drops_dead_ones():
    """However many microbatches are in flight (masks alive), each keeps its plan: a second pass over
    20 live masks (the old LRU held 16) rebuilds nothing. A plan goes when its mask's storage does."""
    from mimo.attention.block_plan import get_plan

    clear_block_cache()
    kern = kernels(interpret=True)
    base, _ = scenario("text_blind_to_audio")

    def plan_of(m):
        x = torch.zeros(m.shape[0], m.shape[1], 1, 16)
        return get_plan(check_inputs(x, x, x, m, m), (m, m, None, None, None, None), 16, 16, None, kern)

    masks = [torch.roll(base, k, dims=1) for k in range(20)]
    first = [plan_of(m) for m in masks]
    misses = cache_stats()["misses"]
    same = [plan_of(m) is p for m, p in zip(masks, first)]
    alias = plan_of(masks[3].detach()) is first[3]  # an alias (megatron's recompute) hits too
    assert all(same) and alias
    assert cache_stats()["misses"] == misses and cache_stats()["size"] == 20
    # The Triton interpreter keeps its last launch's arguments in a reference cycle: collect it.
    del masks[:10]
    gc.collect()
    assert cache_stats()["size"] == 10
    masks.clear()
    gc.collect()
    assert cache_stats()["size"] == 0


def test_default_masks_are_one_row_per_length_for_every_batch_size():
    """The mask of a call without one (encoders: bidirectional over each item) is one [1, s] row per
    pattern and length, expanded to the call's batch: 11 different item counts (the old shape-keyed
    cache cleared itself at 8) share it, so their plans stay keyed on one live storage."""
    from mimo.attention import bidirectional_mask, causal_mask
    from mimo.attention.core_attention import _default_mask

    rows = [_default_mask(False, b, 24, "cpu") for b in range(1, 12)]
    assert len({r.untyped_storage().data_ptr() for r in rows}) == 1
    assert all(torch.equal(r, bidirectional_mask(b, 24)) for b, r in zip(range(1, 12), rows))
    causal = _default_mask(True, 5, 24, "cpu")
    assert torch.equal(causal, causal_mask(5, 24))
    assert causal.untyped_storage().data_ptr() != rows[0].untyped_storage().data_ptr()
    assert _default_mask(False, 3, 24, "cpu").untyped_storage().data_ptr() == rows[0].untyped_storage().data_ptr()


# What waits for the device: a Python read of a tensor's value (`host_reads`), and an operator whose
# result's size depends on the values (its output must be sized on the host first).
SIZED_BY_VALUES = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                   "aten.unique_dim.default", "aten.unique_consecutive.default"}


class _Waits:
    """Counts, while active, the reads of tensor values and the value-sized operators (repeat_interleave
    counts unless told its output size)."""

    def __init__(self):
        self.reads, self.ops = [], []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        waits = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func)
                if name in SIZED_BY_VALUES or name == "aten._local_scalar_dense.default" or (
                        name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
                    waits.ops.append(name)
                return func(*args, **kwargs)

        self._reads = on_host_reads(lambda name, tensor, caller: self.reads.append(name))
        self._reads.__enter__()
        self._mode = Ops()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._reads.__exit__(*exc)


def test_a_new_mask_waits_for_the_device_once_for_all_its_plans():
    """The forward builds the plans of the forward, dK/dV and dQ tiles (three different here) with one
    read of their sizes from the device and no value-sized operator: on a GPU, every other read would
    stall the host mid-forward until the device caught up. A known mask reads nothing. Each plan still
    matches one built alone."""
    from mimo.attention.block_plan import get_plans

    clear_block_cache()
    kern = kernels(interpret=True)
    mask, docs = scenario("embedded_image_audio")
    x = torch.zeros(*mask.shape, 1, 16)
    inp = check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs)
    key = (mask, mask, None, None, docs, docs)
    tiles = [(16, 16, 1), (32, 16, None), (16, 32, None)]
    with _Waits() as waits:
        plans = get_plans(inp, key, tiles, kern)
    assert waits.reads == ["tolist"] and waits.ops == []
    with _Waits() as again:
        assert all(p is q for p, q in zip(get_plans(inp, key, tiles, kern), plans))
    assert again.reads == [] and again.ops == []
    for (bm, bn, split), plan in zip(tiles, plans):
        alone = build_plan(inp, bm, bn, split, kern)
        for name in ("idx", "full", "cnt", "npart", "nonempty"):
            assert torch.equal(getattr(plan.rows, name), getattr(alone.rows, name))
            assert torch.equal(getattr(plan.cols, name), getattr(alone.cols, name))
        assert (plan.items is None) == (split is None)
    assert plans[0].items.n_slots > 0  # split rows: the merge's lists are sized from the read too


def test_a_plan_build_with_a_bad_mask_says_which():
    x = torch.zeros(1, 8, 1, 16)
    good = torch.ones(1, 8, dtype=torch.int64)
    bad = good.clone()
    bad[0, 3] = -1
    with pytest.raises(ValueError, match="k_mask has bit 63 set"):
        build_plan(check_inputs(x, x, x, good, bad), 16, 16, None, kernels(interpret=True))
