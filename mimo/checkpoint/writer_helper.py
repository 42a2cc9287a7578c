"""The helper processes behind megatron-core's checkpoint writer, tied to the life of their rank.

megatron-core's `FileSystemWriterAsync` collects its write results through a queue served by a
multiprocessing manager, a process it starts on a rank's first save and stops from an exit
handler, and it writes the files in processes it forks at every save (one per bucket; with
`async_save` from one more forked process). A rank that torchrun stops (SIGTERM, SIGKILL) or that
ends with `os._exit` after a failed collective never runs that handler, and nothing stops a forked
writer: they live on after the job, holding memory and the job's stdout (a launcher reading it
through a pipe waits forever), one more set at every torchrun restart; a writer still running
could even write into the directory of the restarted job's next save of the same step.

`install()` starts that manager itself, asking Linux to kill it when its rank dies
(PR_SET_PDEATHSIG), and hands its queue to megatron-core, which then uses it for every save of the
process. It also asks the same for every process the rank's main thread forks from then on (the
writers, and their own forked writers in turn). Elsewhere than Linux it does nothing and
megatron-core starts its own manager.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.managers import SyncManager

from megatron.core.dist_checkpointing.strategies import filesystem_async

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_manager = []  # the started manager: kept so that it lives as long as this process
_libc = None  # loaded before any fork: a forked child only calls into it
_main_thread = None  # ident of the thread that called `install` (the process's main thread)
_forker = None  # pid of the process about to fork (set just before each fork)


def _die_with(parent: int, libc=None) -> None:
    """Ask for SIGKILL when `parent` dies; exit at once if it already has."""
    libc = libc or ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(0)


def _serve_for(parent: int) -> None:
    """The manager's start: it dies with `parent` (above) and with nothing else. A launcher signals
    a rank's whole process group (torchrun: `os.killpg`; Slurm at a time limit), and a rank that
    stops on that signal (`training.exit_signal_handler`) saves a last checkpoint through this
    manager, so the manager must outlive the signal; a spawned process would die of it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(parent)


def _before_fork() -> None:
    global _forker
    _forker = os.getpid()


def _after_fork_in_child() -> None:
    # Linux sends the signal when the forking *thread* exits, so only children of the thread that
    # lives as long as the process are tied (a worker thread's children would die with the thread).
    # The forking thread keeps its ident in the child, which makes its own forks tied in turn.
    if threading.get_ident() == _main_thread:
        _die_with(_forker, _libc)


def _tie_forks() -> None:
    """From now on, every process this thread forks dies with this process (idempotent)."""
    global _libc, _main_thread
    if _main_thread is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _main_thread = threading.get_ident()
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def install() -> None:
    """Tie megatron-core's writer helpers to this process's life (idempotent).

    Call from the thread that lives as long as the process (the main thread): Linux sends the
    signal when the thread that started the helper exits."""
    if not sys.platform.startswith("linux"):
        return
    _tie_forks()
    if _manager or filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # spawn, as megatron-core's own: no forked CUDA state
    manager.start(_serve_for, (os.getpid(),))
    _manager.append(manager)
    filesystem_async._results_queue = manager.Queue()
