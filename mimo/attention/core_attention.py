"""Megatron-core integration: a drop-in ``core_attention`` using bitfield masks.

Megatron hands ``GPTModel.forward(attention_mask=...)`` unchanged through
TransformerBlock -> TransformerLayer -> SelfAttention to ``core_attention``,
so the mask can be a ``BitfieldMask`` (or its tensor form, needed when layers
are recomputed: megatron's checkpoint saves its inputs with
``save_for_backward``, which only takes tensors). The mask is per token and
heads are split across tensor-parallel ranks, so TP needs nothing extra.

With ``config.context_parallel_size > 1`` the mask must be a
``ContextParallelMask`` (or its packed tensor form) and attention is the
all-gather context-parallel attention over ``pg_collection.cp``
(``mimo.attention.context_parallel``); the CP group is orthogonal to TP.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from mimo.config.kernel import KernelConfig

from .context_parallel import as_context_parallel_mask, context_parallel_attention_sbhd
from .function import bitfield_attention
from .mask import BitfieldMask, bidirectional_mask, causal_mask
from .reference import reference_attention

# Default masks are shared across layers and microbatches so that the block-plan cache (keyed on
# tensor identity) is hit by every layer, recomputed ones included, not rebuilt per layer. One
# [1, s] row per (pattern, length, device), kept for the process (a handful: the LLM's sequence
# length, each encoder's tokens per item), expanded to each call's batch: microbatches of any
# number of items (an encoder's vary) share it, and nothing is evicted however many are in flight.
_default_masks: dict = {}
_default_lock = threading.Lock()


def _default_mask(causal: bool, b: int, s: int, device) -> torch.Tensor:
    key = (causal, s, str(device))
    with _default_lock:
        row = _default_masks.get(key)
        if row is None:
            row = _default_masks[key] = (causal_mask if causal else bidirectional_mask)(1, s, device=device)
    return row.expand(b, s)


class BitfieldCoreAttention(MegatronModule):
    """Core attention with megatron's DotProductAttention constructor signature.

    Extra keyword-only options (bind them with ``bitfield_layer_spec``):
    ``use_reference`` runs the dense PyTorch reference instead of the kernels
    (for parity tests); ``kernel_config`` overrides tile sizes;
    ``cp_head_chunks`` (context parallelism only) splits the K/V all-gather into
    that many head chunks overlapped with attention.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        use_reference: bool = False,
        kernel_config: Optional[KernelConfig] = None,
        cp_head_chunks: int = 1,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"BitfieldCoreAttention has no attention dropout; set attention_dropout=0 (got {dropout})"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"BitfieldCoreAttention supports softmax_type='vanilla' only, "
                             f"got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("BitfieldCoreAttention does not support sliding-window attention (window_size)")
        cp = config.context_parallel_size
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if cp > 1 else ["tp"])
        self.pg_collection = pg_collection
        self.cp_group = getattr(pg_collection, "cp", None) if cp > 1 else None
        if cp > 1 and (self.cp_group is None or self.cp_group.size() != cp):
            raise ValueError(f"context_parallel_size={cp} needs pg_collection.cp with {cp} ranks")
        self.cp_size = cp
        self.cp_head_chunks = cp_head_chunks
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # apply_query_key_layer_scaling divides and re-multiplies by the layer number in
        # megatron's softmax, so the effective scale is unchanged by it.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.use_reference = use_reference
        self.kernel_config = kernel_config

    def _mask(self, attention_mask, attn_mask_type, b: int, s: int, device) -> BitfieldMask:
        if isinstance(attention_mask, BitfieldMask):
            mask = attention_mask
        elif isinstance(attention_mask, torch.Tensor):
            if attention_mask.dtype == torch.bool:
                raise TypeError(
                    "BitfieldCoreAttention got a boolean megatron attention mask; pass a BitfieldMask "
                    "(or BitfieldMask.to_tensor()) as attention_mask, or None for the default pattern"
                )
            mask = BitfieldMask.from_tensor(attention_mask)
        elif attention_mask is None:
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if mask_type == AttnMaskType.arbitrary:
                raise ValueError("attn_mask_type=arbitrary needs an attention_mask")
            causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
            mask = BitfieldMask(_default_mask(causal, b, s, device))
        else:
            raise TypeError(f"attention_mask must be a BitfieldMask, an int64 tensor or None, "
                            f"got {type(attention_mask).__name__}")
        if tuple(mask.bits.shape) != (b, s):
            raise ValueError(f"attention mask has shape {tuple(mask.bits.shape)}, expected [b={b}, s={s}]")
        return mask

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, hq_per_rank, d], key/value [s, b, hkv_per_rank, d] -> [s, b, hq_per_rank * d]."""
        if attention_bias is not None:
            raise ValueError("BitfieldCoreAttention does not support attention_bias")
        if packed_seq_params is not None:
            raise ValueError("BitfieldCoreAttention isolates packed documents with "
                             "BitfieldMask.document_ids, not packed_seq_params")
        s, b = query.shape[0], query.shape[1]
        cp_mask = as_context_parallel_mask(attention_mask)
        if self.cp_size > 1 and cp_mask is None:
            raise TypeError("with context parallelism BitfieldCoreAttention needs a ContextParallelMask "
                            "(see mimo.attention.cp_permute.shard_microbatch) as attention_mask")
        if cp_mask is not None:
            if cp_mask.cp_size != self.cp_size:
                raise ValueError(f"the mask was planned for cp={cp_mask.cp_size}, the model has cp={self.cp_size}")
            out = context_parallel_attention_sbhd(
                query, key, value, cp_mask, self.cp_group, softmax_scale=self.softmax_scale,
                use_reference=self.use_reference, kernel_config=self.kernel_config,
                head_chunks=self.cp_head_chunks if self.cp_size > 1 else 1)
            return out.reshape(s, b, -1)
        mask = self._mask(attention_mask, attn_mask_type, b, s, query.device)
        # [s, b, h, d] -> [b, s, h, d] views; the kernels take strides, and the output
        # keeps q's memory layout, so transposing back below is free.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        attend = reference_attention if self.use_reference else functools.partial(
            bitfield_attention, kernel_config=self.kernel_config)
        out = attend(q, k, v, mask.bits, mask.document_ids, softmax_scale=self.softmax_scale)
        return out.transpose(0, 1).reshape(s, b, -1)


def bitfield_layer_spec(use_reference: bool = False, kernel_config: Optional[KernelConfig] = None,
                        cp_head_chunks: int = 1, **kwargs):
    """megatron's local GPT layer spec with BitfieldCoreAttention as core attention.

    ``kwargs`` go to ``get_gpt_layer_local_spec`` (num_experts, qk_layernorm, normalization...).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**kwargs)
    attention = spec.submodules.self_attention.submodules
    if not hasattr(attention, "linear_qkv"):
        raise ValueError("bitfield_layer_spec supports standard self-attention only (not MLA)")
    attention.core_attention = functools.partial(
        BitfieldCoreAttention, use_reference=use_reference, kernel_config=kernel_config,
        cp_head_chunks=cp_head_chunks)
    return spec
