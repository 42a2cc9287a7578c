"""Tile sizes, launch settings and intra-GPU split settings of the bitfield attention kernels
(mimo.attention), and their defaults: a config of its own because a model's YAML can set them
(`model.language.attention_kernel`, `model.encoders.<name>.attention_kernel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


# split_tiles=None: split rows into items of this many tiles where the forward launches fewer than
# FILL_WAVES programs per SM (one program per query block and head).
AUTO_SPLIT_TILES = 16
FILL_WAVES = 2
# A program is at most 1024 threads: 32 warps.
MAX_WARPS = 32
# The fields that are true or false; the others are integers.
BOOL_FIELDS = ("fused_backward", "heads_fastest")


@dataclass(frozen=True)
class KernelConfig:
    """``None`` fields take a default chosen from head_dim (see ``resolve``).

    split_tiles: a query block with more non-empty key tiles than this is split
    into work items of at most ``split_tiles`` tiles each, run as separate
    programs and merged (intra-GPU balancing); 0 disables splitting; None (the
    default) splits, at AUTO_SPLIT_TILES, only where the forward has too few
    programs to fill the GPU (`split_for`): otherwise the partial outputs' extra
    traffic and the merge kernel cost more than the balance gains.
    bwd_*: the dK/dV kernel's tiles and launch settings; dq_*: the dQ kernel's
    (default: the dK/dV kernel's). Each backward kernel has its own plan when
    their tiles differ.
    fused_backward: run the dK/dV and dQ programs in one launch (their tiles may
    differ; their warps and stages must agree), so that dQ programs fill the GPU
    while the last dK/dV programs finish. None (the default) is False: two launches,
    the setting measured so far (tools/tune_attention.py times both).
    heads_fastest: launch the programs of every head of one row (forward, dQ) or
    column (dK/dV) next to each other, rows longest first over all heads at once;
    else (None, the default, measured so far) each head's rows run longest first in
    turn, and the last head's longest rows start late.
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
    bwd_num_warps: Optional[int] = None     # the dK/dV kernel's own (defaults: see resolve)
    bwd_num_stages: Optional[int] = None
    dq_block_m: Optional[int] = None
    dq_block_n: Optional[int] = None
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None
    fused_backward: Optional[bool] = None
    heads_fastest: Optional[bool] = None

    def resolve(self, head_dim: int) -> "KernelConfig":
        big = head_dim > 128
        # head_dim 65-128: tuned on an H200 (tools/tune_attention.py, docs/benchmarks.md): every
        # kernel runs best on 4 warps, the forward with a third pipeline stage. Other widths keep
        # the earlier, untuned choices.
        tuned = 64 < head_dim <= 128
        num_warps = self.num_warps or (4 if head_dim <= 128 else 8)
        num_stages = self.num_stages or (3 if tuned else 1 if big else 2)
        bwd_block_m = self.bwd_block_m or (32 if big else 64)
        bwd_block_n = self.bwd_block_n or (32 if big else 64)
        bwd_num_warps = self.bwd_num_warps or (4 if tuned else num_warps)
        bwd_num_stages = self.bwd_num_stages or (1 if big else 2)
        out = KernelConfig(
            block_m=self.block_m or (64 if big else 128),
            block_n=self.block_n or (32 if big else 64),
            bwd_block_m=bwd_block_m,
            bwd_block_n=bwd_block_n,
            split_tiles=self.split_tiles,
            num_warps=num_warps,
            num_stages=num_stages,
            bwd_num_warps=bwd_num_warps,
            bwd_num_stages=bwd_num_stages,
            dq_block_m=self.dq_block_m or bwd_block_m,
            dq_block_n=self.dq_block_n or bwd_block_n,
            dq_num_warps=self.dq_num_warps or bwd_num_warps,
            dq_num_stages=self.dq_num_stages or bwd_num_stages,
            fused_backward=bool(self.fused_backward),
            heads_fastest=bool(self.heads_fastest),
        )
        for name in ("block_m", "block_n", "bwd_block_m", "bwd_block_n", "dq_block_m", "dq_block_n"):
            value = getattr(out, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        for name in ("num_warps", "bwd_num_warps", "dq_num_warps"):
            value = getattr(out, name)
            if value < 1 or value > MAX_WARPS or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two from 1 to {MAX_WARPS}, got {value}")
        for name in ("num_stages", "bwd_num_stages", "dq_num_stages"):
            if getattr(out, name) < 1:
                raise ValueError(f"KernelConfig.{name} must be >= 1, got {getattr(out, name)}")
        for name in BOOL_FIELDS:
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"KernelConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if out.fused_backward and (out.bwd_num_warps, out.bwd_num_stages) != (out.dq_num_warps, out.dq_num_stages):
            raise ValueError(
                "KernelConfig.fused_backward needs the dK/dV and dQ kernels' warps and stages to agree (one "
                f"launch), got bwd_num_warps {out.bwd_num_warps}, bwd_num_stages {out.bwd_num_stages}, "
                f"dq_num_warps {out.dq_num_warps}, dq_num_stages {out.dq_num_stages}")
        if out.split_tiles is not None and out.split_tiles < 0:
            raise ValueError(f"KernelConfig.split_tiles must be >= 0, got {out.split_tiles}")
        return out

    def split_for(self, programs: int, multiprocessors: Optional[int]) -> int:
        """The forward's split_tiles for a launch of `programs` unsplit programs (query blocks x
        heads) on a device with `multiprocessors` SMs (None: not a GPU, never split by default)."""
        if self.split_tiles is not None:
            return self.split_tiles
        if multiprocessors is None or programs >= FILL_WAVES * multiprocessors:
            return 0
        return AUTO_SPLIT_TILES


def field_problems(fields) -> list:
    """(field, reason) for each entry of a mapping of KernelConfig fields that KernelConfig would
    refuse or misread: not a mapping, an unknown name, a value that is not an integer (not true or
    false for the BOOL_FIELDS), or one below 1 (below 0 for split_tiles), which KernelConfig would take
    as "the default". A mapping without such problems can still fail `resolve` (a tile that is not a
    power of two, say)."""
    if not isinstance(fields, dict):
        return [("", f"must be a mapping of KernelConfig fields, got {fields!r}")]
    known = list(KernelConfig.__dataclass_fields__)
    problems = []
    for key, value in fields.items():
        if key not in known:
            problems.append((str(key), f"unknown field (KernelConfig has {', '.join(known)})"))
        elif key in BOOL_FIELDS:
            if not isinstance(value, bool):
                problems.append((key, f"must be true or false, got {value!r}"))
        elif not isinstance(value, int) or isinstance(value, bool):
            problems.append((key, f"must be an integer, got {value!r}"))
        elif value < (0 if key == "split_tiles" else 1):
            problems.append((key, f"must be {'>= 0' if key == 'split_tiles' else 'a positive integer'}, got {value}"))
    return problems


def resolve_problem(fields: dict, head_dim: int) -> tuple:
    """(field, reason) when KernelConfig(**fields).resolve(head_dim) refuses the fields (each of which
    passed `field_problems`), else ()."""
    try:
        KernelConfig(**fields).resolve(head_dim)
    except ValueError as exc:  # "KernelConfig.<field> must be ..."
        field, _, reason = str(exc).partition(" ")
        return field.split(".")[-1], reason
    return ()
