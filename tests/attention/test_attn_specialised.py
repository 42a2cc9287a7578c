"""The kernels' compile-time specialisation and launch choices (interpreted on CPU).

* Full and partial tiles run in two loops specialised at compile time; the plan lists each row's
  partial tiles first. Telling the kernels a partial tile is full (no mask) changes the result,
  so the two loops are really taken apart.
* Shapes that divide the tiles (no bounds masks: M_EVEN, N_EVEN, D_EVEN) match the reference,
  alone and with split rows whose items straddle the partial/full boundary.
* The dK/dV and dQ kernels each run with their own tiles and plan.
* The forward splits rows only where it launches too few programs to fill the GPU.
"""

import contextlib

import pytest
import torch
from attn_scenarios import qkv, scenario
from test_attn_kernel import FP32, assert_match, run_both

from mimo.attention import (
    CAUSAL, TEXT, KernelConfig, bitfield_attention, cache_stats, clear_block_cache, reference_attention,
)
from mimo.attention.block_plan import FULL, PARTIAL, get_plan
from mimo.config.kernel import AUTO_SPLIT_TILES
from mimo.attention.inputs import check_inputs
from mimo.attention.kernel_loader import kernels


def _even_layout():
    """s = 64 (four 16-row tiles): causal text with a bidirectional image filling tokens 16-31, two
    packed documents in the second sample. Full tiles below the diagonal and on the image, partial
    ones on the diagonal and across the document boundary."""
    from attn_scenarios import IMG, PAD, PLACEHOLDERS, _ids

    from mimo.attention import build_bitfield_mask

    ids = _ids(2, 64, 7)
    ids[:, 16:32] = IMG
    docs = torch.zeros(2, 64, dtype=torch.int64)
    docs[1, 40:] = 1
    return build_bitfield_mask(ids, PLACEHOLDERS, pad_id=PAD), docs


@pytest.mark.parametrize("split", [0, 1, 3])
def test_even_shapes_and_full_tiles_match_the_reference(split):
    mask, docs = _even_layout()
    b, s = mask.shape
    inputs = qkv(b, s, hq=4, hkv=2, d=32)  # head_dim equals BLOCK_D: no head-dim mask
    cfg = KernelConfig(16, 16, 16, 16, split_tiles=split)
    x = torch.zeros(b, s, 1, 32)
    plan = get_plan(check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs),
                    (mask, mask, None, None, docs, docs), 16, 16, split, kernels(interpret=True))
    counts = plan.counts()
    assert counts["full"] > 0 and counts["partial"] > 0 and s % 16 == 0
    results = run_both(lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=cfg),
                       lambda q, k, v: reference_attention(q, k, v, mask, docs), inputs)
    assert_match(results, **FP32)


def test_each_row_lists_its_partial_tiles_before_its_full_ones():
    mask, docs = _even_layout()
    x = torch.zeros(*mask.shape, 1, 16)
    plan = get_plan(check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs),
                    (mask, mask, None, None, docs, docs), 16, 16, 0, kernels(interpret=True))
    b, n_qb, n_kb = plan.status.shape
    for lists, status in ((plan.rows, plan.status.reshape(b * n_qb, n_kb)),
                          (plan.cols, plan.status.transpose(1, 2).reshape(b * n_kb, n_qb))):
        for r in range(status.shape[0]):
            listed = lists.idx[r, :lists.cnt[r]].tolist()
            npart = int(lists.npart[r])
            partial = sorted(torch.nonzero(status[r] == PARTIAL).flatten().tolist())
            full = sorted(torch.nonzero(status[r] == FULL).flatten().tolist())
            assert listed == partial + full and npart == len(partial)


def test_a_partial_tile_run_as_full_is_caught():
    clear_block_cache()
    mask, docs = _even_layout()
    inputs = [t.detach() for t in qkv(*mask.shape, 2, 2, 16)]
    cfg = KernelConfig(16, 16, 16, 16, split_tiles=0)
    good = bitfield_attention(*inputs, mask, docs, kernel_config=cfg)
    torch.testing.assert_close(good, reference_attention(*inputs, mask, docs), **FP32)
    x = torch.zeros(*mask.shape, 1, 16)
    plan = get_plan(check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs),
                    (mask, mask, None, None, docs, docs), 16, 16, 0, kernels(interpret=True))
    plan.rows.npart.zero_()  # every listed tile now runs through the unmasked (full) loop
    bad = bitfield_attention(*inputs, mask, docs, kernel_config=cfg)
    clear_block_cache()
    assert not torch.allclose(bad, good, atol=1e-3)


def test_dkdv_and_dq_kernels_take_their_own_tiles():
    clear_block_cache()
    mask, docs = scenario("embedded_image_audio")  # s = 70: no tile size divides it
    b, s = mask.shape
    inputs = qkv(b, s, 4, 2, 24)
    cfg = KernelConfig(block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=32, dq_block_m=32, dq_block_n=16,
                       split_tiles=2)
    before = cache_stats()["misses"]
    results = run_both(lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=cfg),
                       lambda q, k, v: reference_attention(q, k, v, mask, docs), inputs)
    assert_match(results, **FP32)
    assert cache_stats()["misses"] - before == 3  # forward, dK/dV and dQ plans: three tile shapes
    clear_block_cache()


def test_forward_splits_rows_only_where_the_gpu_is_not_filled():
    auto = KernelConfig().resolve(128)
    assert auto.split_tiles is None
    assert auto.split_for(programs=100, multiprocessors=132) == AUTO_SPLIT_TILES   # under one wave
    assert auto.split_for(programs=263, multiprocessors=132) == AUTO_SPLIT_TILES
    assert auto.split_for(programs=264, multiprocessors=132) == 0                  # two waves: enough
    assert auto.split_for(programs=10, multiprocessors=None) == 0                  # not a GPU
    fixed = KernelConfig(split_tiles=3).resolve(128)
    assert fixed.split_for(10_000, 132) == 3 and fixed.split_for(1, None) == 3


def test_rows_without_keys_still_zero_under_the_specialised_loops():
    b, s = 1, 48
    mask = torch.full((b, s), CAUSAL | TEXT, dtype=torch.int64)
    mask[0, 16:32] = 0  # a whole padding block
    inputs = qkv(b, s, 2, 1, 16)
    cfg = KernelConfig(16, 16, 16, 16, split_tiles=1)
    results = run_both(lambda q, k, v: bitfield_attention(q, k, v, mask, kernel_config=cfg),
                       lambda q, k, v: reference_attention(q, k, v, mask), inputs)
    assert_match(results, **FP32)
    assert torch.all(results[0][0][0, 16:32] == 0)


@pytest.mark.parametrize("tiles", [dict(bwd_block_m=16, bwd_block_n=16),
                                   dict(bwd_block_m=16, bwd_block_n=32, dq_block_m=32, dq_block_n=16)])
def test_launch_forms_compute_the_same_bits(tiles):
    """The backward as one launch (`fused_backward`: the dK/dV and dQ programs together, each plan's
    tiles, the group's query heads side by side) and every kernel on a 1-D grid with the heads fastest
    (`heads_fastest`, split forward rows included) compute exactly the default launches' output and
    gradients, which match the reference."""
    clear_block_cache()
    mask, docs = scenario("embedded_image_audio")  # s = 70: no tile divides it
    b, s = mask.shape
    inputs = qkv(b, s, 6, 2, 24)  # groups of 3 query heads: a wrong head route shows
    runs = {}
    # Every combination with the first tiles; with the dQ kernel's own tiles, the one-launch forms.
    forms = [(False, False), (True, False), (False, True), (True, True)] if len(tiles) == 2 else \
        [(False, False), (True, False), (True, True)]
    for fused, heads_fastest in forms:
        cfg = KernelConfig(block_m=16, block_n=16, split_tiles=2, fused_backward=fused,
                           heads_fastest=heads_fastest, **tiles)
        with _launches() as launched:
            runs[fused, heads_fastest] = run_both(
                lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=cfg),
                lambda q, k, v: reference_attention(q, k, v, mask, docs), inputs)
        assert_match(runs[fused, heads_fastest], **FP32)
        # The form asked for is the one that ran: which kernels, on which grids.
        backward = ["bwd_kernel"] if fused else ["bwd_dkdv_kernel", "bwd_dq_kernel"]
        assert [name for name, _ in launched] == ["fwd_kernel", "merge_kernel", "bwd_delta_kernel"] + backward
        dims = {name: len(grid) for name, grid in launched}
        assert all(dims[name] == (1 if heads_fastest else 2) for name in ["fwd_kernel"] + backward), launched
    out, grads = runs[False, False][0]
    for key, ((o, g), _) in runs.items():
        assert torch.equal(o, out) and all(torch.equal(a, b) for a, b in zip(g, grads)), key
    clear_block_cache()


@contextlib.contextmanager
def _launches():
    """The attention kernels launched inside the block, as (name, grid), in launch order."""
    kern, launched = kernels(interpret=True), []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            launched.append((self.name, grid))
            return self.fn[grid]

    names = ("fwd_kernel", "merge_kernel", "bwd_delta_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "bwd_kernel")
    originals = {name: getattr(kern, name) for name in names}
    try:
        for name, fn in originals.items():
            setattr(kern, name, Recorder(name, fn))
        yield launched
    finally:
        for name, fn in originals.items():
            setattr(kern, name, fn)


def test_one_launch_backward_with_only_some_gradients():
    mask, docs = scenario("packed_documents")
    b, s = mask.shape
    q, k, v = qkv(b, s, 4, 2, 16)
    cfg = KernelConfig(16, 16, 16, 16, split_tiles=0, fused_backward=True)
    for wrt in ((q,), (k, v), (v,)):
        inputs = [t.detach().requires_grad_(any(t is w for w in wrt)) for t in (q, k, v)]
        ref_inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        g = torch.randn(b, s, 4, 16, generator=torch.Generator().manual_seed(3))
        got = torch.autograd.grad(bitfield_attention(*inputs, mask, docs, kernel_config=cfg),
                                  [t for t in inputs if t.requires_grad], g)
        want = torch.autograd.grad(reference_attention(*ref_inputs, mask, docs),
                                   [t for t in ref_inputs if t.requires_grad], g)
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **FP32)


def test_backward_rows_and_columns_launch_longest_first():
    """A causal mask's dQ rows grow with the row: listed for launch longest first (ties in row order),
    so the longest programs do not start last; every non-empty row once."""
    mask = torch.full((2, 80), CAUSAL | TEXT, dtype=torch.int64)
    mask[1, 64:] = 0  # the second sample's last rows are padding: their tiles are empty
    x = torch.zeros(*mask.shape, 1, 16)
    plan = get_plan(check_inputs(x, x, x, mask, mask), (mask, mask, None, None, None, None), 16, 16, None,
                    kernels(interpret=True))
    for lists in (plan.rows, plan.cols):
        order = lists.nonempty.tolist()
        counts = [int(lists.cnt[r]) for r in order]
        assert sorted(order) == torch.nonzero(lists.cnt > 0).flatten().tolist()
        assert all(a > b or (a == b and r < t)
                   for a, b, r, t in zip(counts, counts[1:], order, order[1:])), (order, counts)
    # Sample 0's last row (5 tiles), then the 4-tile rows: sample 0's row 3 and sample 1's row 3 (its
    # row 4 is padding only, never launched).
    assert plan.rows.nonempty.tolist()[:3] == [4, 3, 8] and 9 not in plan.rows.nonempty.tolist()


@pytest.mark.parametrize("s, d, dlse_kind", [(40, 24, "fp32"), (64, 32, None), (17, 128, "fp32"),
                                             (128, 32, "expanded"), (64, 128, "bf16")])
def test_delta_kernel_is_the_rowwise_product_sum_less_dlse(s, d, dlse_kind):
    """Row blocks that divide the length (128 x 32, 64 x 128) and ones that do not; lse's gradient
    absent, fp32, expanded (stride 0) or bf16."""
    from mimo.attention.function import _delta

    gen = torch.Generator().manual_seed(s)
    out, dout = (torch.randn(2, s, 3, d, generator=gen) for _ in range(2))
    dout = dout.transpose(0, 1).contiguous().transpose(0, 1)  # strides other than out's
    with_dlse = dlse_kind is not None
    dlse = {None: None, "fp32": torch.randn(2, 3, s, generator=gen),
            "expanded": torch.randn(2, 3, 1, generator=gen).expand(2, 3, s),
            "bf16": torch.randn(2, 3, s, generator=gen).to(torch.bfloat16)}[dlse_kind]
    want = (dout * out).sum(-1).transpose(1, 2)
    if with_dlse:
        want = want - dlse.float()
    got = _delta(kernels(interpret=True), True, out, dout, dlse)
    assert got.shape == (2, 3, s) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
