"""Stopping a run cleanly before its allocation ends (`training.exit_signal_handler`,
`training.exit_duration_minutes`).

A batch system ends a job at its time limit, and a preempting one at any time, with a signal and,
a little later, a kill: the steps since the last checkpoint are lost. With the handler on, the
signal only sets a flag on the rank that received it (a signal handler must not run collectives
or touch the device), and a deadline flags itself once its minutes have passed. The flag then
travels in the step's existing loss all-reduce (`RankStep`, one more slot of the same world sum),
so every rank learns in the same step that some rank asked to stop, whichever rank that was, and
no rank waits for another: the trainer saves a checkpoint after that step and the run exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Optional


class StopRequest:
    """This rank's wish to stop after the current step: a signal received, or the deadline passed."""

    def __init__(self, tr):
        self.received: Optional[str] = None
        self.deadline = (time.monotonic() + 60.0 * tr.exit_duration_minutes
                         if tr.exit_duration_minutes is not None else None)
        self._signal, self._previous = None, None
        # Python runs signal handlers on the main thread only, and only it may install them.
        if tr.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self._signal = getattr(signal, tr.exit_signal)
            self._previous = signal.signal(self._signal, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received is not None:  # a second one: whoever sends it wants the process gone now
            self.close()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name

    def close(self) -> None:
        """The signal's previous handler back (the training loop is over: nothing waits for the flag)."""
        if self._signal is not None:
            signal.signal(self._signal, self._previous if self._previous is not None else signal.SIG_DFL)
            self._signal = None

    def requested(self) -> bool:
        return self.received is not None or (self.deadline is not None and time.monotonic() >= self.deadline)

    def reason(self) -> str:
        """Why this run stops, for its last line (every rank knows only that some rank asked)."""
        if self.received is not None:
            return f"received {self.received}"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "training.exit_duration_minutes passed"
        return "another rank received its exit signal or passed its deadline"
