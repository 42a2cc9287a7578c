"""Reading a checkpoint's pickled files without running code from them.

A checkpoint holds three kinds of pickle: `common.pt` (mimo's record: step,
config, layout, data position, LR schedule), `rng/rank_NNNNN.pt` (each rank's
generator states) and torch's distributed-checkpoint index `.metadata`.
Unpickling may call any importable function a file names, so a checkpoint
that came from elsewhere could run a command while being loaded. Every such
file is read here first, by an unpickler that builds only plain data:

* `.pt` files through torch's `weights_only` loader (containers, numbers,
  strings, bytes, tensors), plus numpy's array, which RNG files written
  before numpy's key was stored as a tensor hold (energon's data position
  is stored as plain containers too, `mimo.data.energon.plain_state`);
* `.metadata` (a plain pickle that torch's reader would load unrestricted)
  by a `pickle.Unpickler` that resolves only the dataclasses and enums of
  torch's checkpoint metadata, `torch.Size` and dtypes.

A file naming anything else is refused with one line naming the file and
what it holds, before any of it is used.

The tensors' files (`*.distcp`) are read by megatron-core through torch's
distributed checkpoint reader, which loads them `weights_only` too
(`load_sharded`, which also turns a failed read into one line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import os
import pickle
import re
from typing import List

import torch

from .paths import CheckpointError

DCP_METADATA = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_DCP_FUNCTIONS = {("torch", "Size"), ("torch.serialization", "_get_layout")}


def refused(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: holds objects a checkpoint may not hold ({what}); mimo reads checkpoints "
                           "without running code from them")


# -- torch files (common.pt, RNG files) --------------------------------------------------------

def _numpy_array_globals() -> List:
    """What an ndarray pickles as: its reconstructor, the array type and its dtypes (data only)."""
    import numpy as np

    out = [np.ndarray, np.dtype, np._core.multiarray._reconstruct]
    out += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return out


@contextlib.contextmanager
def allowed_globals(path: str):
    """torch's `weights_only` loader, inside this context, also accepts numpy arrays where `path` holds
    them (RNG files written before numpy's key was stored as a tensor)."""
    extra = []
    if os.path.exists(path):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        if any(n.startswith("numpy.") for n in names):
            extra += _numpy_array_globals()
    with torch.serialization.safe_globals(extra):
        yield


def load_torch_file(path: str):
    """A checkpoint's `.pt` file as plain data; CheckpointError for a missing, damaged or refused file."""
    try:
        with allowed_globals(path):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        if "Weights only load failed" in str(exc):
            raise refused(path, found.group(1) if found else "not plain data") from None
        raise CheckpointError(f"{path}: unreadable ({_why(exc)})") from None
    except Exception as exc:  # any other failure to parse means the same thing: the file is damaged
        raise CheckpointError(f"{path}: unreadable ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    """An exception as a short reason: its type and the first sentence of its message."""
    first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# -- torch's distributed-checkpoint index ------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what torch's checkpoint index is made of; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_FUNCTIONS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            # Defined there (not a name those modules import, like `enum.Enum` itself), and data only.
            if (isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint.")
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                return obj
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def check_dcp_metadata(ckpt: str) -> None:
    """Refuse a `.metadata` index that names anything but torch's metadata types (torch's own reader,
    which megatron-core calls next, unpickles it without restriction)."""
    path = os.path.join(ckpt, DCP_METADATA)
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except pickle.UnpicklingError as exc:
        found = re.match(r"GLOBAL (\S+)", str(exc))
        if found:
            raise refused(path, found.group(1)) from None
        raise CheckpointError(f"{path}: unreadable ({_why(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable ({_why(exc)})") from None


def first_failure(exc) -> str | None:
    """'rank R: Type: message' of the lowest rank in torch's CheckpointException, which maps each failed
    rank to its exception (None when this rank was told of a failure without its details)."""
    if not exc.failures:
        return None
    rank, (cause, _) = min(exc.failures.items())
    return f"rank {rank}: {type(cause).__name__}: {cause}" if str(cause) else f"rank {rank}: {type(cause).__name__}"


def load_sharded(request, ckpt: str):
    """megatron-core's `dist_checkpointing.load` of `request` from `ckpt`, without its access-integrity
    check (why: `Checkpointer._resume`).

    A read that fails inside torch's checkpoint reader (a `.distcp` file cut short, say) raises its
    `CheckpointException` on every rank alike, since torch gathers the ranks' read results: it holds
    each failed rank's exception and traceback and is a BaseException, which a caller's `except
    Exception` would let through as a traceback. It becomes one line here. The caller checked every
    file's size (and CRC32) against the manifest first, so a damaged file was damaged before its
    manifest was written, or the manifest was rewritten since; other causes (a read error of the
    filesystem, memory) are named by the reader's own exception."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(request, ckpt, validate_access_integrity=False)
    except CheckpointException as exc:
        reason = first_failure(exc) or "another rank's read failed"
        raise CheckpointError(f"{ckpt}: cannot read the checkpoint's tensors: {reason} (the files match the "
                              "manifest's sizes and checksums: if one is damaged, the damage predates the "
                              "manifest or the manifest was rewritten since)") from exc  # MIMO_DEBUG=1: tracebacks
