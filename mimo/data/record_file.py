"""The records of a JSONL file, each read from disk when asked for.

A rank used to hold every record of `data.path` as Python objects (several times the file's size: a
LLaVA-665K file takes gigabytes per rank, times the ranks of a node). Since the record index, a
rank reads a record only to plan it (its id and media paths) or to tokenise it, so for JSONL it
keeps just where each record's line lies (two offsets and the line number: 24 bytes a record)
and parses a line when it is read. A JSON list has no such lines and is parsed whole, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from array import array
from collections.abc import Sequence

import numpy as np

from .llava import BadRecord, DataError

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark some editors write first


def read_records(path: str):
    """(the records of `path`, a digest of its bytes): a JSON list (parsed whole), or JSONL (one record
    per line, each parsed when it is read: `JsonLines`). The digest is taken in the same read, so the
    ranks can check that they read the same file without reading it again."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
        while not head:
            piece = f.read(1 << 20)
            if not piece:
                break
            head = piece.lstrip()
    if not head.startswith(b"["):
        records = JsonLines(path)
        if not len(records):
            raise DataError(f"error: data.path: {path}: holds no record")
        if head.startswith(b"{") and _maybe_one_object(records):
            _refuse_one_object(path)  # e.g. {"records": [...]}, on one line or pretty-printed
        return records, records.digest
    with open(path, "rb") as f:
        raw = f.read()
    try:
        records = json.loads(raw.removeprefix(BOM).decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise DataError(f"error: data.path: {path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise DataError(f"error: data.path: {path}: JSON nested too deep to read") from None
    if not records:
        raise DataError(f"error: data.path: {path}: holds no record")
    return records, hashlib.blake2b(raw, digest_size=16).hexdigest()


def _maybe_one_object(records: "JsonLines", lines: int = 8) -> bool:
    """Whether a file read as JSONL may be one JSON object: it is one line, or none of its first `lines`
    lines is a JSON object on its own (a pretty-printed object's lines are fragments, or bare values such
    as a list's `"train",`). Reads those lines only: a JSONL file with a record among them is never read
    whole."""
    for i in range(min(len(records), lines)):
        try:
            if not isinstance(records[i], dict):
                continue
        except BadRecord:
            continue
        return len(records) == 1
    return True


def _refuse_one_object(path: str) -> None:
    """A file that is one JSON object other than a record is not a records file: say so, rather than
    name its first line a bad record."""
    with open(path, "rb") as f:
        try:
            whole = json.loads(f.read().removeprefix(BOM).decode("utf-8"))
        except (ValueError, RecursionError):
            return  # JSONL with bad lines: those are bad records, found where they are read
    if isinstance(whole, dict) and "conversations" not in whole:
        keys = ", ".join(map(repr, list(whole)[:3])) + (", ..." if len(whole) > 3 else "")
        raise DataError(f"error: data.path: {path}: one JSON object ({{{keys}}}), not records: give a JSON list "
                        "of records, or JSONL (one record per line)")


class JsonLines(Sequence):
    """Record i of a JSONL file (lines end with \\n or \\r\\n; blank lines are not records). A line that
    is not valid JSON is a bad record (BadRecord, naming the line) when it is read, skipped or fatal
    as `data.on_bad_record` says, like any other bad record. Lines are read with `pread` (no shared
    file offset), so any thread may read; a copy (or a forked process) opens the file again. `digest`:
    the file's bytes hashed, taken in the scan that finds the lines."""

    def __init__(self, path: str):
        self.path = path
        self._open()
        starts, ends, lines = array("q"), array("q"), array("q")
        pos, digest = 0, hashlib.blake2b(digest_size=16)
        # The spans are taken from the descriptor the lines will be read from: the same file.
        with open(self._fd, "rb", closefd=False) as f:
            for n, line in enumerate(f, 1):
                digest.update(line)
                if line.strip():
                    starts.append(pos)
                    ends.append(pos + len(line))
                    lines.append(n)
                pos += len(line)
        self.digest = digest.hexdigest()
        self.spans = np.stack([np.frombuffer(a, dtype=np.int64) for a in (starts, ends, lines)], axis=1) \
            if len(starts) else np.zeros((0, 3), dtype=np.int64)

    def _open(self) -> None:
        self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        weakref.finalize(self, os.close, self._fd)

    def __getstate__(self):  # a copy or pickle holds no descriptor: it opens its own
        return {k: v for k, v in self.__dict__.items() if k not in ("_fd", "_pid")}

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int):
        start, end, line = (int(x) for x in self.spans[i])
        if getattr(self, "_fd", None) is None or self._pid != os.getpid():
            self._open()
        try:
            text = os.pread(self._fd, end - start, start)
        except OSError as exc:  # a filesystem error on this rank: not a verdict on the record
            raise OSError(exc.errno, f"reading line {line} of {self.path} failed: {exc.strerror or exc}") from None
        try:
            return json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise BadRecord(f"line {line} of {self.path} is not valid JSON ({exc})") from None
        except RecursionError:  # valid JSON nested deeper than Python's parser goes
            raise BadRecord(f"line {line} of {self.path}: JSON nested too deep to read") from None
