"""Where a step's time goes: spans of schedule actions, recorded without host syncs.

On a GPU a span is a pair of CUDA events on the current stream (recording an
event does not wait for anything); on CPU it is two `perf_counter` readings.
Durations are read only after the step's final `synchronize`, so recording
adds no sync to the hot path. Times are seconds since `reset()`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, List, NamedTuple, Tuple

import torch

from .device import Runtime


class Span(NamedTuple):
    module: str
    action: str      # F (forward) | B (backward) | comm (boundary communication)
    microbatch: int
    start_s: float   # since the step's origin
    dur_s: float


class StepTimer:
    def __init__(self, runtime: Runtime):
        self.cuda = runtime.is_cuda
        self.reset()

    def reset(self) -> None:
        """Start a new step: forget recorded spans, move the origin to now."""
        self._raw: List[Tuple[str, str, int, object, object]] = []
        self._origin = self.now()

    def now(self):
        """A point in time: a recorded CUDA event, or a perf_counter reading on CPU."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, module: str, action: str, microbatch: int, start, end) -> None:
        """Record a span between two `now()` points."""
        self._raw.append((module, action, microbatch, start, end))

    @contextmanager
    def span(self, module: str, action: str, microbatch: int):
        start = self.now()
        try:
            yield
        finally:
            self.add(module, action, microbatch, start, self.now())

    def _seconds(self, point) -> float:
        if self.cuda:
            return self._origin.elapsed_time(point) / 1e3
        return point - self._origin

    def spans(self) -> List[Span]:
        """The step's spans in seconds. Call after the step's device work is synchronised."""
        out = []
        for module, action, mb, a, b in self._raw:
            start = self._seconds(a)
            out.append(Span(module, action, mb, start, max(0.0, self._seconds(b) - start)))
        return out

    def totals(self) -> Dict[Tuple[str, str], float]:
        """Seconds per (module, action), summed over microbatches."""
        out: Dict[Tuple[str, str], float] = {}
        for s in self.spans():
            out[(s.module, s.action)] = out.get((s.module, s.action), 0.0) + s.dur_s
        return out
