"""megatron-core's checkpoint-writer helper process dies with its rank when mimo starts it.

A rank that saved once and is then SIGKILLed (what torchrun does to the surviving ranks of a failed
job, or the kernel to an out-of-memory rank) must not leave that helper behind. The control starts
the helper as megatron-core does on its own: it outlives the killed rank, so the check can fail.
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
print(*[p.pid for p in mp.active_children()], flush=True)
time.sleep(600)
"""


def _kill_rank_and_watch_helper(how: str, wait_s: float) -> bool:
    """Whether the helper is still alive `wait_s` seconds after its rank was SIGKILLed."""
    rank = subprocess.Popen([sys.executable, "-c", RANK, how], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        helpers = [int(x) for x in rank.stdout.readline().split()]
        assert len(helpers) == 1, helpers
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.time() + wait_s
        while process_alive(helpers[0]) and time.time() < deadline:
            time.sleep(0.1)
        return process_alive(helpers[0])
    finally:
        rank.kill()
        for pid in helpers if "helpers" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_helper_dies_with_a_killed_rank():
    assert not _kill_rank_and_watch_helper("mimo", wait_s=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_control_megatron_cores_own_helper_outlives_the_rank():
    assert _kill_rank_and_watch_helper("megatron", wait_s=3)
