"""Dense PyTorch attention with bitfield masks: the ground truth for tests,
and the CPU fallback when the Triton interpreter is not enabled."""

from __future__ import annotations

import torch

from .inputs import allowed_matrix, check_inputs


def reference_attention_general(
    q, k, v, q_mask, k_mask, q_positions=None, k_positions=None,
    q_document_ids=None, k_document_ids=None, softmax_scale=None, return_lse=False,
):
    """Materialises the [b, hq, s_q, s_k] scores in fp32; differentiable by autograd.

    Returns ``out`` [b, s_q, hq, d] in q's dtype, and with ``return_lse`` also
    the natural-log log-sum-exp [b, hq, s_q] (fp32, -inf for rows with no key).
    """
    inp = check_inputs(q, k, v, q_mask, k_mask, q_positions, k_positions,
                       q_document_ids, k_document_ids, softmax_scale)
    hq, hkv = q.shape[2], k.shape[2]
    group = hq // hkv
    qf = q.float().transpose(1, 2)                                   # [b, hq, sq, d]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)   # [b, hq, sk, d]
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    ok = allowed_matrix(inp)[:, None]                                # [b, 1, sq, sk]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * inp.softmax_scale
    scores = scores.masked_fill(~ok, float("-inf"))
    # A row with no allowed key has max -inf; shifting by 0 instead keeps exp() at 0
    # and every gradient finite.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    out = torch.matmul(p, vf) / torch.where(has_key, denom, torch.ones_like(denom))
    out = out.transpose(1, 2).to(q.dtype)
    if not return_lse:
        return out
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    lse = torch.where(has_key, row_max + torch.log(safe), torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


def reference_attention(q, k, v, mask, document_ids=None, softmax_scale=None, return_lse=False):
    """Self-attention form of the contract: one mask [b, s] for queries and keys."""
    return reference_attention_general(
        q, k, v, mask, mask, q_document_ids=document_ids, k_document_ids=document_ids,
        softmax_scale=softmax_scale, return_lse=return_lse,
    )
