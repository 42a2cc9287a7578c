"""Tile sizes and intra-GPU split settings of the bitfield attention kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class KernelConfig:
    """``None`` fields take a default chosen from head_dim (see ``resolve``).

    split_tiles: a query block with more non-empty key tiles than this is split
    into work items of at most ``split_tiles`` tiles each, run as separate
    programs and merged (intra-GPU balancing); 0 disables splitting.
    The launch settings for head_dim 65-128 were tuned on an H200 (tools/tune_attention.py);
    the tile sizes, and the settings for other head dims, are untuned choices.
    """

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    bwd_block_m: Optional[int] = None
    bwd_block_n: Optional[int] = None
    split_tiles: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    bwd_num_warps: Optional[int] = None     # the two backward kernels' own (defaults: see resolve)
    bwd_num_stages: Optional[int] = None

    def resolve(self, head_dim: int) -> "KernelConfig":
        big = head_dim > 128
        # head_dim 65-128: tuned on an H200 (tools/tune_attention.py, docs/benchmarks.md); the
        # forward gains a pipeline stage, the backward runs best on 4 warps. Other widths keep
        # the earlier, untuned choices.
        tuned = 64 < head_dim <= 128
        num_warps = self.num_warps or (4 if head_dim <= 64 else 8)
        num_stages = self.num_stages or (3 if tuned else 1 if big else 2)
        out = KernelConfig(
            block_m=self.block_m or (64 if big else 128),
            block_n=self.block_n or (32 if big else 64),
            bwd_block_m=self.bwd_block_m or (32 if big else 64),
            bwd_block_n=self.bwd_block_n or (32 if big else 64),
            split_tiles=16 if self.split_tiles is None else self.split_tiles,
            num_warps=num_warps,
            num_stages=num_stages,
            bwd_num_warps=self.bwd_num_warps or (4 if tuned else num_warps),
            bwd_num_stages=self.bwd_num_stages or (1 if big else 2),
        )
        for name in ("block_m", "block_n", "bwd_block_m", "bwd_block_n"):
            value = getattr(out, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        if out.split_tiles < 0:
            raise ValueError(f"KernelConfig.split_tiles must be >= 0, got {out.split_tiles}")
        return out
