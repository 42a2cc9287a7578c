"""Layout-independent sharded views of the parameters a rank holds (megatron-core ShardedTensors).

Every parameter is stored under `module.name`, with the name's layer index made
global (`language.decoder.layers.5...` whatever pipeline stage holds layer 5)
and its full, unsharded shape: the same names `mimo.training.state.full_state`
and the sharded and reference initialisations use. A tensor-parallel shard becomes one
ShardedTensor (megatron's `partition_dim`), or `partition_stride` of them for
strided shards (megatron's gated MLP: rank r holds piece r of each of the
`stride` parts). Copies held by TP ranks (unsharded parameters), DP/CP ranks or
a last pipeline stage's tied output layer are replicas: only the main replica
(replica id all zeros) is written. A checkpoint therefore loads on any layout.

Routed experts of an MoE LLM are stored by their global expert index
(`...mlp.experts.local_experts.<global index>...`, whatever EP rank holds them),
sliced over expert TP, with their copies over expert DP as replicas: an expert
saved at one `ep` / `etp` loads at any other. Where the expert grid is the dense
one (ep 1, etp = tp) these are exactly the dense names, shards and replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from megatron.core.dist_checkpointing import ShardedTensor

from mimo.config import LANGUAGE
from mimo.model.reference_init import expert_shard, global_name, is_expert

TIED_OUTPUT, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


@dataclass
class ParamShard:
    """One parameter of this rank: its checkpoint key, how its local tensor maps onto the full one."""
    key: str
    param: torch.nn.Parameter
    module: str
    full_shape: Tuple[int, ...]
    dim: int                 # partition dim (used when tp_size or stride > 1)
    stride: int              # pieces per local tensor along `dim`
    tp_rank: int
    tp_size: int             # tensor-parallel fragments of each piece (1: not sharded)
    replica: Tuple[int, int, int]

    def pieces(self, t: torch.Tensor) -> List[torch.Tensor]:
        return list(t.chunk(self.stride, dim=self.dim)) if self.stride > 1 else [t]

    def sharded(self, key: str, t: torch.Tensor, replica=None) -> List[ShardedTensor]:
        """ShardedTensors of `t` (this parameter's local tensor or a tensor shaped like it) under `key`."""
        replica = self.replica if replica is None else replica
        if self.tp_size == 1 and self.stride == 1:
            return [ShardedTensor.from_rank_offsets(key, t, replica_id=replica)]
        frags = self.stride * self.tp_size
        return [ShardedTensor.from_rank_offsets(key, piece.contiguous() if self.stride > 1 else piece,
                                                (self.dim, j * self.tp_size + self.tp_rank, frags),
                                                replica_id=replica)
                for j, piece in enumerate(self.pieces(t))]

    def join(self, pieces: List[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]

    def row_boxes(self, r0: int, r1: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """(global offset, shape) of the boxes of the full tensor that hold rows `r0:r1` (axis 0) of
        this rank's local tensor, in the order `join` puts them back together."""
        local = tuple(self.param.shape)
        if self.tp_size == 1 and self.stride == 1:
            return [((r0,) + (0,) * (len(local) - 1), (r1 - r0,) + local[1:])]
        size = local[self.dim] // self.stride
        out = []
        for j in range(self.stride):
            start = (j * self.tp_size + self.tp_rank) * size  # piece j's place along `dim` in the full tensor
            offset, shape = [0] * len(local), list(local)
            if self.dim == 0:  # the pieces are consecutive runs of rows
                lo, hi = max(r0, j * size), min(r1, (j + 1) * size)
                if lo >= hi:
                    continue
                offset[0], shape[0] = start + lo - j * size, hi - lo
            else:  # every piece holds all the rows
                offset[0], shape[0] = r0, r1 - r0
                offset[self.dim], shape[self.dim] = start, size
            out.append((tuple(offset), tuple(shape)))
        return out

    def sharded_rows(self, key: str, r0: int, r1: int, dtype: torch.dtype) -> List[ShardedTensor]:
        """Fresh ShardedTensors to load rows `r0:r1` of this rank's local tensor from `key` (an
        uneven box of the full tensor: megatron-core loads those through torch DCP)."""
        return [ShardedTensor(key, torch.empty(shape, dtype=dtype, device=self.param.device), dtype, shape,
                              self.full_shape, offset, None, replica_id=self.replica)
                for offset, shape in self.row_boxes(r0, r1)]


def param_shards(trainer) -> List[ParamShard]:
    """This rank's parameters, modules in config order (encoders, then the LLM)."""
    tied = trainer.cfg.model.language.tie_embeddings
    out = []
    for module in trainer.cfg.modules:
        part = trainer.parts.get(module)
        if part is None:
            continue
        grid = trainer.topo.grid(module)
        c, lay = grid.coords, grid.layout
        tp_rank, tp = c["tp"], lay.tp
        dp_cp = c["dp"] * lay.cp + c["cp"]
        offset = trainer.layer_offsets.get(module, 0)
        experts = expert_shard(trainer.cfg.model.language, grid) if module == LANGUAGE else None
        for name, p in part.named_parameters():
            extra = 0
            if module == LANGUAGE and tied and name == TIED_OUTPUT:
                # A later pipeline stage's copy of the tied embedding: stored once, as the embedding.
                name, extra = EMBEDDING, 1
            if experts is not None and is_expert(name):
                # Global expert index; split over expert TP; copies over expert DP are replicas.
                key = f"{module}.{global_name(name, offset, experts.offset)}"
                out.append(_shard(key, p, module, experts.tp_rank, experts.tp_size, grid.expert_coords["edp"], 0))
            else:
                out.append(_shard(f"{module}.{global_name(name, offset)}", p, module, tp_rank, tp, dp_cp, extra))
    return out


def _shard(key: str, p, module: str, tp_rank: int, tp: int, dp_index: int, extra: int) -> ParamShard:
    """A parameter split over a TP group of size `tp` (where megatron marks it so) and held by the
    replicas numbered `dp_index` (0: the one that writes)."""
    shape = list(p.shape)
    if bool(getattr(p, "tensor_model_parallel", False)) and tp > 1:
        dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
        shape[dim] *= tp
        return ParamShard(key, p, module, tuple(shape), dim, stride, tp_rank, tp, (0, dp_index, extra))
    return ParamShard(key, p, module, tuple(shape), 0, 1, 0, 1, (tp_rank, dp_index, extra))


def _slot(s: ParamShard) -> str:
    """The state-dict entry of a parameter (a tied copy gets its own entry under the same key)."""
    return s.key if s.replica[2] == 0 else s.key + "#tied_copy"


def weights_state(shards: List[ParamShard]) -> Dict[str, List[ShardedTensor]]:
    """The sharded state dict of the weights (for saving: views of the live parameters)."""
    return {_slot(s): s.sharded(s.key, s.param.detach()) for s in shards}


def weights_request(shards: List[ParamShard]) -> Dict[str, List[ShardedTensor]]:
    """What to load: fresh tensors shaped like each local shard (copied in by `assign_weights`)."""
    return {_slot(s): s.sharded(s.key, torch.empty_like(s.param.detach())) for s in shards}


def assign_weights(shards: List[ParamShard], loaded: Dict) -> None:
    with torch.no_grad():
        for s in shards:
            s.param.copy_(s.join(loaded[_slot(s)]))
