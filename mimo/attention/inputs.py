"""Validation and normalisation of attention inputs shared by every backend."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@dataclass
class AttentionInputs:
    """Checked inputs; masks, positions and document ids are [b, s] int64."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_mask: torch.Tensor
    k_mask: torch.Tensor
    q_positions: torch.Tensor
    k_positions: torch.Tensor
    q_document_ids: Optional[torch.Tensor]
    k_document_ids: Optional[torch.Tensor]
    softmax_scale: float


def _per_token(name: str, t: Optional[torch.Tensor], b: int, s: int, device, default=None, allow_1d=False):
    if t is None:
        return default
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if allow_1d and t.dim() == 1:
        t = t.unsqueeze(0).expand(b, -1)
    if tuple(t.shape) != (b, s):
        raise ValueError(f"{name} must have shape [{b}, {s}]" + (f" or [{s}]" if allow_1d else "") + f", got {tuple(t.shape)}")
    return t.to(torch.int64)


def check_inputs(
    q, k, v, q_mask, k_mask, q_positions=None, k_positions=None,
    q_document_ids=None, k_document_ids=None, softmax_scale=None,
) -> AttentionInputs:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [b, s, heads, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must be on one device")
    b, s_q, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    s_k, hkv = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")
    if q_mask is None or k_mask is None:
        raise ValueError("q_mask and k_mask are required")
    for name, m in (("q_mask", q_mask), ("k_mask", k_mask)):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got "
                            f"{m.dtype if isinstance(m, torch.Tensor) else type(m).__name__}")
    dev = q.device
    qm = _per_token("q_mask", q_mask, b, s_q, dev)
    km = _per_token("k_mask", k_mask, b, s_k, dev)
    qp = _per_token("q_positions", q_positions, b, s_q, dev, allow_1d=True,
                    default=torch.arange(s_q, device=dev).expand(b, -1))
    kp = _per_token("k_positions", k_positions, b, s_k, dev, allow_1d=True,
                    default=torch.arange(s_k, device=dev).expand(b, -1))
    if (q_document_ids is None) != (k_document_ids is None):
        raise ValueError("give both q_document_ids and k_document_ids, or neither")
    qd = _per_token("q_document_ids", q_document_ids, b, s_q, dev, allow_1d=True)
    kd = _per_token("k_document_ids", k_document_ids, b, s_k, dev, allow_1d=True)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return AttentionInputs(q, k, v, qm, km, qp, kp, qd, kd, scale)


def allowed_matrix(inp: AttentionInputs) -> torch.Tensor:
    """Dense boolean [b, s_q, s_k]: may query i attend key j (the contract, literally)."""
    from .mask import CAUSAL, LOW

    qm = inp.q_mask[:, :, None]
    km = inp.k_mask[:, None, :]
    q_low, k_low = qm & LOW, km & LOW
    causal_ok = (inp.k_positions[:, None, :] <= inp.q_positions[:, :, None]) & ((q_low & k_low) != 0)
    bidir_ok = (q_low == k_low) & (q_low != 0)
    ok = torch.where((qm & CAUSAL) != 0, causal_ok, bidir_ok)
    if inp.q_document_ids is not None:
        ok = ok & (inp.q_document_ids[:, :, None] == inp.k_document_ids[:, None, :])
    return ok
