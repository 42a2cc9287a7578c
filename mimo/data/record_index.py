"""What planning needs of every record, learned once for the run and split over the ranks.

Every rank plans each step alike from the records (which ones, packed how, which are bad), and
for that it needs, per record, only a few numbers: its token count, its loss-carrying positions,
its image and audio counts and, for native-resolution images, each image's patch grid (read
from the header). Tokenising a record (its chat template renders each prefix of the
conversation) and reading its media headers cost about a millisecond, so planning from the
records themselves made every rank tokenise the whole global batch each step. Instead, at
start-up each of W ranks learns these numbers for every W-th record and one gather gives every
rank the whole index; from then on a rank plans from the index and tokenises only the records
of the sequences it trains on. A bad record is learned here too, with its reason, so every
rank skips the same ones.

With `data.index: PATH` the index is also kept in a file (`save_index`), keyed by a fingerprint of
everything that decides it (the records file's bytes, the tokenizer, the encoders' settings,
`data.seq_length` and `data.image_root`, the transformers version): a later start whose fingerprint
matches loads it instead of tokenising anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch.distributed as dist

from .llava import DataError, Encoded

Grid = Tuple[int, int, int]


@dataclass(frozen=True)
class RecordMeta:
    """One usable record as planning sees it."""
    tokens: int                      # its token ids (placeholder runs included)
    loss: int                        # positions that carry a loss once it is laid in a sequence
    images: int
    audio: int
    grids: Optional[Tuple[Grid, ...]] = None  # native-resolution images: each one's patch grid

    @classmethod
    def of(cls, enc: Encoded) -> "RecordMeta":
        # A sequence's loss positions are targets whose previous token is of the same record: a
        # record's first token never counts, whatever precedes it.
        return cls(len(enc.input_ids), sum(enc.targets[1:]), len(enc.images), len(enc.audio),
                   None if enc.grids is None else tuple(tuple(g) for g in enc.grids))


class RecordIndex:
    """RecordMeta of every record (by its index in the file) or the reason it is bad."""

    def __init__(self, num_records: int):
        self.counts = np.full((num_records, 4), -1, dtype=np.int64)  # tokens, loss, images, audio
        self.grids: Dict[int, Tuple[Grid, ...]] = {}
        self.bad: Dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def add(self, idx: int, meta: Union[RecordMeta, str]) -> None:
        if isinstance(meta, str):
            self.bad[idx] = meta
            return
        self.counts[idx] = (meta.tokens, meta.loss, meta.images, meta.audio)
        if meta.grids is not None:
            self.grids[idx] = meta.grids

    def meta(self, idx: int) -> Union[RecordMeta, str]:
        """The record's RecordMeta, or the reason it is bad."""
        reason = self.bad.get(idx)
        if reason is not None:
            return reason
        tokens, loss, images, audio = (int(x) for x in self.counts[idx])
        return RecordMeta(tokens, loss, images, audio, self.grids.get(idx))

    def missing(self) -> List[int]:
        """Records neither indexed nor bad (none, once built)."""
        return [i for i in np.flatnonzero(self.counts[:, 0] < 0).tolist() if i not in self.bad]


def gather_index(num_records: int, learn: Callable[[int], Union[RecordMeta, str]], group) -> RecordIndex:
    """Collective over `group` (every rank of it, at the same point of start-up): each rank learns
    every W-th record with `learn` (a RecordMeta, or a bad record's reason) and gathers the rest.

    Learning can fail on one rank only (a filesystem error reading a header, `MediaReadError`):
    that rank still takes its part in the gather, flagged, so the others do not wait for it; every
    rank then raises, the failed one its own error."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = RecordIndex(num_records)
    failure: Optional[BaseException] = None
    try:
        for i in range(rank, num_records, world):
            mine.add(i, learn(i))
    except Exception as exc:  # re-raised below, after the gather (which is not inside the try)
        failure = exc
    rows = np.flatnonzero(mine.counts[:, 0] >= 0)
    # Arrays, not an object per record: a million records gather as some 40 MB, not hundreds.
    part = (None if failure is None else str(failure), rows, mine.counts[rows], mine.grids, mine.bad)
    parts: List[object] = [None] * world
    dist.all_gather_object(parts, part, group=group)
    if failure is not None:
        raise failure
    failed = [(r, p[0]) for r, p in enumerate(parts) if p[0] is not None]
    if failed:
        r, msg = failed[0]
        msg = msg[len("error: "):] if msg.startswith("error: ") else msg
        raise DataError(f"error: data: rank {r} failed to index the records: {msg}")
    index = RecordIndex(num_records)
    for _, got_rows, counts, grids, bad in parts:
        index.counts[got_rows] = counts
        index.grids.update(grids)
        index.bad.update(bad)
    return index


FORMAT = 1  # of the index file; part of the fingerprint


def fingerprint(what: object) -> str:
    """A hex digest of a JSON-able description of everything the index depends on."""
    blob = json.dumps([FORMAT, what], sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def file_digest(path: str) -> str:
    """The file's bytes, hashed (read in 8 MB pieces)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(8 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def save_index(index: RecordIndex, path: str, key: str) -> None:
    """Write the index for a later start (one rank): a temporary file, synced, then renamed, so that
    a crash mid-write never leaves a half file under `path`. A failed write only warns: the run
    does not need the file."""
    rows = sorted(index.grids)
    bad = sorted(index.bad)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), counts=index.counts, grid_rows=np.array(rows, dtype=np.int64),
                     grid_lens=np.array([len(index.grids[i]) for i in rows], dtype=np.int64),
                     grids=np.array([g for i in rows for g in index.grids[i]], dtype=np.int64).reshape(-1, 3),
                     bad_rows=np.array(bad, dtype=np.int64), bad_reasons=np.array(json.dumps([index.bad[i] for i in bad])))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        print(f"warning: data.index: could not write {path} ({exc}); the next start indexes the records again",
              file=sys.stderr, flush=True)
        if os.path.exists(tmp):
            os.remove(tmp)


def load_index(path: str, key: str, num_records: int) -> Optional[RecordIndex]:
    """The index kept in `path`, or None when there is none, it cannot be read, or it was made for
    other records, tokenizer or settings (another fingerprint)."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) != key or f["counts"].shape != (num_records, 4):
                return None
            index = RecordIndex(num_records)
            index.counts[:] = f["counts"]
            grids = f["grids"].tolist()
            start = 0
            for i, n in zip(f["grid_rows"].tolist(), f["grid_lens"].tolist()):
                index.grids[i] = tuple(tuple(g) for g in grids[start:start + n])
                start += n
            index.bad = dict(zip(f["bad_rows"].tolist(), json.loads(str(f["bad_reasons"]))))
        if index.missing():
            raise ValueError(f"{len(index.missing())} records are missing from it")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # a damaged or foreign file: indexed again, and replaced
        print(f"warning: data.index: cannot read {path} ({type(exc).__name__}: {exc}); indexing the records again",
              file=sys.stderr, flush=True)
        return None
    return index
