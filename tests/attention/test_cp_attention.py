"""All-gather context-parallel attention on CPU ranks (gloo) vs the single-rank reference.

The default run is one 2-rank launch of the CP=2 cases (every policy, packed documents, padding, a
Triton case); the 4-rank launch with -m slow runs every case: CP=2 on groups {0,1} and {2,3}, CP=4
on {0..3} (including a rank that holds only padding).
Every rank computes the dense single-process reference from the same global
tensors and checks its own outputs and gradients (dq, dk, dv after the
reduce-scatter) against that reference cut to its slots; outputs are also
gathered and un-permuted to check the whole sequence, and un-permuting with a
different policy's layout must fail the check.
"""

import pytest
import torch
import torch.distributed as dist

from attn_scenarios import qkv, scenario
from mimo.runtime import run_on_ranks

TOL = dict(atol=2e-6, rtol=2e-5)


def _groups():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for cp in (2, 4):
        for members in [list(range(i, i + cp)) for i in range(0, world - cp + 1, cp)]:
            g = dist.new_group(members)  # collective over the world: every rank creates every group
            if rank in members:
                out[cp] = (g, members)
    return out


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _run_case(groups, name, cp, policy, block, use_reference, head_chunks, kernel_config=None):
    from mimo.attention import reference_attention_general
    from mimo.attention.context_parallel import ContextParallelMask, context_parallel_attention
    from mimo.attention.cp_permute import permute_to_local, plan_context_parallel, unpermute

    group, members = groups[cp]
    r = members.index(dist.get_rank())
    mask, docs = scenario(name)
    b, s = mask.shape
    hq, hkv, d = 4, 2, 8
    q, k, v = qkv(b, s, hq, hkv, d, seed=7)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(8))
    ref = reference_attention_general(q, k, v, mask, mask, q_document_ids=docs, k_document_ids=docs)
    ref.backward(dout)

    slots = plan_context_parallel(mask, cp, block, policy, docs)
    cpm = ContextParallelMask(mask, slots, r, docs)
    ql, kl, vl = (permute_to_local(t.detach(), slots, r).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, cpm, group, use_reference=use_reference,
                                     kernel_config=kernel_config, head_chunks=head_chunks)
    (out * permute_to_local(dout, slots, r)).sum().backward()

    tag = f"{name} cp={cp} {policy} block={block} ref={use_reference} chunks={head_chunks}"
    pad = slots[r] < 0
    for label, got, want in (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                             ("dv", vl.grad, v.grad)):
        want_local = permute_to_local(want.detach(), slots, r)
        assert _close(got.detach(), want_local), f"{tag}: {label} differs, max err " \
            f"{(got.detach() - want_local).abs().max().item():.3g}"
        assert bool((got.detach()[:, pad] == 0).all()), f"{tag}: {label} is not zero on padding slots"
    # Whole sequence: gather every rank's output, undo the permutation.
    gathered = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(gathered, out.detach().contiguous(), group=group)
    full = unpermute(gathered, slots)
    assert _close(full, ref.detach()), f"{tag}: un-permuted output differs"
    # A different layout (contiguous vs this policy) must not reproduce the reference.
    other = plan_context_parallel(mask, cp, block, "contiguous" if policy != "contiguous" else "zigzag", docs)
    wrong_caught = None
    if not torch.equal(other, slots):
        wrong_caught = other.shape != slots.shape or not _close(unpermute(gathered, other), ref.detach())
        assert wrong_caught, f"{tag}: un-permuting with the wrong layout passed the check"
    return tag, wrong_caught


CASES = [
    # (scenario, cp, policy, block, use_reference, head_chunks)
    ("embedded_image_audio", 2, "lpt", 16, True, 1),
    ("embedded_image_audio", 2, "zigzag", 16, True, 1),
    ("embedded_image_audio", 2, "contiguous", 16, True, 2),
    ("packed_documents", 2, "lpt", 12, True, 1),
    ("padding_odd_length", 2, "lpt_free", 16, True, 1),
    ("embedded_image_audio", 4, "lpt", 16, True, 1),
    ("embedded_image_audio", 4, "zigzag", 16, True, 2),
    ("embedded_image_audio", 4, "contiguous", 16, True, 1),
    ("packed_documents", 4, "zigzag", 12, True, 1),
    ("text_blind_to_audio", 4, "random", 7, True, 1),
    ("prefix_image", 4, "lpt", 16, True, 1),  # 3 blocks over 4 ranks: one rank holds only padding
]


def _attention_worker(cases, triton_cases):
    from mimo.attention import KernelConfig

    groups = _groups()
    done = [_run_case(groups, *c) for c in cases]
    tiles = KernelConfig(block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=16, split_tiles=2)
    done += [_run_case(groups, *c, kernel_config=tiles) for c in triton_cases]
    return done


CP2_CASES = [c for c in CASES if c[1] == 2] + [("text_blind_to_audio", 2, "random", 7, True, 1)]


@pytest.mark.parametrize("world,cases", [
    (2, CP2_CASES),
    pytest.param(4, CASES, marks=pytest.mark.slow),
], ids=["cp2", "cp2-and-cp4"])
def test_cp_attention_matches_single_rank(monkeypatch, world, cases):
    # The Triton case runs in the interpreter: the environment must say so before ranks start.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_cases = [("embedded_image_audio", 2, "lpt", 16, False, 1)]
    results = run_on_ranks(_attention_worker, world, cases, triton_cases, timeout_s=600)
    assert len(results) == world
    for rank_result in results:
        assert len(rank_result) == len(cases) + len(triton_cases)
        # The wrong-layout check ran (layouts differ) in most cases, and always caught the error.
        assert sum(1 for _, caught in rank_result if caught) >= len(cases) - 2
