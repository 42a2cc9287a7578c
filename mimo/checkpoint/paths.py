"""Where checkpoints live: `DIR/iter_NNNNNNN/`, `DIR/latest`, and the atomic steps that publish one.

A checkpoint is written under a temporary name (`iter_NNNNNNN.partial`), renamed
to `iter_NNNNNNN` once every rank has written its shards and the manifest is on
disk, and only then named in `latest` (written to a temporary file, fsynced,
renamed). A save that dies at any point leaves `latest` naming the previous
complete checkpoint, and no complete checkpoint is modified while a new one is
written.

A save of a step that already has a complete checkpoint (a run rolled back to an
older one saves that step again) first renames the old one to
`iter_NNNNNNN.replaced`, and deletes it only after `latest` names the new one.
A save that dies between the two renames leaves `latest` naming a step whose
directory is `.replaced`: `resolve` reads that one.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

LATEST = "latest"
_ITER = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (message: one line naming the file or parameter)."""


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, iter_name(step))


def partial_dir(root: str, step: int) -> str:
    return iter_dir(root, step) + ".partial"


def replaced_dir(root: str, step: int) -> str:
    return iter_dir(root, step) + ".replaced"


def read_latest(root: str) -> Optional[int]:
    """The step `DIR/latest` names (None when there is no `latest`: no checkpoint yet)."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:  # a directory, unreadable, or not a step number's digits
        raise CheckpointError(f"{path}: unreadable ({exc.strerror if isinstance(exc, OSError) else 'not text'}); "
                              "it should hold the step number of the last complete checkpoint") from None
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected a step number, found {text[:40]!r}")
    return int(text)


def resolve(path: str) -> str:
    """A checkpoint directory from either `DIR` (its `latest`) or `DIR/iter_NNNNNNN` itself."""
    name = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path) and _ITER.match(name.removesuffix(".replaced")):
        return path
    if _ITER.match(name) and os.path.isdir(os.path.normpath(path) + ".replaced"):
        return os.path.normpath(path) + ".replaced"  # named while a save of its step had moved it aside
    step = read_latest(path)
    if step is None:
        raise CheckpointError(f"{path}: no checkpoint here (neither {LATEST} nor an iter_NNNNNNN directory)")
    target = iter_dir(path, step)
    if os.path.isdir(target):
        return target
    if os.path.isdir(replaced_dir(path, step)):  # a save of the same step died before its rename
        return replaced_dir(path, step)
    raise CheckpointError(f"{os.path.join(path, LATEST)} names step {step} but {target} does not exist")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(path: str) -> None:
    """Flush the directories of a finished checkpoint to disk (its files were flushed by the ranks
    that checksummed them, each its share: `manifest.gather_checksums`)."""
    for dirpath, _, _ in os.walk(path):
        _fsync_dir(dirpath)


def publish(root: str, step: int) -> None:
    """Rename the finished partial directory into place, then point `latest` at it (rank 0 only)."""
    src, dst, old = partial_dir(root, step), iter_dir(root, step), replaced_dir(root, step)
    fsync_dirs(src)
    if os.path.exists(dst):
        # An older checkpoint of this step, perhaps the one `latest` names: kept (under another
        # name, which `resolve` also reads) until `latest` names the new one.
        if os.path.exists(old):
            shutil.rmtree(old)  # a leftover: `dst` exists, so `resolve` never reads it
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync_dir(root)
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)
    if os.path.exists(old):
        shutil.rmtree(old)


def complete_steps(root: str) -> List[int]:
    """Steps of the complete checkpoints in `root` (partial ones excluded), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(root)) if m)


def discard_leftovers(root: str) -> None:
    """Delete what dead saves left (rank 0, with no save in flight): every `.partial` and `.pruned`
    directory, and every `.replaced` one that `resolve` would not read."""
    if not os.path.isdir(root):
        return
    try:
        latest = read_latest(root)
    except CheckpointError:  # an unreadable `latest`: keep every `.replaced` (the resume reports it)
        latest = -1
    for name in os.listdir(root):
        base, _, kind = name.partition(".")
        m = _ITER.match(base)
        if not m or kind not in ("partial", "replaced", "pruned"):
            continue
        step = int(m.group(1))
        if kind in ("partial", "pruned") or latest != -1 and (step != latest or os.path.isdir(iter_dir(root, step))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prune(root: str, keep_last: int) -> List[str]:
    """Retire complete checkpoints older than the newest `keep_last` (never the one `latest` names):
    each is renamed to `iter_NNNNNNN.pruned` at once (no longer a checkpoint to any reader), and the
    renamed directories are returned for the caller to delete (`delete_pruned`, off the step: a
    large checkpoint takes minutes to delete)."""
    latest = read_latest(root)
    out = []
    for step in complete_steps(root)[:-keep_last] if keep_last > 0 else []:
        if step != latest:
            out.append(iter_dir(root, step) + ".pruned")
            os.rename(iter_dir(root, step), out[-1])
    return out


def delete_pruned(dirs: List[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
