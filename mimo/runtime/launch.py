"""Run a function on N local CPU ranks (gloo): the multi-rank harness for tests and tools.

Each rank is a fresh process (forked from a fork server that has the heavy
imports done) with RANK/WORLD_SIZE set as torchrun would.
Results come back in rank order; if any rank raises, every rank is stopped
and the first failure is re-raised with its rank and traceback, so a broken
rank never leaves the others waiting on a collective.
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import socket
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


_FIRST_PORT = 20000  # above the ports services usually take


def _ephemeral_low() -> int:
    """The first port Linux hands out to bind(0) and outgoing connections (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that was free just now, for rank 0's rendezvous store.

    Taken at random below the ephemeral range: a port bind(0) returned would be the kernel's to give
    to any outgoing connection (gloo opens many) between this check and rank 0's listen, which made
    a rank fail with EADDRINUSE once in a full test-suite run. Below that range only
    another caller picking the same port at random in the same moment can take it."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low > _FIRST_PORT + 1000 else 0):
        port = rng.randrange(_FIRST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, timeout_minutes, environ):
    # The fork server's environment is the one it started with; a rank must see the
    # caller's environment as of this call (e.g. TRITON_INTERPRET set by a test).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Keep each rank single-threaded: N ranks share the machine's cores.
    import torch

    torch.set_num_threads(1)
    from .device import select_runtime
    from .distributed import init_distributed, setup_megatron, shutdown

    try:
        runtime = select_runtime("cpu")
        init_distributed(runtime, timeout_minutes)
        setup_megatron(runtime, seed=0)
        out = fn(*args)
        # Plain pickle bytes: torch's queue pickler would share tensor storage through
        # file descriptors that vanish when this process exits before the parent reads.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # report everything, including assertion failures
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            shutdown()
        except Exception:
            pass


# What every rank imports anyway. The fork server imports it once; each rank is then a fork
# of that clean, single-threaded process instead of a fresh interpreter importing torch and
# megatron-core again (seconds per rank on a small machine). CPU ranks only: nothing imported
# here may initialise CUDA, which a forked process could not use, or start a thread.
# Named as strings, so this layer imports none of them itself. The Hugging Face modules are the
# ones a training rank's config check and data reach through transformers' lazy top-level names:
# resolving those names took a rank about 1.5 s of its 3 s here; with them preloaded a rank that
# builds a llava Trainer starts in about 0.3 s instead of 1.5 s (2-core VM).
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "mimo.runtime.distributed", "mimo.training",
            "transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto",
            "transformers.models.auto.image_processing_auto", "transformers.tokenization_utils_fast",
            "PIL.Image"]


_server_interpret = []  # TRITON_INTERPRET as the fork server started with it (set once)


def _context():
    # Triton decides at import whether its own jit helpers are interpreted, and the fork server
    # imports Triton (through megatron-core) once: a rank that must interpret Triton kernels while
    # the server started without TRITON_INTERPRET (or the other way round) is spawned fresh instead.
    interpret = os.environ.get("TRITON_INTERPRET", "")
    if not _server_interpret:
        _server_interpret.append(interpret)
    if _server_interpret[0] != interpret:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_on_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 300.0, daemon: bool = True) -> List[Any]:
    """Call `fn(*args)` on `world_size` gloo ranks; return each rank's result, rank order.

    `fn` must be importable (module-level) so spawned processes can find it.
    `daemon=False` lets ranks start processes of their own (megatron-core's checkpoint
    writers do); every rank is still stopped here on failure.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout_s / 60.0, environ),
                         daemon=daemon) for r in range(world_size)]
    for p in procs:
        p.start()
    out, failure = {}, None
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                failure = f"timed out after {timeout_s:.0f}s waiting for ranks {sorted(set(range(world_size)) - set(out))}" + (
                    f" (ranks {dead} exited without reporting)" if dead else "")
                break
            if status == "error":
                failure = f"rank {rank} failed: {value}"
                break
            out[rank] = pickle.loads(value)
    finally:
        if failure:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failure:
        raise RankFailed(failure)
    return [out[r] for r in range(world_size)]
