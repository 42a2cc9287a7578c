"""Rank <-> coordinate arithmetic of one module's grid. Pure Python, no processes.

A module occupies ranks [rank_offset, rank_offset + tp*cp*dp*pp) and orders
them like megatron-core's default `tp-cp-ep-dp-pp` (with ep = 1 in the dense
grid): tp varies fastest, pp slowest. Every rank can therefore compute any
other rank's coordinates, which is what boundary-communicator plans need.

An MoE LLM's expert parallelism (`ep`, `etp`) adds no ranks: like
megatron-core's expert rank generator it is a second decomposition of the same
ranks, `etp-ep-edp-pp` (etp fastest, pp slowest, edp = tp*cp*dp / (etp*ep)),
so each pipeline stage's tp*cp*dp ranks are re-divided into expert tensor
parallel x expert parallel x expert data parallel (`expert_coords`,
`expert_groups`). Encoders and dense LLMs have ep = etp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Dict, List, Sequence, Tuple

from mimo.config import ParallelConfig

# Fastest-varying first, as in megatron-core's order string "tp-cp-ep-dp-pp" (the dense grid has no ep).
DIMS: Tuple[str, ...] = ("tp", "cp", "dp", "pp")
# The expert decomposition of the same ranks, as megatron-core's expert rank generator orders it.
EXPERT_DIMS: Tuple[str, ...] = ("etp", "ep", "edp", "pp")


def _coords(sizes: Dict[str, int], dims: Sequence[str], local: int) -> Dict[str, int]:
    out = {}
    for d in dims:
        out[d] = local % sizes[d]
        local //= sizes[d]
    return out


def _local_rank(sizes: Dict[str, int], dims: Sequence[str], coords: Dict[str, int]) -> int:
    local, stride = 0, 1
    for d in dims:
        c = coords.get(d, 0)
        if not 0 <= c < sizes[d]:
            raise ValueError(f"{d} coordinate {c} out of range [0, {sizes[d]})")
        local += c * stride
        stride *= sizes[d]
    return local


def _groups(sizes: Dict[str, int], all_dims: Sequence[str], dims: Sequence[str], offset: int) -> List[List[int]]:
    unknown = [d for d in dims if d not in all_dims]
    if unknown:
        raise ValueError(f"unknown grid dims {unknown}; known: {tuple(all_dims)}")
    inner = [d for d in all_dims if d in dims]
    outer = [d for d in all_dims if d not in dims]
    return [_members(sizes, all_dims, inner, dict(zip(reversed(outer), oc)), offset)
            for oc in product(*[range(sizes[d]) for d in reversed(outer)])]


def _members(sizes: Dict[str, int], all_dims: Sequence[str], inner: Sequence[str], fixed: Dict[str, int],
             offset: int) -> List[int]:
    """The group whose other coordinates are `fixed`: its ranks, the first of `inner` fastest."""
    stride, strides = 1, {}
    for d in all_dims:
        strides[d] = stride
        stride *= sizes[d]
    out = [offset + _local_rank(sizes, all_dims, fixed)]  # the member at inner coordinates 0
    for d in inner:  # each next dim steps over the ranks listed so far, so the first stays fastest
        out = [r + c * strides[d] for c in range(sizes[d]) for r in out]
    return out


def _group_of(sizes: Dict[str, int], all_dims: Sequence[str], dims: Sequence[str], offset: int,
              coords: Dict[str, int]) -> List[int]:
    """The group of `_groups` that holds the rank at `coords`, built from them (not searched for)."""
    unknown = [d for d in dims if d not in all_dims]
    if unknown:
        raise ValueError(f"unknown grid dims {unknown}; known: {tuple(all_dims)}")
    inner = [d for d in all_dims if d in dims]
    return _members(sizes, all_dims, inner, {d: coords[d] for d in all_dims if d not in dims}, offset)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    rank_offset: int = 0
    # Expert parallelism of an MoE LLM: not grid dims (see the module docstring).
    ep: int = 1
    etp: int = 1

    @classmethod
    def from_config(cls, p: ParallelConfig) -> "Layout":
        return cls(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, rank_offset=p.rank_offset, ep=p.ep, etp=p.etp)

    @property
    def edp(self) -> int:
        """Expert data parallel size: each stage's tp*cp*dp ranks over etp*ep."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def expert_shape(self) -> List[int]:
        return [self._expert_sizes[d] for d in EXPERT_DIMS]

    @property
    def _expert_sizes(self) -> Dict[str, int]:
        if (self.tp * self.cp * self.dp) % (self.etp * self.ep):
            raise ValueError(f"etp * ep ({self.etp} * {self.ep}) does not divide tp * cp * dp "
                             f"({self.tp} * {self.cp} * {self.dp})")
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def expert_coords(self, rank: int) -> Dict[str, int]:
        """`rank`'s coordinates in the expert decomposition (etp, ep, edp, pp)."""
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside ranks [{self.ranks.start}, {self.ranks.stop})")
        return _coords(self._expert_sizes, EXPERT_DIMS, rank - self.rank_offset)

    def expert_groups(self, dims: Sequence[str]) -> List[List[int]]:
        """All groups of the expert decomposition along `dims` (as `groups`, over EXPERT_DIMS)."""
        return _groups(self._expert_sizes, EXPERT_DIMS, dims, self.rank_offset)

    def expert_group_of(self, rank: int, dims: Sequence[str]) -> List[int]:
        return _group_of(self._expert_sizes, EXPERT_DIMS, dims, self.rank_offset, self.expert_coords(rank))

    @property
    def shape(self) -> List[int]:
        return [getattr(self, d) for d in DIMS]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def contains(self, rank: int) -> bool:
        return rank in self.ranks

    @property
    def _sizes(self) -> Dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def coords(self, rank: int) -> Dict[str, int]:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside ranks [{self.ranks.start}, {self.ranks.stop})")
        return _coords(self._sizes, DIMS, rank - self.rank_offset)

    def rank(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing dims are 0)."""
        return self.rank_offset + _local_rank(self._sizes, DIMS, coords)

    def groups(self, dims: Sequence[str]) -> List[List[int]]:
        """All groups along `dims`: ranks that differ only in those coordinates.

        Groups are listed in a fixed order (by the other coordinates), and the
        ranks in each group are ordered with the first of `dims` fastest, so
        every process derives the identical enumeration.
        """
        return _groups(self._sizes, DIMS, dims, self.rank_offset)

    def group_of(self, rank: int, dims: Sequence[str]) -> List[int]:
        """The group of `groups(dims)` that holds `rank`."""
        return _group_of(self._sizes, DIMS, dims, self.rank_offset, self.coords(rank))
