"""megatron-core's checkpoint-writer helper processes die with their rank when mimo ties them.

A rank that saved once and is then SIGKILLed (what torchrun does to the surviving ranks of a failed
job, or the kernel to an out-of-memory rank) must not leave behind the writer's queue manager, nor
a writer it forked (which could still be writing files). The controls start them as megatron-core
does on its own: they outlive the killed rank, so the checks can fail.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from checkpoint_harness import process_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The rank: start the helper (mimo's way or megatron-core's), print its pid, wait to be killed.
RANK = """
import multiprocessing as mp, sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1] == "mimo":
    from mimo.checkpoint.writer_helper import install
    install()
queue = filesystem_async._get_write_results_queue()  # what megatron-core's writer calls on a save
queue.put("written")
assert queue.get() == "written"
helper, = mp.active_children()  # the queue's manager, and nothing else
print(helper.pid, flush=True)
time.sleep(600)
"""

# The rank forks a writer the way megatron-core does (a "fork" multiprocessing context, from the
# main thread), after mimo's `install` or without it, and one more from a short-lived thread.
FORKING_RANK = """
import multiprocessing as mp, sys, threading, time
if sys.argv[1] == "mimo":
    from mimo.checkpoint.writer_helper import install
    install()
ctx = mp.get_context("fork")
writer = ctx.Process(target=time.sleep, args=(600,))
writer.start()
# Forked from a thread that then ends: it must not be killed with the thread (Linux signals a
# child when the *thread* that forked it exits), only, like any process, left to run.
from_thread = []
t = threading.Thread(target=lambda: (from_thread.append(ctx.Process(target=time.sleep, args=(600,))),
                                     from_thread[0].start(), time.sleep(0.5)))  # ends once the child runs
t.start(); t.join()
time.sleep(1)
print(writer.pid, from_thread[0].pid, "|", "thread's child", "alive" if from_thread[0].is_alive() else "dead",
      flush=True)
time.sleep(600)
"""


def _kill_rank(script: str, how: str, wait_s: float):
    """Run `script` as a rank, read the line it prints (pids, then `|` and a note), SIGKILL the rank:
    whether the first pid still runs `wait_s` seconds later, and the note."""
    rank = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    pids = []
    try:
        printed, _, note = rank.stdout.readline().partition("|")
        pids = [int(x) for x in printed.split()]
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.time() + wait_s
        while process_alive(pids[0]) and time.time() < deadline:
            time.sleep(0.1)
        # Not reading on: a surviving helper holds the rank's stdout open.
        return process_alive(pids[0]), note.strip()
    finally:
        rank.kill()
        for pid in pids:  # leave no orphans
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_helper_dies_with_a_killed_rank():
    assert not _kill_rank(RANK, "mimo", wait_s=20)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_control_megatron_cores_own_helper_outlives_the_rank():
    assert _kill_rank(RANK, "megatron", wait_s=3)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_writer_dies_with_a_killed_rank_and_a_threads_child_outlives_its_thread():
    writer_alive, printed = _kill_rank(FORKING_RANK, "mimo", wait_s=20)
    assert not writer_alive
    assert printed.strip() == "thread's child alive"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_control_a_writer_forked_without_mimo_outlives_the_rank():
    assert _kill_rank(FORKING_RANK, "megatron", wait_s=3)[0]
