"""A dataset prepared with megatron-energon (`energon prepare`) as the global record stream.

Every rank opens energon's savable loader as rank 0 of a data-parallel world of one, with the
same worker config and seed, so every rank reads the same samples in the same order: the global
order that each module's DP ranks then slice (as for `kind: llava`). Energon decodes nothing
here (the task encoder's decoder is off): images stay bytes until a rank whose encoder consumes
them decodes them. Captioning and VQA samples become one-turn LLaVA records.

For planning without tokenising every record on every rank, `share(rank, world)` reads one rank's
part of the dataset once (energon's own split over ranks, in its validation mode: each sample once,
no shuffling); the ranks learn its records' numbers and gather them into a record index keyed by
sample key (`LlavaDataset.build_index`).

The position is energon's own loader state at a point where no sample was read ahead, plus the
number of records consumed since (replayed on restore, without decoding anything). Energon's state
is a tree of its dataclasses; a checkpoint stores it as plain containers (`plain_state`), which
load without unpickling any class, and rebuilds only energon's own dataclasses from it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import re
import sys
import warnings
from typing import Dict, Iterator, Optional

from .llava import DataError
from .worker_start import worker_start

REFRESH_EVERY = 1000  # records between two energon states (a resume replays at most this many)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def to_record(sample) -> dict:
    """An energon CaptioningSample / VQASample -> a LLaVA-format record (image as bytes)."""
    kind = type(sample).__name__
    key = getattr(sample, "__key__", "?")
    if kind == "CaptioningSample":
        human, answer = "<image>", _text(sample.caption)
    elif kind == "VQASample":
        answers = sample.answers
        if isinstance(answers, bytes):
            try:
                answers = json.loads(answers.decode("utf-8"))
            except ValueError:
                answers = answers.decode("utf-8")
        answer = _text(answers[0] if isinstance(answers, (list, tuple)) and answers else answers or "")
        human = "<image>\n" + _text(sample.context)
    else:
        raise DataError(f"error: data.path: energon sample type {kind} is not supported (CaptioningSample, VQASample)")
    return {"id": str(key), "source": sample_key(sample), "image": sample.image,
            "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]}


def sample_key(sample) -> str:
    """What names a sample in its dataset: the dataset and shard it comes from, and its key (a
    WebDataset key is unique only within its tar)."""
    sources = getattr(sample, "__sources__", None) or ()
    where = [f"{s.dataset_path}:{s.shard_name}" for s in sources[:1]]
    return "\0".join(where + [str(getattr(sample, "__key__", "?"))])


_DATACLASS, _FLEX = "__energon_dataclass__", "__energon_flex_state__"


def plain_state(obj):
    """Energon's state as dicts, lists, tuples and scalars: each dataclass as {_DATACLASS: its
    import path, "fields": ...}, energon's dict subclass `FlexState` as {_FLEX: its items}."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {_DATACLASS: f"{cls.__module__}.{cls.__qualname__}",
                "fields": {f.name: plain_state(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        items = {k: plain_state(v) for k, v in obj.items()}
        return {_FLEX: items} if type(obj) is not dict else items
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_state(v) for v in obj)
    return obj


def energon_state(plain):
    """The inverse of `plain_state`; only dataclasses defined in megatron.energon are rebuilt."""
    if isinstance(plain, dict) and _DATACLASS in plain:
        module, _, name = plain[_DATACLASS].rpartition(".")
        cls = getattr(importlib.import_module(module), name, None) if module.startswith("megatron.energon.") else None
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise DataError(f"error: data position: {plain[_DATACLASS]!r} is not an energon state class")
        obj = cls.__new__(cls)
        for k, v in plain["fields"].items():
            object.__setattr__(obj, k, energon_state(v))
        return obj
    if isinstance(plain, dict) and _FLEX in plain:
        from megatron.energon.state import FlexState

        return FlexState({k: energon_state(v) for k, v in plain[_FLEX].items()})
    if isinstance(plain, dict):
        return {k: energon_state(v) for k, v in plain.items()}
    if isinstance(plain, (list, tuple)):
        return type(plain)(energon_state(v) for v in plain)
    return plain


def _failed_name(sample, sources) -> str:
    """The shard and key of a sample energon could not load, for its message."""
    parts = getattr(sample, "data", None)  # a raw sample: its parts as read from the tar
    if isinstance(parts, (tuple, list)) and parts and isinstance(parts[0], dict):
        sample = parts[0]
    if sources is None and isinstance(sample, dict):
        sources = sample.get("__sources__")
    src = sources[0] if sources else None
    key = sample.get("__key__") if isinstance(sample, dict) else getattr(sample, "__key__", None)
    if key is None and src is not None and getattr(src, "file_names", None):
        key = str(src.file_names[0]).rsplit(".", 1)[0]
    shard = getattr(src, "shard_name", None)
    return f"{shard}/{key}" if shard else str(key)


_warned: set = set()  # samples energon could not load, already named by this process


def _sample_failed(on_bad: str, exc: Exception, sample, sources=None) -> None:
    """energon's error handler (`WorkerConfig.global_error_handler`), called where it loads samples (in
    the loader or its workers) for one it cannot make (a field the dataset's field map names is not
    in the sample, say). Under `on_bad_record: error` the run stops: every rank reads the same stream,
    so every rank meets it at the same record. Else energon drops the sample; rank 0 names it once
    (energon's own handler printed a traceback and the raw sample at every pass)."""
    if on_bad == "quiet":  # reading a share for the index: the stream names the sample when it reaches it
        return
    name = _failed_name(sample, sources)
    # The first line, without the raw sample some of energon's messages print after " in {".
    reason = (str(exc).splitlines() or [""])[0].split(" in {", 1)[0][:300]
    line = f"data.path: energon sample {name}: {type(exc).__name__}: {reason}"
    if on_bad == "error":
        raise DataError(f"error: {line}")
    if name not in _warned and os.environ.get("RANK", "0") == "0":
        _warned.add(name)
        print(f"warning: {line}; skipped (energon drops it, so skipped_samples does not count it)",
              file=sys.stderr, flush=True)


def worker_error_line(exc: DataError) -> str:
    """The `error: ...` line of a DataError raised in a DataLoader worker (torch re-raises it in the
    loading process with the worker's traceback as its message)."""
    lines = str(exc).splitlines()
    for line in reversed(lines):
        if "error: " in line:
            return line[line.index("error: "):]
    return lines[0] if lines else "error: data.path: energon failed to load a sample"


def gave_up_line(path: str, exc: Exception) -> str:
    """The `error: ...` line for energon's FatalSampleError: it stops after too many samples in a row
    failed to load (its message then holds one raw sample, of no use in a log line)."""
    found = re.search(r"failed (\d+) times in a row", str(exc))
    count = f"{found.group(1)} samples" if found else "too many samples"
    return (f"error: data.path: {path}: energon could not load {count} in a row and gave up: the dataset or "
            "its field map (.nv-meta/dataset.yaml) is broken")


def _raw_bytes_encoder():
    from megatron.energon import DefaultTaskEncoder

    class RawBytes(DefaultTaskEncoder):
        decoder = None  # images stay bytes: only ranks that consume them decode them

    return RawBytes()


class EnergonSource:
    """peek / advance / record over energon's loader, like GlobalSampler over a record list."""

    def __init__(self, path: str, seed: int, shuffle: bool, num_workers: int, stop_signal: Optional[int] = None,
                 on_bad_record: str = "skip"):
        self.path, self.seed, self.shuffle, self.num_workers = path, seed, shuffle, num_workers
        self.on_bad_record = on_bad_record
        self.stop_signal = stop_signal  # energon's loader workers ignore it (`worker_start`)
        # energon's loaders always ask for pinned memory; on a machine without a GPU torch then warns,
        # once per rank, that it will not pin. Nothing here goes to a device (records stay bytes). The
        # filter is process-wide: energon makes its torch iterators lazily, on the loading thread.
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        self._open()
        self.num_records = max(1, len(self._dataset))
        self._base, self._since = None, 0   # energon state (None: the start) and records consumed after it
        self._count = 0

    def share(self, rank: int, world: int) -> Iterator[dict]:
        """The records of rank `rank`'s part of the training split (of `world` parts), each once, read
        in this process: energon's split of the dataset over data-parallel ranks. A generator: the
        dataset is opened when it is first iterated (inside the caller's failure handling)."""
        from megatron.energon import WorkerConfig, get_loader, get_val_dataset

        wc = WorkerConfig(rank=rank, world_size=world, num_workers=0,
                          global_error_handler=functools.partial(_sample_failed, "quiet"))
        part = get_val_dataset(self.path, split_part="train", worker_config=wc, batch_size=None,
                               task_encoder=_raw_bytes_encoder())
        from megatron.energon.errors import FatalSampleError

        try:
            for sample in get_loader(part):
                yield to_record(sample)
        except FatalSampleError as exc:
            raise DataError(gave_up_line(self.path, exc)) from None

    def _open(self) -> None:
        from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

        wc = WorkerConfig(rank=0, world_size=1, num_workers=self.num_workers, seed_offset=self.seed,
                          global_error_handler=functools.partial(_sample_failed, self.on_bad_record))
        buffer = 100 if self.shuffle else None
        self._dataset = get_train_dataset(self.path, worker_config=wc, batch_size=None,
                                          shuffle_buffer_size=buffer, max_samples_per_sequence=buffer,
                                          task_encoder=_raw_bytes_encoder())
        self._loader = get_savable_loader(self._dataset)
        # energon passes its own worker start (the workers' seeds); the stop signal is added after it.
        self._loader.worker_init_fn = worker_start(self.stop_signal, self._loader.worker_init_fn)
        self._it = None
        self._pending = None

    def _next(self):
        from megatron.energon.errors import FatalSampleError

        if self._it is None:
            self._it = iter(self._loader)
        try:
            return next(self._it)
        except DataError as exc:  # `_sample_failed` under on_bad_record: error, perhaps from a worker
            raise DataError(worker_error_line(exc)) from None
        except FatalSampleError as exc:  # energon gave up (perhaps in a worker): many samples in a row failed
            raise DataError(gave_up_line(self.path, exc)) from None

    def peek(self) -> int:
        if self._pending is None:
            if self._since >= REFRESH_EVERY:  # nothing read ahead now: energon's state is exact
                self._base, self._since = self._loader.save_state_rank(), 0
            self._pending = to_record(self._next())
        return self._count

    def record(self, index: int) -> dict:
        assert index == self._count and self._pending is not None
        return self._pending

    def advance(self) -> None:
        self.peek()
        self._pending = None
        self._count += 1
        self._since += 1

    def close(self) -> None:
        """End energon's loader workers; the source is not read after this until `load_state_dict`
        opens it again. The loader and its epoch generator refer to each other (so dropping them
        would leave the workers to the garbage collector): closing the generator breaks that, and
        the last reference to torch's iterator, the loader's own (its workers are persistent), then
        goes with the loader."""
        if self._it is not None:
            self._it.close()
        self._it, self._loader, self._pending = None, None, None

    def state_dict(self) -> Dict:
        return {"energon": plain_state(self._base), "since": self._since, "count": self._count}

    def load_state_dict(self, state: Dict) -> None:
        self.close()  # the loader read so far, and its workers, end here (not when the collector finds them)
        self._open()
        base = energon_state(state["energon"])
        if base is not None:
            self._loader.restore_state_rank(base)
        self._base, self._since, self._count = base, 0, int(state["count"]) - int(state["since"])
        for _ in range(int(state["since"])):
            self.advance()
