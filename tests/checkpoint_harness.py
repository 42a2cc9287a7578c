"""Train a config on CPU ranks with checkpoints: the helpers the checkpoint tests share."""

import copy
import os
import signal
import subprocess
import sys
import time

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from tiny import TINY


def layout(**modules):
    """TINY with Adam and per-module parallelism (modules not named get the defaults)."""
    raw = copy.deepcopy(TINY)
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=4)
    raw["parallelism"] = {m: dict(modules.get(m, {})) for m in ("language", "images", "audio")}
    return raw


def with_ckpt(raw, save=None, load=None, **training):
    raw = copy.deepcopy(raw)
    raw["training"].update({k: v for k, v in dict(save=save, load=load, **training).items() if v is not None})
    return raw


def _train(raw, stop):
    """Resume (if `training.load`), train up to 0-based step `stop` (exclusive; None: train_iters)."""
    from mimo.checkpoint import checkpointer
    from mimo.training import Trainer
    from mimo.training.state import full_state

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    ckpt = checkpointer(cfg, trainer, None)
    start = ckpt.resume() if ckpt else 0
    losses = []
    for step in range(start, cfg.training.train_iters if stop is None else stop):
        losses.append(trainer.train_step(step).loss)
        if ckpt:
            ckpt.after_step(step)
    if ckpt:
        ckpt.finish()
    tp_groups = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    params = full_state(trainer.parts, tp_groups, layer_offsets=trainer.layer_offsets)
    return {"start": start, "losses": losses, "params": params}


def train(raw, stop=None, timeout_s=240):
    """{start, losses (resumed steps), params (whole model, merged over ranks)}."""
    results = run_on_ranks(_train, load_config(raw).world_size, raw, stop, timeout_s=timeout_s, daemon=False)
    out = {"start": results[0]["start"], "losses": results[0]["losses"], "params": {}}
    for r in results:
        assert r["losses"] == out["losses"]
        out["params"].update(r["params"])
    return out


def _resume_error(raw):
    """This rank's CheckpointError from resuming (None: the resume went through)."""
    from mimo.checkpoint import CheckpointError, checkpointer
    from mimo.training import Trainer

    cfg = load_config(raw)
    try:
        checkpointer(cfg, Trainer(cfg, select_runtime("cpu")), None).resume()
    except CheckpointError as exc:
        return str(exc)
    return None


def resume_errors(raw, timeout_s=240):
    """Each rank's error from resuming `training.load`, rank order."""
    return run_on_ranks(_resume_error, load_config(raw).world_size, raw, timeout_s=timeout_s, daemon=False)


def _gather_checksums_reads(ckpt):
    """The manifest entries from `gather_checksums` and the files this rank read for it."""
    import os

    from mimo.checkpoint import manifest

    read, crc32 = [], manifest.crc32
    manifest.crc32 = lambda path, *a: read.append(os.path.relpath(path, ckpt)) or crc32(path, *a)
    try:
        return manifest.gather_checksums(ckpt), read
    finally:
        manifest.crc32 = crc32


def gather_checksums_reads(ckpt, world_size):
    return run_on_ranks(_gather_checksums_reads, world_size, ckpt, timeout_s=120)


def _optimizer_request_sizes(raw, ckpt):
    """Elements this rank would load of the optimizer's tensor states: (requested, owned, slack, all)."""
    import math

    from megatron.core import dist_checkpointing

    from mimo.checkpoint.optimizer_state import optimizer_request
    from mimo.checkpoint.shards import param_shards
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    shards = param_shards(trainer)
    saved = dist_checkpointing.load_tensors_metadata(ckpt)
    request = optimizer_request(trainer, shards, saved)
    requested = sum(t.data.numel() for entry in request.values() for t in entry if t.data.numel() > 1)
    states = {k.rsplit(".", 1)[1] for k in saved if k.startswith("optimizer.")} - {"step"}
    owned = slack = everything = 0
    for module in trainer.optimizers:
        ranges = trainer.optim.owned_ranges(module)
        for p in trainer.params[module]:
            everything += p.numel() * len(states)
            if id(p) in ranges:
                a, b = ranges[id(p)] or (0, p.numel())
                owned += (b - a) * len(states)
                slack += 2 * math.prod(p.shape[1:]) * len(states)  # a partial row at each end
    return requested, owned, slack, everything


def optimizer_request_sizes(raw, ckpt):
    return run_on_ranks(_optimizer_request_sizes, load_config(raw).world_size, raw, ckpt, timeout_s=240)


class Payload:
    """Unpickled without restriction, this creates directory `marker` (a harmless stand-in for a
    shell command): what a checkpoint file that runs code looks like."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def poison(ckpt, rel, marker, plain_pickle=False):
    """Replace file `rel` of checkpoint directory `ckpt` by a Payload pickle and reseal the manifest,
    as anyone who can write the files can do; the file's path."""
    import os
    import pickle

    import torch

    from mimo.checkpoint.manifest import write_manifest

    path = os.path.join(ckpt, rel)
    if plain_pickle:  # like torch's own `.metadata`
        with open(path, "wb") as f:
            pickle.dump(Payload(marker), f)
    else:
        torch.save({"mimo": Payload(marker)}, path)
    write_manifest(ckpt)
    return path



def children(pid) -> list:
    """Process ids of `pid`'s children (none for None)."""
    if pid is None:
        return []
    return [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def command_line(pid: int) -> str:
    """Process `pid`'s command line ("" once it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited, it is only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_by_hand(args, world, logdir, env):
    """`world` ranks of the command `args` started as separate processes with no launcher (RANK etc. set
    as torchrun would), each rank's stdout and stderr in logdir/rankR.out: what a job looks like when
    nothing stops the other ranks if one exits."""
    from mimo.runtime.launch import free_port

    env = {**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    outs = [open(os.path.join(logdir, f"rank{r}.out"), "w+") for r in range(world)]
    procs = [subprocess.Popen(args, stdout=outs[r], stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    return procs, outs


def wait_all(procs, outs, timeout_s=240):
    """Every process's exit code and output; any still running after `timeout_s` is killed (none is
    left behind on a failure) and reports its signal."""
    deadline = time.time() + timeout_s
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            for pid in [p.pid, *_descendants(p.pid)]:  # a launcher's ranks (their own sessions) too
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    codes = [p.wait() for p in procs]
    text = []
    for out in outs:
        out.seek(0)
        text.append(out.read())
    return codes, text


def _descendants(pid):
    """The process ids below `pid` (Linux: read from /proc)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
