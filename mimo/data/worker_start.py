"""How a data loader's worker processes start when the run stops cleanly on a signal.

With `training.exit_signal_handler` a launcher signals a rank's whole process group (torchrun:
`os.killpg`; Slurm: every process of the step), its loader workers included. A worker that dies of
it fails the rank's last step and its save (torch raises in the rank when a worker is killed), so
the workers ignore that signal. They still end with their rank: the trainer ends them when its loop
is over (`Trainer.close`), and torch's workers watch their parent should it die. Python's own exit
would not do: it stops leftover workers with SIGTERM and waits for them.
"""

from __future__ import annotations

import functools
import signal
from typing import Callable, Optional


def stop_signal(training) -> Optional[int]:
    """The signal the run stops on, or None when `training.exit_signal_handler` is off."""
    return getattr(signal, training.exit_signal) if training.exit_signal_handler else None


def worker_start(signum: Optional[int], first: Optional[Callable[[int], None]] = None):
    """A `worker_init_fn` that runs `first` (the loader's own start, if any), then ignores `signum`.
    Without a stop signal it is `first` itself."""
    if signum is None:
        return first
    return functools.partial(_start, first, signum)


def _start(first, signum: int, worker_id: int) -> None:
    if first is not None:
        first(worker_id)
    signal.signal(signum, signal.SIG_IGN)
