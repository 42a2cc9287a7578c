"""Rank <-> coordinate arithmetic of one module's grid. Pure Python, no processes.

A module occupies ranks [rank_offset, rank_offset + tp*cp*ep*dp*pp) and orders
them like megatron-core's default `tp-cp-ep-dp-pp`: tp varies fastest, pp
slowest. Every rank can therefore compute any other rank's coordinates, which
is what boundary-communicator plans need.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Dict, List, Sequence, Tuple

from mimo.config import ParallelConfig

# Fastest-varying first, as in megatron-core's order string "tp-cp-ep-dp-pp".
DIMS: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    rank_offset: int = 0

    @classmethod
    def from_config(cls, p: ParallelConfig) -> "Layout":
        return cls(tp=p.tp, cp=p.cp, ep=p.ep, dp=p.dp, pp=p.pp, rank_offset=p.rank_offset)

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

    def coords(self, rank: int) -> Dict[str, int]:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside ranks [{self.ranks.start}, {self.ranks.stop})")
        local, out = rank - self.rank_offset, {}
        for d in DIMS:
            n = getattr(self, d)
            out[d] = local % n
            local //= n
        return out

    def rank(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing dims are 0)."""
        local, stride = 0, 1
        for d in DIMS:
            n = getattr(self, d)
            c = coords.get(d, 0)
            if not 0 <= c < n:
                raise ValueError(f"{d} coordinate {c} out of range [0, {n})")
            local += c * stride
            stride *= n
        return self.rank_offset + local

    def groups(self, dims: Sequence[str]) -> List[List[int]]:
        """All groups along `dims`: ranks that differ only in those coordinates.

        Groups are listed in a fixed order (by the other coordinates), and the
        ranks in each group are ordered with the first of `dims` fastest, so
        every process derives the identical enumeration.
        """
        unknown = [d for d in dims if d not in DIMS]
        if unknown:
            raise ValueError(f"unknown grid dims {unknown}; known: {DIMS}")
        inner = [d for d in DIMS if d in dims]
        outer = [d for d in DIMS if d not in dims]
        out = []
        for oc in product(*[range(getattr(self, d)) for d in reversed(outer)]):
            fixed = dict(zip(reversed(outer), oc))
            members = []
            for ic in product(*[range(getattr(self, d)) for d in reversed(inner)]):
                members.append(self.rank(**fixed, **dict(zip(reversed(inner), ic))))
            out.append(members)
        return out

    def group_of(self, rank: int, dims: Sequence[str]) -> List[int]:
        for g in self.groups(dims):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is not in this layout")
