"""Bitfield attention for multimodal sequences (see docs/attention.md).

Context parallelism: ``balance`` (block workloads, rank assignment policies),
``context_parallel`` (all-gather CP attention, ContextParallelMask, RoPE at
global positions) and ``cp_permute`` (per-microbatch permutation plumbing).
"""

from mimo.config.kernel import KernelConfig

from .balance import assign_blocks, assign_from_workloads, block_workloads, imbalance, rank_workloads
from .block_plan import cache_stats, clear_block_cache
from .function import bitfield_attention, bitfield_attention_general
from .mask import (
    CAUSAL,
    LOW,
    TEXT,
    BitfieldMask,
    bidirectional_mask,
    build_bitfield_mask,
    causal_mask,
    document_ids_from_eod,
    modality_bit,
)
from .context_parallel import (
    ContextParallelMask,
    GlobalPositionRotaryEmbedding,
    as_context_parallel_mask,
    context_parallel_attention,
    context_parallel_attention_sbhd,
    enable_context_parallel_rope,
)
from .cp_permute import permute_to_local, plan_context_parallel, shard_microbatch, slots_from_assignment, unpermute
from .reference import reference_attention, reference_attention_general

__all__ = [
    "bitfield_attention", "bitfield_attention_general", "reference_attention", "reference_attention_general",
    "TEXT", "CAUSAL", "LOW", "modality_bit", "build_bitfield_mask", "BitfieldMask", "causal_mask",
    "bidirectional_mask", "document_ids_from_eod", "KernelConfig", "clear_block_cache", "cache_stats",
    "block_workloads", "assign_blocks", "assign_from_workloads", "rank_workloads", "imbalance",
    "ContextParallelMask", "as_context_parallel_mask", "context_parallel_attention",
    "context_parallel_attention_sbhd", "GlobalPositionRotaryEmbedding",
    "enable_context_parallel_rope", "plan_context_parallel", "slots_from_assignment", "permute_to_local",
    "unpermute", "shard_microbatch",
]
