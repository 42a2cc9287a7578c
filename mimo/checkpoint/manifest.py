"""`manifest.json`: every file of a checkpoint with its size and CRC32, written after all shards.

Loading checks it before any collective, so a missing, truncated or corrupt
shard is reported as one line naming the file instead of failing (or hanging)
inside the distributed load. Its presence also marks the checkpoint complete.

Checksums are split over the ranks: each reads about 1/N of the bytes (largest
file first to the least-loaded rank, LPT), on save and on load. On save rank 0
lists the directory, sends each rank its share and gathers the entries back; on
load every rank computes the same split from the manifest's sizes. A 70B model
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


def crc32(path: str, flush: bool = False) -> int:
    """The file's CRC32; with `flush`, also fsync it, as a save must before it publishes: the rank
    that reads a file for its checksum flushes it, so no rank flushes them all (on a shared
    filesystem only the writing node's flush reaches the disk, and megatron-core's writers flush
    their own files; this covers the rest on the node that wrote them)."""
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            value = zlib.crc32(block, value)
        if flush:
            os.fsync(f.fileno())
    return value


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


def checksum_files(ckpt: str, names: Sequence[str], flush: bool = False) -> Dict[str, Dict[str, int]]:
    return {rel: {"bytes": os.path.getsize(os.path.join(ckpt, rel)), "crc32": crc32(os.path.join(ckpt, rel), flush)}
            for rel in names}


def gather_checksums(ckpt: str) -> Dict[str, Dict[str, int]]:
    """Collective: on rank 0, the manifest's entries for every file of `ckpt`, each file read (and
    flushed to disk) by one rank; {} on the other ranks.

    Rank 0 lists the directory (a rank on another node may list a shared directory late), splits
    it and sends each rank its share; the entries come back to rank 0 alone, which writes the
    manifest. What a rank other than 0 sends and receives is its own share only."""
    world, rank = dist.get_world_size(), dist.get_rank()
    split = shares(listing(ckpt), world) if rank == 0 else None
    share: List[List[str] | None] = [None]
    dist.scatter_object_list(share, split, src=0)
    mine = checksum_files(ckpt, share[0], flush=True)
    parts: List[Dict[str, Dict[str, int]]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return dict(sorted((k, v) for part in parts or () for k, v in part.items()))


def write_manifest(ckpt: str, files: Mapping[str, Dict[str, int]] | None = None) -> None:
    """Write `files` (from `gather_checksums`), or checksum every file here in this process."""
    if files is None:
        files = checksum_files(ckpt, list(listing(ckpt)))
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(ckpt: str) -> Dict[str, Dict[str, int]]:
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as exc:  # not JSON (or not UTF-8), or JSON without a "files" mapping
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    except OSError as exc:  # a directory, or a file this job may not read
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(files, dict) or not all(
            isinstance(rel, str) and isinstance(want, dict)
            and all(isinstance(want.get(k), int) and not isinstance(want.get(k), bool) for k in ("bytes", "crc32"))
            for rel, want in files.items()):
        raise CheckpointError(f"{path}: unreadable (expected {{\"files\": {{name: {{\"bytes\": int, \"crc32\": int}}}}}})")
    return files


def verify(ckpt: str, checksums: bool = True) -> None:
    """Every listed file exists with its size (and, with `checksums`, its CRC32): one process, all files."""
    verify_share(ckpt, 0, 1, checksums)


def verify_share(ckpt: str, rank: int, world: int, checksums: bool = True) -> None:
    """The files of share `rank` of `world`: each exists with its size and, with `checksums`, its CRC32.
    Every rank computes the same split from the manifest's sizes, so over the ranks every file is
    checked once and no rank's work grows with the number of files (one per rank, and more)."""
    files = read_manifest(ckpt)
    for rel in shares({rel: want["bytes"] for rel, want in files.items()}, world)[rank]:
        path = _check_size(ckpt, rel, files[rel]["bytes"])
        if checksums and crc32(path) != files[rel]["crc32"]:
            raise CheckpointError(f"{path}: corrupt (CRC32 differs from the manifest)")


def verify_read_by_all(ckpt: str, names: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """The manifest, after checking the presence and size of `names`: files every rank reads, so every
    rank finds the same damage there, before any process group exists."""
    files = read_manifest(ckpt)
    for rel in names:
        if rel in files:
            _check_size(ckpt, rel, files[rel]["bytes"])
    return files


def _check_size(ckpt: str, rel: str, want: int) -> str:
    path = os.path.join(ckpt, rel)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing")
    size = os.path.getsize(path)
    if size != want:
        raise CheckpointError(f"{path}: truncated or modified ({size} bytes, the manifest says {want})")
    return path
