"""bitfield_attention: autograd wrapper around the Triton kernels."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mimo.config.kernel import KernelConfig
from mimo.runtime.device import multiprocessor_count

from .block_plan import BlockPlan, get_plans
from .inputs import AttentionInputs, check_inputs
from .kernel_loader import backend_for, kernels
from .reference import reference_attention_general

LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _mask_args(inp: AttentionInputs):
    has_doc = inp.q_document_ids is not None
    qd = inp.q_document_ids if has_doc else inp.q_mask
    kd = inp.k_document_ids if has_doc else inp.k_mask
    return (inp.q_mask, inp.q_positions, qd, inp.k_mask, inp.k_positions, kd), has_doc


def _launch_opts(cfg: KernelConfig, interpret: bool, kernel: str = "fwd") -> dict:
    if interpret:
        return {}
    if kernel == "dkdv":
        return {"num_warps": cfg.bwd_num_warps, "num_stages": cfg.bwd_num_stages}
    if kernel == "dq":
        return {"num_warps": cfg.dq_num_warps, "num_stages": cfg.dq_num_stages}
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _shape_constants(bm: int, bn: int, d: int, s_q: int, s_k: int) -> dict:
    """The kernels' compile-time shape arguments: tiles, head dim, and which bounds masks can go."""
    bd = _pow2(d)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, HEAD_DIM=d, D_EVEN=d == bd, M_EVEN=s_q % bm == 0,
                N_EVEN=s_k % bn == 0)


def _grid(n_work: int, n_heads: int, cfg: KernelConfig) -> tuple:
    """A launch of n_work work entries (items, rows, columns; longest first) x n_heads heads: a 1-D grid
    with the heads fastest (`cfg.heads_fastest`), else (work, head). The kernels' HEADS_FASTEST says which."""
    return (n_work * n_heads,) if cfg.heads_fastest else (n_work, n_heads)


def _fused_constants(kv_tiles, dq_tiles, d: int, s_q: int, s_k: int) -> dict:
    """The one-launch backward's compile-time shape arguments: the dK/dV plan's tiles as the dK/dV
    kernel takes them, the dQ plan's with a DQ_ prefix."""
    dq = _shape_constants(*dq_tiles, d, s_q, s_k)
    return dict(_shape_constants(*kv_tiles, d, s_q, s_k),
                **{"DQ_" + name: dq[name] for name in ("BLOCK_M", "BLOCK_N", "M_EVEN", "N_EVEN")})


DELTA_LAUNCH = {"num_warps": 4}  # a memory-bound row sum: one tile of O and of dO per program


def _delta_constants(d: int, s_q: int) -> dict:
    bd = _pow2(d)
    bm = max(16, min(128, 8192 // bd))  # 64 rows at head_dim 128: a tile of each input per program
    return dict(BLOCK_M=bm, BLOCK_D=bd, HEAD_DIM=d, D_EVEN=d == bd, M_EVEN=s_q % bm == 0)


def _forward(kern, interpret, q, k, v, inp: AttentionInputs, plan: BlockPlan, cfg: KernelConfig):
    b, s_q, hq, d = q.shape
    s_k, hkv = k.shape[1], k.shape[2]
    bm, bd = plan.block_m, _pow2(d)
    out = torch.zeros_like(q, memory_format=torch.preserve_format)
    out = _lastdim_contiguous(out)
    lse = torch.full((b, hq, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    items = plan.items
    n_items = items.row.numel()
    if n_items == 0:
        return out, lse
    part_o = torch.empty((max(items.n_slots, 1), hq, bm, bd), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((max(items.n_slots, 1), hq, bm), dtype=torch.float32, device=q.device)
    masks, has_doc = _mask_args(inp)
    opts = _launch_opts(cfg, interpret)
    kern.fwd_kernel[_grid(n_items, hq, cfg)](
        q, k, v, out, lse, part_o, part_lse, *masks,
        items.row, items.start, items.length, items.slot, plan.rows.idx, plan.rows.npart,
        inp.softmax_scale * LOG2E, s_q, s_k, plan.n_qb, plan.n_kb, hq, hq // hkv,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        HAS_DOC=has_doc, IEEE=q.dtype == torch.float32, UPCAST=interpret, HEADS_FASTEST=cfg.heads_fastest,
        **_shape_constants(bm, plan.block_n, d, s_q, s_k), **opts,
    )
    n_agg = items.agg_row.numel()
    if n_agg:
        kern.merge_kernel[(n_agg, hq)](
            out, lse, part_o, part_lse, items.agg_row, items.agg_slot, items.agg_len,
            s_q, plan.n_qb, hq, *out.stride()[:3], BLOCK_M=bm, BLOCK_D=bd, HEAD_DIM=d, **opts,
        )
    return out, lse


def _delta(kern, interpret, out, dout, dlse):
    """delta [b, hq, s_q] fp32: sum_d dO * O per row, less dlse where lse has a gradient (a gradient on
    lse adds p_ij * dlse_i to dS, i.e. subtracts it from delta)."""
    b, s_q, hq, d = out.shape
    delta = torch.empty((b, hq, s_q), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    shape = _delta_constants(d, s_q)
    has_dlse = dlse is not None
    dlse = dlse.float().contiguous() if has_dlse else delta
    kern.bwd_delta_kernel[(-(-s_q // shape["BLOCK_M"]) * hq * b,)](
        out, dout, dlse, delta, s_q, hq, *out.stride()[:3], *dout.stride()[:3], HAS_DLSE=has_dlse, **shape,
        **({} if interpret else DELTA_LAUNCH),
    )
    return delta


def _backward(kern, interpret, q, k, v, lse, dout, delta, inp, plans, cfg, need):
    """dQ, dK, dV; `plans` = (the dK/dV kernel's plan, the dQ kernel's plan), each with its own tiles.
    Two launches, or one (`cfg.fused_backward`) when both kernels run."""
    b, s_q, hq, d = q.shape
    s_k, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    masks, has_doc = _mask_args(inp)
    kv_plan = plans[0] if need[1] or need[2] else None
    q_plan = plans[1] if need[0] else None
    dq = dk = dv = None
    if kv_plan is not None:
        dk = _lastdim_contiguous(torch.zeros_like(k, memory_format=torch.preserve_format))
        dv = _lastdim_contiguous(torch.zeros_like(v, memory_format=torch.preserve_format))
    if q_plan is not None:
        dq = _lastdim_contiguous(torch.zeros_like(q, memory_format=torch.preserve_format))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    flags = dict(HAS_DOC=has_doc, IEEE=q.dtype == torch.float32, UPCAST=interpret, HEADS_FASTEST=cfg.heads_fastest)
    scale = (inp.softmax_scale, inp.softmax_scale * LOG2E)
    if cfg.fused_backward and kv_plan is not None and q_plan is not None:
        n_cols, n_rows = kv_plan.cols.nonempty.numel(), q_plan.rows.nonempty.numel()
        if n_cols + n_rows:
            cols, rows = kv_plan.cols, q_plan.rows
            grid = (n_cols * hkv + n_rows * hq,) if cfg.heads_fastest else (n_cols + group * n_rows, hkv)
            kern.bwd_kernel[grid](
                q, k, v, dout, dq, dk, dv, lse, delta, *masks,
                cols.nonempty, cols.idx, cols.npart, cols.cnt, rows.nonempty, rows.idx, rows.npart, rows.cnt,
                n_cols, *scale, s_q, s_k, kv_plan.n_qb, kv_plan.n_kb, q_plan.n_qb, q_plan.n_kb, hq, group,
                *strides, *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], **flags,
                **_fused_constants((kv_plan.block_m, kv_plan.block_n), (q_plan.block_m, q_plan.block_n), d, s_q, s_k),
                **_launch_opts(cfg, interpret, "dkdv"),
            )
        return dq, dk, dv
    if kv_plan is not None and kv_plan.cols.nonempty.numel():
        cols = kv_plan.cols
        kern.bwd_dkdv_kernel[_grid(cols.nonempty.numel(), hkv, cfg)](
            q, k, v, dout, dk, dv, lse, delta, *masks,
            cols.nonempty, cols.idx, cols.npart, cols.cnt, *scale, s_q, s_k, kv_plan.n_qb, kv_plan.n_kb, hq, group,
            *strides, *dk.stride()[:3], *dv.stride()[:3], **flags,
            **_shape_constants(kv_plan.block_m, kv_plan.block_n, d, s_q, s_k), **_launch_opts(cfg, interpret, "dkdv"),
        )
    if q_plan is not None and q_plan.rows.nonempty.numel():
        rows = q_plan.rows
        kern.bwd_dq_kernel[_grid(rows.nonempty.numel(), hq, cfg)](
            q, k, v, dout, dq, lse, delta, *masks,
            rows.nonempty, rows.idx, rows.npart, rows.cnt, *scale, s_q, s_k, q_plan.n_qb, q_plan.n_kb, hq, group,
            *strides, *dq.stride()[:3], **flags,
            **_shape_constants(q_plan.block_m, q_plan.block_n, d, s_q, s_k), **_launch_opts(cfg, interpret, "dq"),
        )
    return dq, dk, dv


class _BitfieldAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inp, fwd_plan, bwd_plans, cfg, kern, interpret):
        out, lse = _forward(kern, interpret, q, k, v, inp, fwd_plan, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.inp, ctx.bwd_plans, ctx.cfg, ctx.kern, ctx.interpret = inp, bwd_plans, cfg, kern, interpret
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        none = (None,) * 6
        if dout is None and dlse is None:
            return (None, None, None) + none
        if dout is None:
            dout = torch.zeros_like(out)
        dout = _lastdim_contiguous(dout)
        delta = _delta(ctx.kern, ctx.interpret, out, dout, dlse)
        dq, dk, dv = _backward(ctx.kern, ctx.interpret, q, k, v, lse, dout, delta, ctx.inp,
                               ctx.bwd_plans, ctx.cfg, ctx.needs_input_grad[:3])
        return (dq, dk, dv) + none


def bitfield_attention_general(
    q, k, v, q_mask, k_mask, q_positions=None, k_positions=None,
    q_document_ids=None, k_document_ids=None, softmax_scale=None,
    return_lse: bool = False, kernel_config: Optional[KernelConfig] = None,
):
    """Bitfield attention of queries against a possibly different key set.

    q [b, s_q, hq, d]; k, v [b, s_k, hkv, d]; q_mask [b, s_q], k_mask [b, s_k]
    int64; positions (global, int64 [b, s] or [s], default arange) drive the
    causal test ``k_pos <= q_pos``; document ids must match when given.
    Returns out [b, s_q, hq, d], plus lse [b, hq, s_q] (fp32, natural log,
    -inf for rows with no allowed key; differentiable) with ``return_lse``.
    """
    inp = check_inputs(q, k, v, q_mask, k_mask, q_positions, k_positions,
                       q_document_ids, k_document_ids, softmax_scale)
    backend = backend_for(q.device)
    if backend == "reference" or q.numel() == 0 or k.numel() == 0:
        return reference_attention_general(q, k, v, q_mask, k_mask, q_positions, k_positions,
                                           q_document_ids, k_document_ids, softmax_scale, return_lse)
    interpret = backend == "interpret"
    kern = kernels(interpret)
    cfg = (kernel_config or KernelConfig()).resolve(q.shape[-1])
    q, k, v = (_lastdim_contiguous(t) for t in (q, k, v))
    # Masks as contiguous int64 for the kernels; the cache key uses the caller's own tensors.
    inp = dataclasses.replace(
        inp, q=None, k=None, v=None,
        **{f: getattr(inp, f).contiguous() for f in
           ("q_mask", "k_mask", "q_positions", "k_positions", "q_document_ids", "k_document_ids")
           if getattr(inp, f) is not None},
    )
    key_tensors = (q_mask, k_mask, q_positions, k_positions, q_document_ids, k_document_ids)
    programs = q.shape[0] * -(-q.shape[1] // cfg.block_m) * q.shape[2]
    split = cfg.split_for(programs, None if interpret else multiprocessor_count(q.device))
    # The forward's tiles, then the dK/dV and dQ kernels' own where they differ (a plan is shared where
    # the tiles agree); all built at once, with one wait for the device.
    tiles = {(cfg.block_m, cfg.block_n): (cfg.block_m, cfg.block_n, split)}
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if wants_grad:
        for bwd in ((cfg.bwd_block_m, cfg.bwd_block_n), (cfg.dq_block_m, cfg.dq_block_n)):
            tiles.setdefault(bwd, bwd + (None,))
    plans = dict(zip(tiles, get_plans(inp, key_tensors, list(tiles.values()), kern)))
    fwd_plan = plans[(cfg.block_m, cfg.block_n)]
    bwd_plans = (None, None)
    if wants_grad:
        bwd_plans = (plans[(cfg.bwd_block_m, cfg.bwd_block_n)] if k.requires_grad or v.requires_grad else None,
                     plans[(cfg.dq_block_m, cfg.dq_block_n)] if q.requires_grad else None)
    out, lse = _BitfieldAttention.apply(q, k, v, inp, fwd_plan, bwd_plans, cfg, kern, interpret)
    return (out, lse) if return_lse else out


def bitfield_attention(q, k, v, mask, document_ids=None, softmax_scale=None,
                       return_lse: bool = False, kernel_config: Optional[KernelConfig] = None):
    """Self-attention with one bitfield mask [b, s] for queries and keys (docs/attention.md)."""
    return bitfield_attention_general(
        q, k, v, mask, mask, q_document_ids=document_ids, k_document_ids=document_ids,
        softmax_scale=softmax_scale, return_lse=return_lse, kernel_config=kernel_config,
    )
