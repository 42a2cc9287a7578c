"""Save and resume a trainer: the two hooks a training loop calls (`resume` after build, `after_step`).

A save is collective (every rank writes its own shards through megatron-core
`dist_checkpointing`, replicas written once); every rank checksums a share of the
files, then rank 0 writes the manifest and publishes the checkpoint (see
mimo.checkpoint.paths). A resume checks the files (each rank the checksums of its
share) and the architecture on every rank and agrees on the outcome in a few small
collectives before the collective load (mimo.checkpoint.verdict), so a bad checkpoint stops every rank with the
same `error:` line instead of leaving some of them waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from mimo.runtime import checkpoint_scope, cuda_available

from .checks import META, check_resumable, resume_target, saved_value, shape_problems
from .manifest import gather_checksums, verify_share, write_manifest
from .optimizer_state import PREFIX, assign_optimizer, optimizer_request, optimizer_state
from .paths import CheckpointError, delete_pruned, discard_leftovers, partial_dir, prune, publish
from .rng import capture, read_rng, restore_rng, save_rng
from .safe_load import first_failure, load_sharded
from .shards import assign_weights, param_shards, weights_request, weights_state
from .verdict import FILE_PROBLEM, first_problem, held_by_none
from .writer_helper import install as install_writer_helper

FORMAT = 1


def layout_of(cfg) -> dict:
    """Per module: its parallel sizes and first rank (what `inspect` shows, what RNG restore compares)."""
    return {name: {k: getattr(p, k) for k in ("tp", "cp", "pp", "dp", "ep", "etp", "rank_offset")}
            for name, p in cfg.parallelism.items()}


class Checkpointer:
    def __init__(self, cfg, trainer, runtime):
        self.cfg, self.trainer, self.runtime = cfg, trainer, runtime
        self.rank = dist.get_rank()
        self.shards = param_shards(trainer)
        self.pending = None  # the queue of async saves (AsyncCallsQueue), see `_save`
        self.in_flight: Optional[int] = None  # the step of the save in flight, if any
        self.deleting: Optional[threading.Thread] = None  # rank 0: pruned checkpoints being deleted

    # -- resume ---------------------------------------------------------------------------------

    def resume(self) -> int:
        with checkpoint_scope(self.trainer.runtime):
            return self._resume()

    def _resume(self) -> int:
        """Load `training.load` if it holds a checkpoint; the step to continue from (0: fresh)."""
        tr = self.cfg.training
        ckpt = resume_target(self.cfg)
        if ckpt is None:
            return 0
        # The files first, each rank its own share (present, its size and CRC32), agreed on before any
        # of them is read: a damaged file is named by the rank that checks it, rather than met as
        # "unreadable" by every rank that reads it. Then the record and the index, which every rank
        # reads: the same verdict everywhere, unless the filesystem fails one rank.
        _agreed(ckpt, verify_share, ckpt, self.rank, dist.get_world_size())
        meta = _agreed(ckpt, check_resumable, self.cfg, ckpt)
        saved = dist_checkpointing.load_tensors_metadata(ckpt)  # `check_resumable` refused an unsafe index
        problems = shape_problems(self.shards, saved, self.cfg.modules)
        position_problem = getattr(self.trainer.dataset, "position_problem", None)
        if tr.load_optimizer and meta.get("data") is not None and position_problem is not None:
            found = position_problem(meta["data"])
            if found is not None:
                problems.insert(0, (FILE_PROBLEM, found))
        rng = None
        try:
            # Checkpoints written before `etp` existed lack it (it was 1).
            saved_layout = {n: {"etp": 1, **lay} for n, lay in meta["layout"].items()}
            same_layout = meta["world_size"] == dist.get_world_size() and saved_layout == layout_of(self.cfg)
            if tr.load_optimizer and same_layout:
                rng = read_rng(ckpt, self.rank)  # plain data only, read before anything is loaded
        except CheckpointError as exc:
            problems.insert(0, (FILE_PROBLEM, str(exc)))
        found = first_problem(problems)
        if found is None:
            extra = held_by_none(sorted(k for k in saved if not k.startswith(PREFIX)), (s.key for s in self.shards))
            if extra:
                found = ((0, 0, 0), f"{extra[0]}: in the checkpoint (shape {list(saved[extra[0]].global_shape)}) but "
                                    "not in this model; the checkpoint is of a different architecture")
        _stop_on(found, ckpt)
        before = saved_value(meta["config"], "training.precision")
        if self.rank == 0 and before not in (None, tr.precision):
            # Allowed (weights load at any precision), but the run does not continue exactly as saved.
            print(f"warning: training.precision: {ckpt} was saved by a {before} run and this run trains in "
                  f"{tr.precision}; it continues from the saved weights, not as the saved run would have "
                  f"(set training.precision: {before} to continue it)", file=sys.stderr, flush=True)

        request = {"weights": weights_request(self.shards)}
        if tr.load_optimizer:
            request["optimizer"] = optimizer_request(self.trainer, self.shards, saved)
        # No access-integrity check: it wants every element read exactly once by a main replica, but
        # distributed-optimizer ranks read only their pieces' rows (some rows by two ranks, the scalars
        # of a parameter only by its owners). Shapes were checked above.
        loaded = load_sharded(request, ckpt)
        assign_weights(self.shards, loaded["weights"])
        self.trainer.optim.reload_model_params()  # bf16: fp32 masters follow the loaded weights
        if not tr.load_optimizer:
            return 0
        assign_optimizer(self.trainer, self.shards, loaded["optimizer"], saved)
        if meta.get("lr_scheduler") is not None:
            self.trainer.optim.scheduler.load_state_dict(meta["lr_scheduler"])
        data_state = meta.get("data")
        if data_state is not None and hasattr(self.trainer.dataset, "load_state_dict"):
            self.trainer.dataset.load_state_dict(data_state)
        if rng is not None:
            restore_rng(rng)
        return int(meta["step"])

    # -- save -----------------------------------------------------------------------------------

    def after_step(self, step: int, stopping: bool = False) -> None:
        """Called after 0-based step `step` on every rank: save when the interval or the run ends, or
        when the run stops there (`stopping`, the same on every rank)."""
        tr = self.cfg.training
        done = step + 1
        if tr.save is None:
            return
        self.poll()
        if stopping or done == tr.train_iters or (tr.save_interval and done % tr.save_interval == 0):
            self.save(done)

    def save(self, steps_done: int) -> None:
        with checkpoint_scope(self.trainer.runtime):
            self._save(steps_done)

    def _save(self, steps_done: int) -> None:
        self.finish()  # at most one save in flight
        tr = self.cfg.training
        root, tmp = tr.save, partial_dir(tr.save, steps_done)
        if self.rank == 0:
            os.makedirs(root, exist_ok=True)
            discard_leftovers(root)  # saves that died: never published, safe to discard
            os.makedirs(tmp)
        dist.barrier()
        dataset = self.trainer.dataset
        meta = {"format": FORMAT, "step": steps_done, "config": dataclasses.asdict(self.cfg),
                "world_size": dist.get_world_size(), "layout": layout_of(self.cfg),
                # where the next step starts: the trainer may already have loaded it
                "data": dataset.state_dict(steps_done) if hasattr(dataset, "state_dict") else None,
                "lr_scheduler": self.trainer.optim.scheduler.state_dict()}
        state = {META: meta, "weights": weights_state(self.shards),
                 "optimizer": optimizer_state(self.trainer, self.shards)}
        rng = capture()  # now: an async save publishes after later steps have drawn numbers
        install_writer_helper()  # before megatron-core starts a helper that would outlive a killed rank
        self.in_flight = steps_done
        request = _host_staging(self._saving(dist_checkpointing.save, state, tmp, async_sharded_save=True))
        request.add_finalize_fn(lambda: self._publish(steps_done, rng))
        if tr.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            if self.pending is None:
                self.pending = AsyncCallsQueue()
            self.pending.schedule_async_request(request)
        else:
            self._saving(request.execute_sync)

    def _saving(self, part, *args, **kwargs):
        """`part(*args, **kwargs)`: a part of megatron-core's save of step `in_flight` (its plan, its
        end, which then publishes it). A file that could not be written (a full disk, say) fails the
        save on every rank alike (torch's planning and megatron-core's end share the verdict) with
        torch's CheckpointException, a BaseException that `except Exception` would let through as a
        traceback. It becomes one line; at the end only the coordinating rank 0 holds the ranks'
        reasons. The save was never published, so the checkpoints before it are untouched, and the
        next save discards its directory."""
        try:
            return part(*args, **kwargs)
        except CheckpointException as exc:
            step, self.in_flight = self.in_flight, None
            why = first_failure(exc) or "another rank's write failed (rank 0 names it)"
            where = partial_dir(self.cfg.training.save, step)
            raise CheckpointError(f"training.save: step {step} was not saved ({where}): {why}; the checkpoints "
                                  "saved before it are untouched") from exc

    def _publish(self, steps_done: int, rng: dict) -> None:
        """After every rank's shards are on disk (dist_checkpointing ends with a barrier)."""
        self.in_flight = None
        tr = self.cfg.training
        tmp = partial_dir(tr.save, steps_done)
        save_rng(tmp, self.rank, rng)
        dist.barrier()
        files = gather_checksums(tmp)
        pruned = []
        if self.rank == 0:
            write_manifest(tmp, files)
            publish(tr.save, steps_done)
            if tr.keep_last:
                pruned = prune(tr.save, tr.keep_last)  # renamed aside at once
        dist.barrier()
        if pruned:
            # Deleted off the step (a large checkpoint takes minutes), one deletion at a time.
            self._wait_deleting()
            self.deleting = threading.Thread(target=delete_pruned, args=(pruned,), name="mimo-prune", daemon=True)
            self.deleting.start()

    def _wait_deleting(self) -> None:
        if self.deleting is not None:
            self.deleting.join()
            self.deleting = None

    def poll(self) -> None:
        """Publish a finished async save (collective; call at the same point on every rank)."""
        if self.pending is not None:
            with checkpoint_scope(self.trainer.runtime):
                self._saving(self.pending.maybe_finalize_async_calls, False)

    def finish(self) -> None:
        """Wait for an async save in flight and publish it (collective), and for pruned checkpoints
        to be deleted."""
        if self.pending is not None:
            with checkpoint_scope(self.trainer.runtime):
                self._saving(self.pending.maybe_finalize_async_calls, True)
        self._wait_deleting()


def _file_line(ckpt: str, exc: BaseException) -> str:
    """A CheckpointError's line names its file; an OSError gets the checkpoint's directory."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{ckpt}: {exc}"


def _agreed(ckpt: str, read, *args):
    """`read(*args)` on this rank, then every rank stops with the first rank's file problem, if any
    rank had one. The collective is outside the try: every rank reaches it, whatever it read."""
    try:
        result, problems = read(*args), []
    except (CheckpointError, OSError) as exc:
        result, problems = None, [(FILE_PROBLEM, _file_line(ckpt, exc))]
    _stop_on(first_problem(problems))
    return result


def _stop_on(found, ckpt: str = "") -> None:
    """Raise the agreed first problem (the same on every rank), if any: a file's line as it is, a
    parameter's after the checkpoint's directory."""
    if found is not None:
        where, msg = found
        raise CheckpointError(msg if where == FILE_PROBLEM else f"{ckpt}: {msg}")


def _host_staging(request):
    """megatron-core stages tensors to host memory with a non-blocking copy followed by
    `torch.cuda.synchronize()`, which fails where there is no CUDA; tensors already on the
    host need a plain (blocking) copy instead."""
    fn = request.preload_fn
    if fn is None or cuda_available():
        return request
    return request._replace(preload_fn=functools.partial(fn.func, *fn.args[:-1], False))


def checkpointer(cfg, trainer, runtime) -> Optional[Checkpointer]:
    """A Checkpointer when the config saves or loads (None otherwise: nothing to do)."""
    tr = cfg.training
    return Checkpointer(cfg, trainer, runtime) if tr.save or tr.load else None
