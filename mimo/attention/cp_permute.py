"""Permutation plumbing for balanced context parallelism.

Once per microbatch, on the LLM's first pipeline stage (and identically on any
rank that has the microbatch's bitfield mask: the plan is a deterministic
function of the mask, so CP ranks need not exchange it):

    slots = plan_context_parallel(bits, cp_size, block_size, policy, document_ids)

``slots`` [cp, L] lists, per CP rank, the global token indices of its local
sequence (its blocks concatenated in ascending order), padded with -1 to the
longest rank's length L. ``shard_microbatch`` then cuts one rank's inputs out
of the full-sequence tensors, pads them (padding: token 0, label 0, loss mask
0, mask bits 0) and wraps the mask as a ``ContextParallelMask`` that every
layer and pipeline stage of this microbatch uses. ``unpermute`` is the inverse
(gathered per-rank tensors -> full sequence), for tests and tools.

Labels must already be shifted for next-token prediction before sharding:
a token's label then travels with it.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch

from .balance import assign_blocks, check_assignment, num_blocks
from .context_parallel import ContextParallelMask, gather_tokens


def slots_from_assignment(assignment: Sequence[Sequence[int]], seq_len: int, block_size: int,
                          device=None) -> torch.Tensor:
    """int64 [cp, L]: global token index per local slot (-1 = padding) of each rank."""
    check_assignment(assignment, num_blocks(seq_len, block_size))
    per_rank = []
    for blocks in assignment:
        if len(blocks):
            starts = torch.tensor(list(blocks), dtype=torch.int64) * block_size
            idx = (starts[:, None] + torch.arange(block_size)[None, :]).reshape(-1)
            idx = idx[idx < seq_len]
        else:
            idx = torch.zeros(0, dtype=torch.int64)
        per_rank.append(idx)
    L = max(t.numel() for t in per_rank)
    slots = torch.full((len(per_rank), L), -1, dtype=torch.int64)
    for r, idx in enumerate(per_rank):
        slots[r, :idx.numel()] = idx
    return slots.to(device) if device is not None else slots


def plan_context_parallel(bits: torch.Tensor, cp_size: int, block_size: int = 128, policy: str = "lpt",
                          document_ids: Optional[torch.Tensor] = None, seed: int = 0) -> torch.Tensor:
    """Balance the microbatch's query blocks over ``cp_size`` ranks; returns ``slots`` [cp, L]."""
    assignment = assign_blocks(bits, cp_size, block_size, policy, document_ids, seed)
    return slots_from_assignment(assignment, bits.shape[-1], block_size, device=bits.device)


def permute_to_local(x: torch.Tensor, slots: torch.Tensor, cp_rank: int, dim: int = 1, pad_value=0) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (sequence along ``dim``), padded to L."""
    return gather_tokens(x, slots[cp_rank], pad_value, dim)


def unpermute(local: Union[torch.Tensor, Sequence[torch.Tensor]], slots: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of ``permute_to_local`` for all ranks at once.

    ``local`` holds every rank's local tensor (a list, or stacked on a new leading dim),
    each with L along ``dim``; returns the full sequence (padding slots dropped).
    """
    chunks = list(local.unbind(0)) if isinstance(local, torch.Tensor) else list(local)
    if len(chunks) != slots.shape[0]:
        raise ValueError(f"{len(chunks)} local tensors for {slots.shape[0]} ranks")
    cat = torch.cat(chunks, dim=dim)
    flat = slots.reshape(-1).to(cat.device)
    keep = torch.nonzero(flat >= 0).flatten()
    order = torch.argsort(flat[keep])
    return torch.index_select(cat, dim, keep[order])


def shard_microbatch(slots: torch.Tensor, cp_rank: int, *, bits: torch.Tensor,
                     document_ids: Optional[torch.Tensor] = None, input_ids: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                     loss_mask: Optional[torch.Tensor] = None, decoder_input: Optional[torch.Tensor] = None,
                     validate: bool = True) -> Dict[str, Optional[torch.Tensor]]:
    """One CP rank's view of a microbatch.

    Full-sequence inputs: ``bits``/``document_ids``/``input_ids``/``position_ids``/
    ``labels``/``loss_mask`` [b, s] (``position_ids`` may be M-RoPE's [3, b, s]: each token's
    three positions travel with it); ``decoder_input`` [s, b, h] (megatron layout).
    Returns the same keys cut to this rank's L slots, plus ``attention_mask`` (a
    ``ContextParallelMask`` over the full bits, for every layer and stage) and
    ``padding_mask`` (bool [b, L], True at this rank's padding slots: megatron-core's
    convention for its MoE router, which then leaves them out of its load-balancing loss).
    ``validate=False`` skips checking ``slots`` (a caller that checked them on the
    host, before they went to the device, where checking would wait for it).
    """
    if bits.dim() != 2:
        raise ValueError(f"bits must be [b, s], got {tuple(bits.shape)}")
    s = bits.shape[1]
    out: Dict[str, Optional[torch.Tensor]] = {}
    for name, t, pad in (("input_ids", input_ids, 0), ("position_ids", position_ids, 0),
                         ("labels", labels, 0), ("loss_mask", loss_mask, 0)):
        if t is None:
            out[name] = None
            continue
        if t.shape[-1] != s:
            raise ValueError(f"{name} has {t.shape[-1]} tokens, the mask {s}")
        out[name] = permute_to_local(t, slots, cp_rank, dim=t.dim() - 1, pad_value=pad)
    if decoder_input is not None:
        if decoder_input.shape[0] != s:
            raise ValueError(f"decoder_input must be [s={s}, b, h], got {tuple(decoder_input.shape)}")
        out["decoder_input"] = permute_to_local(decoder_input, slots, cp_rank, dim=0, pad_value=0)
    else:
        out["decoder_input"] = None
    out["attention_mask"] = ContextParallelMask(bits, slots, cp_rank, document_ids, validate=validate)
    out["padding_mask"] = (slots[cp_rank] < 0).to(bits.device).expand(bits.shape[0], -1)
    return out
