"""The one global sample order of a run.

Every rank holds an identical sampler and draws the same records in the same
order; layouts only decide which slice of a step each rank trains on, so
encoders and the LLM can never train on different samples. The order of
epoch e is a permutation seeded by (seed, e) (or the file order without
shuffle), so the whole position is (epoch, index): small, exact to resume.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch


class GlobalSampler:
    def __init__(self, num_records: int, seed: int, shuffle: bool = True):
        if num_records < 1:
            raise ValueError("the dataset holds no record")
        self.num_records, self.seed, self.shuffle = num_records, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order: Sequence[int] = range(0)
        self._order_epoch = -1

    def order(self, epoch: int) -> Sequence[int]:
        """Record indices of `epoch`, in training order: an int64 array (8 bytes a record; a list of
        Python ints would take about 40 more), or a range without shuffling."""
        if epoch != self._order_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.num_records, generator=g).numpy()
            else:
                self._order = range(self.num_records)
            self._order_epoch = epoch
        return self._order

    def peek(self) -> int:
        """The next record index (not consumed)."""
        return int(self.order(self.epoch)[self.index])

    def advance(self) -> None:
        self.index += 1
        if self.index == self.num_records:
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": int(self.shuffle),
                "num_records": self.num_records}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key in ("seed", "shuffle", "num_records"):
            if int(state[key]) != int(getattr(self, key)):
                raise ValueError(f"data position was saved with {key}={state[key]}, "
                                 f"this run has {key}={getattr(self, key)}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
