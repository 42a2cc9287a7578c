"""Import: each rank reads exactly the HF tensors (and rows) its module part holds."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from mimo.config import MimoConfig
from mimo.model.reference_init import ExpertShard, source_name, tp_of

from .mapping import Entry, HFModule, hf_modules
from .source import HFWeightsError, Source


def check_hf_weights(cfg: MimoConfig) -> Dict[str, Source]:
    """Every HF tensor the config needs exists with the right shape (safetensors headers only).

    Run identically on every rank before any model is built, so a bad directory
    stops all ranks with the same `error:` line and nothing half-loaded trains.
    """
    sources: Dict[str, Source] = {}
    for name, mod in hf_modules(cfg).items():
        src = sources.setdefault(mod.directory, Source(mod.directory))
        for entry in mod.entries:
            src.check(entry)
    return sources


def _rows(entry: Entry, idx: int, tp_rank: int, tp_size: int, dim: int):
    n = entry.shapes[idx][dim]
    if n % tp_size:
        raise HFWeightsError(entry.hf[idx], f"dimension {dim} ({n}) is not divisible by the tensor-parallel size "
                                            f"{tp_size}")
    size = n // tp_size
    return tp_rank * size, (tp_rank + 1) * size


def read_shard(src: Source, entry: Entry, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of one mimo parameter, in megatron's layout."""
    split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    key = lambda i: src.key(entry.role, entry.hf[i])  # noqa: E731
    if entry.kind == "copy":
        if not split:
            return src.read(key(0))
        dim = param.partition_dim
        return src.read(key(0), _rows(entry, 0, tp_rank, tp_size, dim), dim)
    if entry.kind == "glu":
        parts = [src.read(key(i), _rows(entry, i, tp_rank, tp_size, 0) if split else None) for i in (0, 1)]
        return torch.cat(parts, dim=0)
    heads, groups, d = entry.heads
    local = groups // tp_size if split else groups
    if local * (tp_size if split else 1) != groups:
        raise HFWeightsError(entry.hf[-1], f"{groups} query groups do not split over tensor-parallel size {tp_size}")
    g0 = tp_rank * local if split else 0
    per = heads // groups
    # (HF tensor index, first row) of the q, k and v sections: three tensors, or one packed [q; k; v].
    if entry.kind == "packed_qkv":
        sections = ((0, 0), (0, heads * d), (0, heads * d + groups * d))
    else:
        sections = ((0, 0), (1, 0), (2, 0))
    (iq, q0), *kv_sections = sections
    q = src.read(key(iq), (q0 + g0 * per * d, q0 + (g0 + local) * per * d))
    rest = q.shape[1:]
    kv = []
    for i, r0 in kv_sections:
        if entry.hf[i] is None:
            kv.append(torch.zeros((local * d,) + tuple(rest), dtype=q.dtype))
        else:
            kv.append(src.read(key(i), (r0 + g0 * d, r0 + (g0 + local) * d)))
    fused = torch.cat([q.reshape(local, per * d, *rest), kv[0].reshape(local, d, *rest),
                       kv[1].reshape(local, d, *rest)], dim=1)
    return fused.reshape(local * (per + 2) * d, *rest)


def load_hf_part(part: torch.nn.Module, mod: HFModule, src: Source, layer_offset: int, tp_rank: int,
                 tp_size: int, experts: Optional[ExpertShard] = None) -> None:
    """Copy this rank's shards of the HF tensors into `part` (one stage of one module). `experts`
    (an MoE LLM): this rank's routed experts read the HF experts of their global index, split over
    expert TP; nothing else is read."""
    by_name = {e.mimo: e for e in mod.entries}
    with torch.no_grad():
        for name, p in part.named_parameters():
            # a tied copy reads the embedding's tensor; a routed expert its global index's
            gname = source_name(name, p, layer_offset, experts.offset if experts else 0)
            entry = by_name.get(gname)
            if entry is None:
                if mod.complete:
                    raise HFWeightsError(mod.directory, f"no HF tensor maps to {mod.module}.{gname}")
                continue
            piece = read_shard(src, entry, p, *tp_of(name, tp_rank, tp_size, experts))
            if tuple(piece.shape) != tuple(p.shape):
                raise HFWeightsError(f"{src.directory}: {entry.hf[0]}",
                                     f"gives {list(piece.shape)} for {mod.module}.{gname}, which is {list(p.shape)}")
            p.copy_(piece.to(p.dtype))
