"""`manifest.json`: every file of a checkpoint with its size and CRC32, written after all shards.

Loading checks it before any collective, so a missing, truncated or corrupt
shard is reported as one line naming the file instead of failing (or hanging)
inside the distributed load. Its presence also marks the checkpoint complete.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Dict

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


def write_manifest(ckpt: str) -> None:
    files: Dict[str, Dict[str, int]] = {}
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ckpt)
            if rel != MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path), "crc32": crc32(path)}
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
        if checksums and crc32(path) != want["crc32"]:
            raise CheckpointError(f"{path}: corrupt (CRC32 differs from the manifest)")
