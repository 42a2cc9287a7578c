"""Triton bitfield attention (interpreted on CPU) against the dense reference."""

import pytest
import torch
from attn_scenarios import NAMES, qkv, scenario

from mimo.attention import (
    CAUSAL, TEXT, KernelConfig, bitfield_attention, bitfield_attention_general, reference_attention,
    reference_attention_general,
)

FP32 = dict(atol=1e-5, rtol=1e-5)


def run_both(fn, ref, inputs, grad_seed=1, **kwargs):
    """Outputs and (dq, dk, dv) of the kernel and of the reference for one upstream gradient."""
    results = []
    for f in (fn, ref):
        q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
        out = f(q, k, v, **kwargs)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), g)
        results.append((out.detach(), grads))
    return results


def assert_match(results, **tol):
    (out, grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(out, ref_out, **tol)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, rg, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_fp32(name, tiny_config):
    mask, docs = scenario(name)
    b, s = mask.shape
    inputs = qkv(b, s, hq=4, hkv=2, d=24)  # GQA; head_dim padded to 32 inside the kernel
    results = run_both(
        lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=tiny_config),
        lambda q, k, v: reference_attention(q, k, v, mask, docs), inputs)
    assert_match(results, **FP32)


def test_wrong_mask_is_detected(tiny_config):
    mask, _ = scenario("text_blind_to_audio")
    b, s = mask.shape
    wrong = mask.clone()
    wrong[:, 45] |= 1 << 2  # one more text token that sees the audio clip
    inputs = qkv(b, s, 2, 2, 16)
    results = run_both(
        lambda q, k, v: bitfield_attention(q, k, v, mask, kernel_config=tiny_config),
        lambda q, k, v: reference_attention(q, k, v, wrong), inputs)
    with pytest.raises(AssertionError):
        assert_match(results, **FP32)


def test_rows_without_keys_are_zero_with_finite_grads(tiny_config):
    b, s = 1, 40
    mask = torch.full((b, s), CAUSAL | TEXT, dtype=torch.int64)
    mask[0, 16:34] = 0          # padding spanning a whole 16-row block: empty tiles, never launched
    mask[0, 5] = 1 << 3         # a modality token alone: sees itself only
    inputs = qkv(b, s, 2, 1, 16)
    results = run_both(
        lambda q, k, v: bitfield_attention(q, k, v, mask, kernel_config=tiny_config),
        lambda q, k, v: reference_attention(q, k, v, mask), inputs)
    assert_match(results, **FP32)
    out = results[0][0]
    assert torch.all(out[0, 16:34] == 0)
    assert torch.all(results[0][1][0][0, 16:34] == 0)  # dq of padding rows


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision(dtype, tol, tiny_config):
    mask, docs = scenario("packed_documents")
    b, s = mask.shape
    inputs = qkv(b, s, 4, 2, 32, dtype=dtype)
    (out, grads), _ = run_both(
        lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=tiny_config),
        lambda q, k, v: reference_attention(q, k, v, mask, docs), inputs)
    # Reference in fp32 from the same low-precision inputs.
    (ref_out, ref_grads), _ = run_both(
        lambda q, k, v: reference_attention(q.float(), k.float(), v.float(), mask, docs),
        lambda q, k, v: reference_attention(q.float(), k.float(), v.float(), mask, docs), inputs)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), rg.float(), atol=tol * 4, rtol=tol * 4)


def test_large_head_dim(tiny_config):
    mask, _ = scenario("prefix_image")
    mask = mask[:1, :24]
    inputs = qkv(1, 24, 1, 1, 200)  # padded to 256
    results = run_both(
        lambda q, k, v: bitfield_attention(q, k, v, mask, kernel_config=tiny_config),
        lambda q, k, v: reference_attention(q, k, v, mask), inputs)
    assert_match(results, atol=2e-5, rtol=2e-5)


def test_general_form_positions_and_lse(tiny_config):
    """Queries are a strided subset of the keys (as under context parallelism)."""
    mask, docs = scenario("embedded_image_audio")
    b, s = mask.shape
    q_pos = torch.arange(1, s, 3)          # 23 query tokens, global positions
    q_mask, q_docs = mask[:, q_pos], None
    inputs = qkv(b, q_pos.numel(), 4, 2, 16, s_k=s)
    kwargs = dict(q_positions=q_pos, k_positions=torch.arange(s).expand(b, s),
                  softmax_scale=0.3)
    results = run_both(
        lambda q, k, v: bitfield_attention_general(q, k, v, q_mask, mask, kernel_config=tiny_config, **kwargs),
        lambda q, k, v: reference_attention_general(q, k, v, q_mask, mask, **kwargs), inputs)
    assert_match(results, **FP32)

    # lse is returned and differentiable (CP merges partial results with it).
    def with_lse(f, **extra):
        def run(q, k, v):
            out, lse = f(q, k, v, q_mask, mask, return_lse=True, **kwargs, **extra)
            return out * torch.where(torch.isfinite(lse), lse, 0).transpose(1, 2)[..., None]
        return run
    results = run_both(with_lse(bitfield_attention_general, kernel_config=tiny_config),
                       with_lse(reference_attention_general), inputs)
    assert_match(results, **FP32)


def test_split_and_merge_path_matches_unsplit():
    mask, docs = scenario("embedded_image_audio")
    b, s = mask.shape
    inputs = qkv(b, s, 2, 2, 16)
    outs = []
    for split in (0, 1, 2):
        cfg = KernelConfig(16, 16, 16, 16, split_tiles=split)
        out, lse = bitfield_attention(*inputs, mask, docs, return_lse=True, kernel_config=cfg)
        outs.append((out.detach(), lse.detach()))
    ref_out, ref_lse = reference_attention(*inputs, mask, docs, return_lse=True)
    for out, lse in outs:
        torch.testing.assert_close(out, ref_out.detach(), **FP32)
        torch.testing.assert_close(lse, ref_lse.detach(), **FP32)


def test_deterministic_bitwise(tiny_config):
    mask, docs = scenario("packed_documents")
    b, s = mask.shape
    inputs = qkv(b, s, 4, 1, 16)
    runs = [run_both(lambda q, k, v: bitfield_attention(q, k, v, mask, docs, kernel_config=tiny_config),
                     lambda q, k, v: q.sum() * 0 + k.sum() * 0 + v.sum() * 0, inputs)[0] for _ in range(2)]
    (o1, g1), (o2, g2) = runs
    assert torch.equal(o1, o2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_input_errors_name_the_argument():
    mask = torch.full((1, 8), TEXT, dtype=torch.int64)
    q = torch.zeros(1, 8, 3, 16)
    kv = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        bitfield_attention(q, kv, kv, mask)
    with pytest.raises(TypeError, match="mask"):
        bitfield_attention(kv, kv, kv, mask.int())
    with pytest.raises(ValueError, match="q_mask"):
        bitfield_attention(kv, kv, kv, mask[:, :5])
    with pytest.raises(TypeError, match="dtype"):
        bitfield_attention(kv.double(), kv.double(), kv.double(), mask)
    with pytest.raises(ValueError, match="head_dim"):
        z = torch.zeros(1, 8, 1, 300)
        bitfield_attention(z, z, z, mask)
    with pytest.raises(ValueError, match="bit 63"):
        bitfield_attention(kv, kv, kv, mask | (1 << 63))
