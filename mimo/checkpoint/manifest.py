"""`manifest.json`: every file of a checkpoint with its size and CRC32, written after all shards.

Loading checks it before any collective, so a missing, truncated or corrupt
shard is reported as one line naming the file instead of failing (or hanging)
inside the distributed load. Its presence also marks the checkpoint complete.

Checksums are split over the ranks: each reads about 1/N of the bytes (largest
file first to the least-loaded rank, LPT), on save and on load. A 70B model
with Adam state is about a terabyte; one rank reading it all would hold every
other rank in a barrier for minutes, past the collective timeout.
"""

from __future__ import annotations

import heapq
import json
import os
import zlib
from typing import Dict, List, Mapping, Sequence

import torch.distributed as dist

from .paths import CheckpointError

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def crc32(path: str) -> int:
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return value
            value = zlib.crc32(block, value)


def listing(ckpt: str) -> Dict[str, int]:
    """Every file under `ckpt` but the manifest: relative path -> bytes."""
    files = {}
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ckpt)
            if rel != MANIFEST:
                files[rel] = os.path.getsize(path)
    return dict(sorted(files.items()))


def shares(sizes: Mapping[str, int], world: int) -> List[List[str]]:
    """The files each of `world` ranks checksums: largest first, each to the rank with the
    fewest bytes so far (ties: lower rank). Every rank computes the same split from the
    same sizes, whatever their order."""
    load = [(0, r) for r in range(world)]
    out: List[List[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        done, r = heapq.heappop(load)
        out[r].append(name)
        heapq.heappush(load, (done + sizes[name], r))
    return out


def checksum_files(ckpt: str, names: Sequence[str]) -> Dict[str, Dict[str, int]]:
    return {rel: {"bytes": os.path.getsize(os.path.join(ckpt, rel)), "crc32": crc32(os.path.join(ckpt, rel))}
            for rel in names}


def gather_checksums(ckpt: str) -> Dict[str, Dict[str, int]]:
    """Collective: the manifest's entries for every file of `ckpt`, each file read by one rank.

    Rank 0's listing decides the split (a rank on another node may list a shared directory
    late), so every rank checksums a share of the same files."""
    found = [listing(ckpt) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    mine = checksum_files(ckpt, shares(found[0], dist.get_world_size())[dist.get_rank()])
    parts: List[Dict[str, Dict[str, int]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, mine)
    return dict(sorted((k, v) for part in parts for k, v in part.items()))


def write_manifest(ckpt: str, files: Mapping[str, Dict[str, int]] | None = None) -> None:
    """Write `files` (from `gather_checksums`), or checksum every file here in this process."""
    if files is None:
        files = checksum_files(ckpt, list(listing(ckpt)))
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)


def read_manifest(ckpt: str) -> Dict[str, Dict[str, int]]:
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        with open(path) as f:
            return json.load(f)["files"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def verify(ckpt: str, checksums: bool = True) -> None:
    """Every listed file exists with its size (and, with `checksums`, its CRC32)."""
    for rel, want in read_manifest(ckpt).items():
        path = os.path.join(ckpt, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: truncated or modified ({size} bytes, the manifest says {want['bytes']})")
    if checksums:
        verify_share(ckpt, 0, 1)


def verify_share(ckpt: str, rank: int, world: int) -> None:
    """The CRC32 of the files in share `rank` of `world` (sizes: `verify`, which every rank runs
    before the model is built)."""
    files = read_manifest(ckpt)
    for rel in shares({rel: want["bytes"] for rel, want in files.items()}, world)[rank]:
        if crc32(os.path.join(ckpt, rel)) != files[rel]["crc32"]:
            raise CheckpointError(f"{os.path.join(ckpt, rel)}: corrupt (CRC32 differs from the manifest)")
