"""Bitfield attention masks: one int64 per token encodes who it may attend to.

Bit layout (docs/attention.md):
  bit 0        TEXT           the LLM's own tokens
  bits 1..61   modality m     tokens produced by modality encoder m
  bit 62       CAUSAL         the token attends causally (text tokens)
Padding is 0: it attends nothing and is seen by nothing.

Query i may attend key j iff document ids match (when given) and
  * mask[i] has CAUSAL: pos[j] <= pos[i] and mask[i] & mask[j] & LOW != 0
  * otherwise:          mask[i] & LOW == mask[j] & LOW != 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch

TEXT = 1 << 0
CAUSAL = 1 << 62
LOW = CAUSAL - 1
MAX_MODALITY = 61


def modality_bit(m: int) -> int:
    """Bit of modality ``m`` (1..61); bit 0 is text and bit 62 is CAUSAL."""
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_MODALITY:
        raise ValueError(f"modality index must be an int in 1..{MAX_MODALITY}, got {m!r}")
    return 1 << m


def text_bits(text_sees: Iterable[int]) -> int:
    """Mask value of a text token that may see the given modalities."""
    bits = CAUSAL | TEXT
    for m in text_sees:
        bits |= modality_bit(m)
    return bits


def build_bitfield_mask(
    input_ids: torch.Tensor,
    placeholder_ids: Mapping[int, int],
    text_sees: Optional[Iterable[int]] = None,
    pad_id: Optional[int] = None,
) -> torch.Tensor:
    """Bitfield mask [b, s] (int64) from token ids.

    ``placeholder_ids`` maps a placeholder token id to the modality index
    (1..61) whose encoder output replaces it; every token with that id gets
    only that modality's bit, so all tokens of one modality inside one document
    see each other bidirectionally (two images of one modality included, as
    the contract says; separate them with document ids if needed).
    ``text_sees`` lists the modalities text tokens may attend to (causally);
    ``None`` means all modalities in ``placeholder_ids``. Tokens equal to
    ``pad_id`` get 0. A 1-D ``input_ids`` is treated as a batch of one.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError("input_ids must be an integer tensor")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, s] or [s], got shape {tuple(input_ids.shape)}")
    modalities = {}
    for token_id, m in placeholder_ids.items():
        modality_bit(m)  # validates the index
        if pad_id is not None and token_id == pad_id:
            raise ValueError(f"placeholder_ids: token id {token_id} is also pad_id")
        modalities[int(token_id)] = m
    sees = set(modalities.values()) if text_sees is None else set(text_sees)

    mask = torch.full(input_ids.shape, text_bits(sees), dtype=torch.int64, device=input_ids.device)
    for token_id, m in modalities.items():
        mask = torch.where(input_ids == token_id, torch.full_like(mask, modality_bit(m)), mask)
    if pad_id is not None:
        mask = torch.where(input_ids == pad_id, torch.zeros_like(mask), mask)
    return mask


def document_ids_from_eod(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Document ids [b, s] for packed sequences: a new document starts after each ``eod_id``."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    ends = (input_ids == eod_id).to(torch.int64)
    # The EOD token belongs to the document it closes, so shift the count by one.
    return torch.cumsum(ends, dim=1) - ends


def causal_mask(batch: int, seq: int, device=None) -> torch.Tensor:
    """Plain causal LM mask (every token is text)."""
    return torch.full((batch, seq), CAUSAL | TEXT, dtype=torch.int64, device=device)


def bidirectional_mask(batch: int, seq: int, device=None) -> torch.Tensor:
    """Full bidirectional mask (encoders): every token sees every other token."""
    return torch.full((batch, seq), TEXT, dtype=torch.int64, device=device)


@dataclass
class BitfieldMask:
    """What megatron's ``attention_mask`` argument carries to BitfieldCoreAttention.

    ``bits`` is [b, s] int64; ``document_ids`` optionally [b, s] integer ids
    isolating packed documents. Megatron's activation checkpointing saves its
    inputs with ``save_for_backward``, which only accepts tensors; use
    ``to_tensor()`` for recomputed layers (core attention accepts both forms).
    """

    bits: torch.Tensor
    document_ids: Optional[torch.Tensor] = None

    def __post_init__(self):
        if not isinstance(self.bits, torch.Tensor) or self.bits.dtype != torch.int64 or self.bits.dim() != 2:
            raise TypeError("BitfieldMask.bits must be an int64 tensor [b, s]")
        if self.document_ids is not None and tuple(self.document_ids.shape) != tuple(self.bits.shape):
            raise ValueError(
                f"BitfieldMask.document_ids shape {tuple(self.document_ids.shape)} "
                f"differs from bits shape {tuple(self.bits.shape)}"
            )

    def to_tensor(self) -> torch.Tensor:
        """[b, s] bits, or [2, b, s] (bits, document ids) when documents are given."""
        if self.document_ids is None:
            return self.bits
        return torch.stack([self.bits, self.document_ids.to(torch.int64)])

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "BitfieldMask":
        if t.dtype != torch.int64 or t.dim() not in (2, 3) or (t.dim() == 3 and t.shape[0] != 2):
            raise ValueError(
                "a bitfield attention mask tensor must be int64 [b, s] or [2, b, s] "
                f"(bits, document ids); got {t.dtype} {tuple(t.shape)}"
            )
        return BitfieldMask(t) if t.dim() == 2 else BitfieldMask(t[0], t[1])
