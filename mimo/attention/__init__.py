"""Bitfield attention for multimodal sequences (see docs/attention.md).

``balance.py`` and ``context_parallel.py`` in this package are owned by the
context-parallel work and are not imported here.
"""

from .block_plan import cache_stats, clear_block_cache
from .config import KernelConfig
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
from .reference import reference_attention, reference_attention_general

__all__ = [
    "bitfield_attention", "bitfield_attention_general", "reference_attention", "reference_attention_general",
    "TEXT", "CAUSAL", "LOW", "modality_bit", "build_bitfield_mask", "BitfieldMask", "causal_mask",
    "bidirectional_mask", "document_ids_from_eod", "KernelConfig", "clear_block_cache", "cache_stats",
]
