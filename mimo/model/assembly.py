"""Embedding assembly: modality tokens replace placeholder tokens in the LLM input."""

from __future__ import annotations

from typing import Dict, Optional

import torch


def assemble_embeddings(text_embeddings: torch.Tensor, input_ids: torch.Tensor,
                        modality_tokens: Dict[int, torch.Tensor],
                        counts: Optional[Dict[int, int]] = None) -> torch.Tensor:
    """Write packed modality tokens into the text embeddings at their placeholder positions.

    text_embeddings: [b, s, h]; input_ids: [b, s]; modality_tokens maps a
    placeholder token id to packed [n, h] tokens in row-major order of the
    placeholders (sample by sample, left to right), so a sample may hold any
    number of items, zero included. Returns a new [b, s, h] tensor through
    which gradients reach both inputs. `counts` (placeholder id -> its number
    in `input_ids`, counted on the host) spares counting them on the device,
    which would make the host wait for it.
    """
    if text_embeddings.shape[:2] != input_ids.shape:
        raise ValueError(f"text_embeddings {list(text_embeddings.shape)} and input_ids {list(input_ids.shape)} disagree")
    b, s, h = text_embeddings.shape
    out = text_embeddings.reshape(b * s, h)
    for token_id, tokens in modality_tokens.items():
        where = (input_ids == token_id).reshape(-1)
        n = counts[token_id] if counts is not None else int(where.sum())
        if tokens.shape[0] != n:
            raise ValueError(f"{n} placeholder tokens (id {token_id}) but {tokens.shape[0]} modality tokens")
        if n == 0:
            continue
        if tokens.shape[1] != h:
            raise ValueError(f"modality tokens have hidden size {tokens.shape[1]}, the LLM {h}")
        # Placeholder p (row-major, the packing order) takes token p: its index is the number of
        # placeholders before it. Every shape here is static, forward and backward: masked_scatter's
        # backward selects the masked gradient (masked_select), whose size the host must wait for.
        # The other positions gather some token too and drop it, so its gradient gains only zeros.
        pick = (torch.cumsum(where, 0) - 1).clamp_(min=0)
        out = torch.where(where.unsqueeze(-1), tokens.to(out.dtype).index_select(0, pick), out)
    return out.view(b, s, h)
