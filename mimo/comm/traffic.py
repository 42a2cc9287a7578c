"""Per-edge traffic counters: bytes this rank sends, by direction, scope and kind.

Conventions (bytes a rank puts on the wire, so summing over ranks gives the
edge's total):

* point-to-point: the sender counts the message size;
* broadcast: the root counts size x (group size - 1), one copy per receiver;
* reduce: each non-root member counts its tensor size;
* all-reduce: each member counts 2 x (n - 1) / n x size (a ring all-reduce).

``scope`` is ``cross`` when sender and receiver belong to different module
rank ranges (only leaders of a non-colocated edge), ``intra`` otherwise.
``kind`` is ``payload`` (activations / gradients, in the wire dtype) or
``meta`` (per-sample token counts, int64).
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, Tuple

Key = Tuple[str, str, str]  # (direction, scope, kind)


class Traffic:
    def __init__(self):
        self.bytes: Counter = Counter()
        self.messages: Counter = Counter()

    def add(self, direction: str, scope: str, kind: str, nbytes: int, messages: int = 1) -> None:
        key = (direction, scope, kind)
        self.bytes[key] += int(nbytes)
        self.messages[key] += messages

    def reset(self) -> None:
        self.bytes.clear()
        self.messages.clear()

    def total(self, direction: str = None, scope: str = None, kind: str = None) -> int:
        return sum(v for (d, s, k), v in self.bytes.items()
                   if (direction is None or d == direction) and (scope is None or s == scope)
                   and (kind is None or k == kind))

    def __repr__(self) -> str:
        return f"Traffic({dict(self.bytes)})"
