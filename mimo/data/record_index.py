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
"""

from __future__ import annotations

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
