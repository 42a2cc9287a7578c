"""Per-sample size records: ``{"id": str, "text_tokens": int, "image_tokens": int}`` per JSONL line."""

from __future__ import annotations

import json
from typing import List, Tuple

import numpy as np

FIELDS = ("text_tokens", "image_tokens")


def read_records(path: str) -> Tuple[List[str], np.ndarray, np.ndarray]:
    """(ids, text tokens, image tokens) in file order; ValueError naming the file, line and record."""
    ids, text, image = [], [], []
    try:
        fh = open(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise ValueError(f"{where}: expected an object with a string \"id\"")
            for key in FIELDS:
                v = rec.get(key)
                if key not in rec:
                    raise ValueError(f"{where}: record {rec['id']!r} has no {key!r} (every record needs "
                                     f"its size: {', '.join(FIELDS)})")
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{where}: record {rec['id']!r}: {key} must be a non-negative integer, "
                                     f"got {v!r}")
            ids.append(rec["id"])
            text.append(rec["text_tokens"])
            image.append(rec["image_tokens"])
    return ids, np.array(text, dtype=np.int64), np.array(image, dtype=np.int64)
