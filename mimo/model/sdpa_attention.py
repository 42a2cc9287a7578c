"""Core attention on torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPU)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


# torch >= 2.5 takes K/V with fewer heads than Q (grouped-query attention) without copies.
NATIVE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def expand_gqa(k, v, heads: int):
    """K/V [b, groups, s, d] repeated to [b, heads, s, d] (query head h reads group h // (heads / groups))."""
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention (same constructor and forward signature).

    Causal for the LLM (mask type `causal`), bidirectional for encoders
    (`no_mask`). megatron hands over K/V with query-group heads: torch's native
    GQA (`enable_gqa`) where flash can run it (no mask, bf16 or fp16), else
    expanded here.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("SDPACoreAttention has no context parallelism; use attention: bitfield")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # megatron: [s, b, heads, d] -> SDPA: [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal
        mask = None
        if attention_mask is not None and not causal:
            mask = ~attention_mask  # megatron masks mark *disallowed* positions with True
        gqa = {}
        if k.shape[1] != q.shape[1]:
            if NATIVE_GQA and mask is None and q.dtype in (torch.float16, torch.bfloat16):
                gqa = dict(enable_gqa=True)  # flash reads each K/V head for its query group
            else:
                # On CUDA only flash takes `enable_gqa`, and flash takes neither a mask nor fp32: there
                # SDPA would fall back to its math kernel (the whole score matrix in fp32); expanded
                # K/V keep the memory-efficient kernel.
                k, v = expand_gqa(k, v, q.shape[1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.softmax_scale, **gqa)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
