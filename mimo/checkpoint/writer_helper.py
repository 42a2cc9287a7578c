"""The helper process behind megatron-core's checkpoint writer, tied to the life of its rank.

megatron-core's `FileSystemWriterAsync` collects its write results through a queue served by a
multiprocessing manager, a process it starts on a rank's first save and stops from an exit
handler. A rank that torchrun stops (SIGTERM, SIGKILL) or that ends with `os._exit` after a
failed collective never runs that handler: the manager lives on after the job, holding a few
hundred MB and the job's stdout (a launcher reading it through a pipe waits forever), one more
for every surviving rank at each torchrun restart.

`install()` starts that manager itself, asking Linux to kill it when its rank dies
(PR_SET_PDEATHSIG), and hands its queue to megatron-core, which then uses it for every save of the
process. Elsewhere than Linux it does nothing and megatron-core starts its own manager.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing.managers import SyncManager

from megatron.core.dist_checkpointing.strategies import filesystem_async

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_manager = []  # the started manager: kept so that it lives as long as this process


def _die_with(parent: int) -> None:
    """Runs first thing in the manager process."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above took effect
        os._exit(0)


def install() -> None:
    """Give megatron-core's writer a result queue whose process dies with this one (idempotent).

    Call from the thread that lives as long as the process (the main thread): Linux sends the
    signal when the thread that started the helper exits."""
    if _manager or not sys.platform.startswith("linux") or filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # spawn, as megatron-core's own: no forked CUDA state
    manager.start(_die_with, (os.getpid(),))
    _manager.append(manager)
    filesystem_async._results_queue = manager.Queue()

