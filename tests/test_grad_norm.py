"""The global gradient norm: megatron-core's fused fp32 L2 norm over contiguous views of the DDP grad
buffers (`mimo.training.optimizer.norm_views`), each gradient element counted on exactly one rank.

Oracles: the per-parameter fp64 norm of the whole model (simulated ranks, no processes), and the
1-rank run's norms (real layouts on gloo ranks)."""

import zlib

import pytest
import torch

from mimo.training import optimizer as optimizer_module
from mimo.training.optimizer import NORM_CHUNK, norm_ranges, sq_norm_fp32
from tiny import PARITY_ADAM_EPS

# -- simulated ranks: megatron's grad-buffer layout, no processes --------------------------------------


class _Param:
    def __init__(self, name, numel, tp_sharded, shared=False):
        self.name, self.numel, self.tensor_model_parallel = name, numel, tp_sharded
        if shared:
            self.shared = True


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _Bucket:
    def __init__(self, grad_data, offset):
        self.grad_data, self.offset = grad_data, offset


PARAMS = [_Param("embedding", 300, True), _Param("ln.weight", 16, False), _Param("ln.bias", 16, False),
          _Param("qkv.weight", 480, True), _Param("proj.weight", 160, True), _Param("proj.bias", 16, False),
          _Param("fc1.weight", 640, True), _Param("fc2.weight", 640, True), _Param("fc2.bias", 16, False),
          _Param("output.copy", 300, True, shared=True)]


def values(p, tp_rank):
    """A parameter's gradient on one TP rank (its shard; the same on every rank when TP-replicated)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{p.name}/{tp_rank if p.tensor_model_parallel else 0}".encode()))
    return torch.randn(p.numel, generator=g, dtype=torch.float64)


def buffer(tp_rank, dp_size, dp_rank, distopt, bucket_numel=900, dtype=torch.float32):
    """A megatron-style buffer: params in reverse order, buckets closed after `bucket_numel` elements
    and, with the distributed optimizer, padded to a multiple of the DP size (padding is zero)."""
    index, buckets, at, start = {}, [], 0, 0
    for p in reversed(PARAMS):
        index[p] = (at, at + p.numel, len(buckets))
        at += p.numel
        if at - start >= bucket_numel or p is PARAMS[0]:
            end = at + (-(at - start) % dp_size if distopt else 0)
            buckets.append((start, end))
            at = start = end
    grad = torch.zeros(at, dtype=dtype)
    for p, (a, b, _) in index.items():
        grad[a:b] = values(p, tp_rank).to(dtype)
    buf = type("Buffer", (), {})()
    buf.grad_data, buf.param_index_map = grad, index
    buf.buckets = [_Bucket(grad[a:b], a) for a, b in buckets]
    buf.data_parallel_group = _Group(dp_size, dp_rank)
    return buf


def oracle(tp, dtype=torch.float32):
    """fp64, per parameter: every TP shard once, TP-replicated parameters once, the shared copy never."""
    total = 0.0
    for p in PARAMS:
        if getattr(p, "shared", False):
            continue
        for r in range(tp if p.tensor_model_parallel else 1):
            total += float((values(p, r).to(dtype).double() ** 2).sum())
    return total


def simulated_sq_norm(tp, dp, distopt, dtype=torch.float32):
    """Sum over the TP x DP ranks of each rank's share (what clip()'s world all-reduce adds up)."""
    total = 0.0
    for t in range(tp):
        for d in range(dp):
            buf = buffer(t, dp, d, distopt, dtype=dtype)
            views = [buf.grad_data[a:b] for a, b in norm_ranges(buf, t)]
            total += float(sq_norm_fp32(views, "cpu"))
    return total


@pytest.mark.parametrize("tp,dp,distopt", [(1, 1, False), (2, 1, False), (2, 3, False), (2, 4, True), (4, 2, True)])
def test_rank_shares_count_every_element_once(tp, dp, distopt):
    assert simulated_sq_norm(tp, dp, distopt) == pytest.approx(oracle(tp), rel=1e-6)
    # The slices of one TP rank's DP ranks are disjoint and, with the TP-replicated parameters left out
    # on TP rank > 0, cover exactly the counted elements.
    for t in range(tp):
        covered = []
        for d in range(dp):
            buf = buffer(t, dp, d, distopt)
            covered += [i for a, b in norm_ranges(buf, t) for i in range(a, b)]
        assert len(covered) == len(set(covered))
        want = {i for p, (a, b, _) in buf.param_index_map.items() if optimizer_module.counted(p, t)
                for i in range(a, b)}
        assert want <= set(covered) and all(float(buf.grad_data[i]) == 0 for i in set(covered) - want)


def test_bf16_buffer_norm_in_fp32():
    assert simulated_sq_norm(2, 2, True, torch.bfloat16) == pytest.approx(oracle(2, torch.bfloat16), rel=1e-6)


def test_a_double_count_is_caught(monkeypatch):
    # TP-replicated weights counted on every TP rank,
    monkeypatch.setattr(optimizer_module, "counted", lambda p, tp_rank: True)
    assert simulated_sq_norm(2, 2, True) > oracle(2) * (1 + 1e-4)
    monkeypatch.undo()
    # and every DP rank counting the whole bucket (as if its slice were all of it).
    monkeypatch.setattr(_Group, "size", lambda self: 1)
    monkeypatch.setattr(_Group, "rank", lambda self: 0)
    assert simulated_sq_norm(2, 2, False) == pytest.approx(2 * oracle(2), rel=1e-6)


def test_chunked_fp32_norm_keeps_its_digits_on_a_long_buffer():
    # 2^26 ones: an fp32 running sum stalls at 2^24; the per-chunk norms are exact.
    t = torch.ones(1 << 26)
    assert float(sq_norm_fp32([t], "cpu")) == float(1 << 26)
    odd = torch.ones(3 * NORM_CHUNK + 5)  # a tail shorter than a chunk
    assert float(sq_norm_fp32([odd, odd[:7]], "cpu")) == 3 * NORM_CHUNK + 5 + 7
    assert float(sq_norm_fp32([], "cpu")) == 0.0


# -- real layouts against one rank ---------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def reference():
    from mimo.runtime import run_on_ranks
    from test_optimizer import _adam, _norms

    ref = run_on_ranks(_norms, 1, _adam(clip_grad=0.05), STEPS)[0]
    assert all(n > 0.05 for n in ref["norms"])  # every step clips: a wrong norm changes the weights
    return ref


@pytest.mark.parametrize("modules,world,training", [
    (dict(language=dict(tp=2, dp=2, sp=True), images=dict(tp=2, dp=2, sp=True), audio=dict(tp=2, dp=2, sp=True)),
     4, {}),
    (dict(language=dict(dp=2), images=dict(dp=2, rank_offset=2), audio=dict(rank_offset=4)), 5,
     dict(use_distributed_optimizer=True)),
], ids=["tp2xdp2_sp_plain_optimizer", "noncolocated_dp2_distributed_optimizer"])
def test_grad_norm_equals_one_rank(reference, modules, world, training):
    """Without the distributed optimizer every DP rank holds the whole reduced buffer and counts its
    1/DP slice; per-module DP groups (non-colocated encoders, a rank without an LLM) each count theirs."""
    from mimo.runtime import run_on_ranks
    from test_heterogeneous_parity import layout
    from test_optimizer import _norms

    raw = layout(**modules)
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=STEPS, clip_grad=0.05, adam_eps=PARITY_ADAM_EPS,
                           **training)  # `_adam`'s settings: the reference's
    for r in run_on_ranks(_norms, world, raw, STEPS, timeout_s=300):
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
