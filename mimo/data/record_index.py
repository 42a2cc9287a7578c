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
what decides it (the records file's bytes, the tokenizer, the code that tokenises, the settings;
`LlavaDataset._index_key`): a later start whose fingerprint matches loads it instead of tokenising
anything. Media files are not in the fingerprint.

Energon's records stream in, so its index is keyed by sample key instead (`gather_keyed_index`):
each rank learns the records of its own part of the dataset and all gather them with their keys.

Storage is a few arrays, not an object per record: a rank holds the index of every record.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

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
    """Every record's RecordMeta (by its index in the file), or the reason it is bad.

    `counts` [N, 4] int64: tokens, loss positions, images, audio clips (-1 for a bad record);
    `grids` [Σ images, 3] int64 (native-resolution runs only, else None): each image's patch grid,
    in record order; `bad`: index -> reason."""

    def __init__(self, counts: np.ndarray, bad: Dict[int, str], grids: Optional[np.ndarray] = None):
        self.counts, self.bad, self.grids = counts, bad, grids
        if grids is not None:
            images = np.where(counts[:, 0] >= 0, counts[:, 2], 0)
            self.grid_start = np.concatenate([[0], np.cumsum(images)])
            if self.grid_start[-1] != len(grids):
                raise ValueError(f"{len(grids)} image grids for {self.grid_start[-1]} images")

    @classmethod
    def of(cls, num_records: int, native: bool, metas: Iterable[Tuple[int, Union[RecordMeta, str]]]):
        """The index of the given records (the others unknown: counts -1, not bad)."""
        return assemble(num_records, native, [part(metas)])

    def __len__(self) -> int:
        return len(self.counts)

    def meta(self, idx: int) -> Union[RecordMeta, str]:
        """The record's RecordMeta, or the reason it is bad."""
        reason = self.bad.get(idx)
        if reason is not None:
            return reason
        tokens, loss, images, audio = (int(x) for x in self.counts[idx])
        grids = None
        if self.grids is not None:
            grids = tuple(tuple(g) for g in self.grids[self.grid_start[idx]:self.grid_start[idx + 1]].tolist())
        return RecordMeta(tokens, loss, images, audio, grids)

    def missing(self) -> List[int]:
        """Records neither indexed nor bad (none, once built)."""
        return [i for i in np.flatnonzero(self.counts[:, 0] < 0).tolist() if i not in self.bad]


def part(metas: Iterable[Tuple[int, Union[RecordMeta, str]]]) -> Tuple:
    """Some records' metas as arrays: (good rows, their counts, their grids in row order, bad)."""
    rows, counts, grids, bad = [], [], [], {}
    for i, meta in metas:
        if isinstance(meta, str):
            bad[i] = meta
            continue
        rows.append(i)
        counts.append((meta.tokens, meta.loss, meta.images, meta.audio))
        grids += meta.grids or ()
    return (np.array(rows, dtype=np.int64), np.array(counts, dtype=np.int64).reshape(-1, 4),
            np.array(grids, dtype=np.int64).reshape(-1, 3), bad)


def assemble(num_records: int, native: bool, parts: List[Tuple]) -> RecordIndex:
    """One index from disjoint parts (`part`)."""
    counts = np.full((num_records, 4), -1, dtype=np.int64)
    bad: Dict[int, str] = {}
    for rows, got, _, b in parts:
        counts[rows] = got
        bad.update(b)
    grids = None
    if native:
        start = np.concatenate([[0], np.cumsum(np.where(counts[:, 0] >= 0, counts[:, 2], 0))])
        grids = np.zeros((int(start[-1]), 3), dtype=np.int64)
        for rows, got, g, _ in parts:
            n = got[:, 2]
            # Row r's images go to grids[start[r]:start[r] + n_r], in its part's row order.
            first = np.repeat(start[rows], n)
            within = np.arange(len(g)) - np.repeat(np.cumsum(n) - n, n)
            grids[first + within] = g
    return RecordIndex(counts, bad, grids)


def gather_index(num_records: int, native: bool, learn: Callable[[int], Union[RecordMeta, str]], group) -> RecordIndex:
    """Collective over `group` (a mimo.runtime.fan_in.FanIn, every rank at the same point of
    start-up): each rank learns every W-th record with `learn` (a RecordMeta, or a bad record's
    reason) and gathers the rest."""
    rank, world = group.rank, group.world
    return assemble(num_records, native, _gathered(group, _learn_rows, learn, range(rank, num_records, world)))


class KeyedRows:
    """Rows of a keyed index by record key, held as 64-bit hashes of the keys (sorted, 16 bytes a
    record, not a table of strings). Keys that repeat, or two whose hashes collide, are counted in
    `repeats`: an index with any cannot name its records."""

    def __init__(self, hashes: np.ndarray):
        self.order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[self.order]
        self.repeats = int((self.hashes[1:] == self.hashes[:-1]).sum())

    def row(self, key: str) -> Optional[int]:
        h = key_hash(key)
        i = int(np.searchsorted(self.hashes, h))
        return int(self.order[i]) if i < len(self.hashes) and self.hashes[i] == h else None


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def gather_keyed_index(share: Iterable[dict], native: bool, learn: Callable[[dict, int], Union[RecordMeta, str]],
                       group) -> Tuple[KeyedRows, RecordIndex]:
    """Collective over `group`, like `gather_index`, for records that stream in (energon): each rank
    learns the records of its own `share` of the dataset (each naming itself by its "source" key)
    and all gather them. Returns the rows by key and the index of the records, in rank order."""
    parts = _gathered(group, _learn_keyed, learn, share)
    hashes, shifted, n = [], [], 0
    for h, (rows, counts, grids, bad) in parts:  # each rank's rows count from 0: shift them after the others'
        shifted.append((rows + n, counts, grids, {i + n: why for i, why in bad.items()}))
        hashes.append(h)
        n += len(h)
    return KeyedRows(np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.int64)), assemble(n, native, shifted)


def _learn_rows(learn, rows) -> Tuple:
    return part((i, learn(i)) for i in rows)


def _learn_keyed(learn, share) -> Tuple[np.ndarray, Tuple]:
    hashes, metas = [], []
    for k, record in enumerate(share):
        hashes.append(key_hash(record["source"]))
        metas.append((k, learn(record, k)))
    return np.array(hashes, dtype=np.int64), part(metas)


def _gathered(group, learn_part: Callable, *args) -> List:
    """Each rank's `learn_part(*args)`, gathered over `group` in rank order.

    Learning can fail on one rank only (a filesystem error reading a header, `MediaReadError`):
    that rank still takes its part in the gather, flagged, so the others do not wait for it; every
    rank then raises, the failed one its own error."""
    mine = None
    failure: Optional[BaseException] = None
    try:
        mine = learn_part(*args)
    except Exception as exc:  # re-raised below, after the gather (which is not inside the try)
        failure = exc
    # Arrays, not an object per record: a million records gather as some 40 MB, not hundreds.
    parts = group.all_gather_object((None if failure is None else str(failure), mine))
    if failure is not None:
        raise failure
    failed = [(r, p[0]) for r, p in enumerate(parts) if p[0] is not None]
    if failed:
        r, msg = failed[0]
        msg = msg[len("error: "):] if msg.startswith("error: ") else msg
        raise DataError(f"error: data: rank {r} failed to index the records: {msg}")
    return [p[1] for p in parts]


FORMAT = 2  # of the index file; part of the fingerprint


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
    """Write the index for a later start (one rank): a temporary file (named for this host and
    process), synced, then renamed, so that a crash mid-write never leaves a half file under
    `path`. A failed write only warns: the run does not need the file."""
    bad = sorted(index.bad)
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), counts=index.counts, native=np.array(index.grids is not None),
                     grids=index.grids if index.grids is not None else np.zeros((0, 3), dtype=np.int64),
                     bad_rows=np.array(bad, dtype=np.int64), bad_reasons=np.array(json.dumps([index.bad[i] for i in bad])))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a crash
        finally:
            os.close(folder)
    except OSError as exc:
        print(f"warning: data.index: could not write {path} ({exc}); the next start indexes the records again",
              file=sys.stderr, flush=True)
        if os.path.exists(tmp):
            os.remove(tmp)


def _foreign(path: str) -> bool:
    """Whether `path` holds something else than an index mimo wrote, whole or damaged: it is not empty,
    and it is not a zip archive holding the `key` entry every index holds, nor one too damaged to read
    (it begins as a zip archive but does not read as one)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return False
    if head != b"PK\x03\x04":
        return True
    try:
        with zipfile.ZipFile(path) as z:
            return "key.npy" not in z.namelist()
    except zipfile.BadZipFile:
        return False


def load_index(path: str, key: str, num_records: int) -> Optional[RecordIndex]:
    """The index kept in `path`, or None when there is none, it cannot be read, or it was made for
    other records, tokenizer or settings (another fingerprint). A DataError when `path` holds something
    else, which the index written after the start would replace."""
    if not os.path.isfile(path):
        return None
    if _foreign(path):  # never replaced (the run writes its index there): it may hold anything, records included
        raise DataError(f"error: data.index: {path} is not a record index (mimo writes a zip archive holding a "
                        "`key` entry): it is left as it is; remove it, or name another file for data.index")
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) != key or f["counts"].shape != (num_records, 4):
                return None
            bad = dict(zip(f["bad_rows"].tolist(), json.loads(str(f["bad_reasons"]))))
            index = RecordIndex(f["counts"], bad, f["grids"] if bool(f["native"]) else None)
        if index.missing():
            raise ValueError(f"{len(index.missing())} records are missing from it")
    except Exception as exc:  # noqa: BLE001 (a damaged or foreign file, whatever numpy or zlib raise: indexed again)
        # numpy's message for a file holding pickled objects suggests loading it unsafely: not for an index.
        why = ("it holds pickled objects, which an index mimo writes never does" if "allow_pickle" in str(exc)
               else f"{type(exc).__name__}: {exc}")
        print(f"warning: data.index: cannot read {path} ({why}); indexing the records again",
              file=sys.stderr, flush=True)
        return None
    return index
