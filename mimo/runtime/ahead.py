"""The next step's data, prepared on a background thread while the current step runs.

The trainer's step loads its data (plans the step from the records, decodes
its items, collates its microbatches, moves them to the device) and then runs
the step plan. `NextStep` starts loading step k + 1 as soon as step k's plan
starts running, so host work overlaps the device (and, on CPU ranks, the
collectives' waits). On CUDA the thread issues its host-to-device copies on a
side stream, and the step that takes the data makes the compute stream wait
for that stream first.

The loader must not share mutable state with the main thread while a step
runs; the trainer touches its dataset only before a step runs and after
`settle` returns.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Callable, Generic, Optional, Tuple, TypeVar

import torch

from .device import Runtime

T = TypeVar("T")


class NextStep(Generic[T]):
    def __init__(self, runtime: Runtime, load: Callable[[int], T]):
        self.runtime, self.load = runtime, load
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mimo-next-step")
        self.stream = torch.cuda.Stream(runtime.device) if runtime.is_cuda else None
        self.pending: Optional[Tuple[int, Future]] = None

    def _load(self, step: int) -> T:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            return self.load(step)

    def start(self, step: int) -> None:
        """Begin loading `step` in the background (one step at a time)."""
        self.settle()
        self.pending = (step, self.pool.submit(self._load, step))

    def settle(self) -> None:
        """Wait until no load runs (its result or error stays for `take`)."""
        if self.pending is not None:
            wait([self.pending[1]])

    def take(self, step: int) -> T:
        """`step`'s data: the background load's if it loaded this step (its error, if it failed, is raised
        here, at the step it belongs to), else loaded now."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == step:
            data = pending[1].result()
        else:
            if pending is not None:
                wait([pending[1]])  # a load of another step (a run that jumped): discarded
            data = self.load(step)
        if self.stream is not None:
            torch.cuda.current_stream(self.runtime.device).wait_stream(self.stream)
        return data

    def close(self) -> None:
        """The run is over: wait for a load still running, drop its result and end the thread."""
        self.settle()
        self.pending = None
        self.pool.shutdown(wait=True)
