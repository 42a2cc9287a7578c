"""Whether a checkpoint fits this run: read before any collective, reported as one `error:` line.

* `preflight` (every rank, before process groups exist): `latest`, the directory,
  the manifest, the sizes of this rank's share of the files (and of the two files
  every rank reads), and the config fields whose change would make the saved
  state meaningless;
* `shape_problems` (after the model is built, still before the load): every
  parameter a rank holds is in the checkpoint with its full shape.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Dict, List, Optional, Tuple

from mimo.config.outputs import first_existing, output_problem

from .manifest import verify_read_by_all, verify_share
from .paths import CheckpointError, complete_steps, iter_dir, read_latest, resolve
from .safe_load import DCP_METADATA, check_dcp_metadata, load_torch_file

COMMON = "common.pt"
META = "mimo"  # the common-state entry holding step, config, layout, data position
META_FIELDS = ("step", "config", "world_size", "layout")  # what every reader of the record takes from it


def read_meta(ckpt: str) -> dict:
    """The checkpoint's own record (step, config, layout, data position), from its common state."""
    path = os.path.join(ckpt, COMMON)
    common = load_torch_file(path)  # plain data only: never runs code from the file
    if not isinstance(common, dict) or not isinstance(common.get(META), dict):
        raise CheckpointError(f"{path}: not a mimo checkpoint's common state (no {META!r} record)")
    meta = common[META]
    missing = [k for k in META_FIELDS if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: its {META!r} record lacks {', '.join(missing)} (damaged, or not written by mimo)")
    return meta


def read_checked(ckpt: str) -> dict:
    """`read_meta`, after refusing a distributed-checkpoint index that would run code when
    megatron-core reads it: what every reader of a checkpoint calls first."""
    meta = read_meta(ckpt)
    check_dcp_metadata(ckpt)
    _check_format_record(ckpt)
    return meta


def _check_format_record(ckpt: str) -> None:
    """megatron-core's `metadata.json` (its format and version) as megatron-core reads it, so that a
    damaged one is named here rather than met as a bare JSON error by every rank in the load."""
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME, maybe_load_config

    try:
        found = maybe_load_config(ckpt)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FNAME)}: unreadable ({type(exc).__name__}: {exc})") from None
    if found is None:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FNAME)}: missing (not a distributed checkpoint)")


def saved_value(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def config_problems(saved_cfg: dict, cfg, load_optimizer: bool) -> List[str]:
    """Config fields that changed in a way the saved state cannot follow (`path: reason`)."""
    if not load_optimizer:  # weights only: the step, data position and optimizer restart
        return []
    import dataclasses

    now = dataclasses.asdict(cfg)
    fields = ["training.optimizer", "data.kind"]
    if cfg.data.kind != "mock":  # a real-data position is only valid for the same records in the same order
        fields += ["data.path", "data.seed", "data.shuffle"]
    if cfg.data.kind == "energon":  # energon's order depends on its number of loader workers
        fields.append("data.num_workers")
    out = []
    for f in fields:
        before, after = saved_value(saved_cfg, f), saved_value(now, f)
        if before != after:
            out.append(f"{f}: the checkpoint was saved with {before!r}, this run has {after!r} (resuming needs the "
                       "same; training.load_optimizer: false loads the weights only)")
    return out


def check_save_dir(save: str) -> None:
    """`training.save` can hold checkpoints: a writable directory, or one that can be made (found now,
    not at the first save, `save_interval` steps into the run)."""
    problem = output_problem(save, "directory")
    if problem:
        raise CheckpointError(f"training.save: {problem}")
    existing = first_existing(save)
    # A file made and removed at once, rather than os.access: that says yes to root everywhere (even
    # under /proc) and cannot see every filesystem's refusal.
    try:
        fd, probe = tempfile.mkstemp(prefix=".mimo-write-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"training.save: {save} cannot be written (making a file in {existing}: "
                              f"{exc.strerror or exc})") from None


def resume_target(cfg) -> Optional[str]:
    """The checkpoint directory this run resumes from, None to start fresh (reads only `latest`);
    raises CheckpointError. Checks `training.save` too, found now rather than at the first save."""
    tr = cfg.training
    if tr.save is not None:
        check_save_dir(tr.save)
    if tr.load is None:
        return None
    root = tr.load
    same = tr.save is not None and os.path.abspath(tr.save) == os.path.abspath(root)
    if read_latest(root) is None and not os.path.basename(os.path.normpath(root)).startswith("iter_"):
        if os.path.isfile(root):
            raise CheckpointError(f"training.load: {root} is a file; name the directory a run saved to "
                                  "(its training.save) or one of its iter_NNNNNNN directories")
        steps = complete_steps(root)
        if steps:  # a save renamed into place, then the run died before `latest` named it
            newest = iter_dir(root, steps[-1])
            raise CheckpointError(f"training.load: {root} holds no `latest` file, only step directories (newest "
                                  f"{os.path.basename(newest)}): its run ended before naming one; check it with "
                                  f"`python -m mimo.checkpoint inspect {newest}` and resume it with training.load: "
                                  f"{newest}")
        if same:
            return None  # auto-resume: nothing saved yet
        if not os.path.exists(root):
            raise CheckpointError(f"training.load: {root}: no such directory")
        raise CheckpointError(f"training.load: {root} holds no checkpoint (no {os.path.join(root, 'latest')})")
    return resolve(root)


def check_resumable(cfg, ckpt: str) -> dict:
    """The checkpoint's record (`read_checked`), after checking that this config can resume it."""
    meta = read_checked(ckpt)
    problems = config_problems(meta["config"], cfg, cfg.training.load_optimizer)
    if problems:
        raise CheckpointError(problems[0])
    return meta


def preflight(cfg, every_file: bool = True) -> Optional[str]:
    """Before any process group exists: the checkpoint directory this run resumes from, None to
    start fresh; raises CheckpointError, which every rank of a job finds alike.

    `every_file`: also the presence and size of every file of the checkpoint (one process: `--check`,
    an export). A rank of a job checks only the files every rank reads next (`common.pt`,
    `.metadata`); the others it checks as its share once the process groups exist, agreed with the
    other ranks (`Checkpointer._resume`): a short file found by one rank here would stop that rank
    alone and leave the others waiting for it, unless the launcher stopped them."""
    ckpt = resume_target(cfg)
    if ckpt is not None:
        verify_read_by_all(ckpt, (COMMON, DCP_METADATA))
        if every_file:
            verify_share(ckpt, 0, 1, checksums=False)
        check_resumable(cfg, ckpt)
    return ckpt


def shape_problems(shards, saved: Dict, modules: List[str]) -> List[Tuple[Tuple[int, int, int], str]]:
    """(order, message) for each parameter of this rank missing from `saved` or of another shape.

    `order` sorts the problems of all ranks the way the model reads: module (config order),
    global layer, then parameter, so every rank reports the same first one."""
    out = []
    for i, s in enumerate(shards):
        layer = re.search(r"\.layers\.(\d+)\.", s.key)
        order = (modules.index(s.module), int(layer.group(1)) if layer else -1, i)
        meta = saved.get(s.key)
        if meta is None:
            out.append((order, f"{s.key}: not in the checkpoint (this model: shape {list(s.full_shape)}); "
                               "the checkpoint is of a different architecture"))
        elif tuple(meta.global_shape) != s.full_shape:
            out.append((order, f"{s.key}: the checkpoint has shape {list(meta.global_shape)}, this model "
                               f"{list(s.full_shape)}"))
    return out
