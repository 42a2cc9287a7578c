"""A LLaVA-format dataset as a stream of training sequences, step by step.

Every rank holds this object and plans each step identically: it draws records from the global
sampler, skips bad ones and (with `data.packing`) packs consecutive records into sequences of at
most `data.seq_length` tokens. Sequence j of step k is training sample `k * global_batch_size + j`,
the index the trainers already slice by DP rank, so all layouts see the same samples. In a
multi-rank run planning reads the record index (token counts, media counts and grids, bad records;
`build_index`, split over the ranks at start-up) and no record: a record is read from the file only
by the ranks that make its tokens (those that train on its sequence) or decode its items (for their
paths); a single process tokenises each record as it plans it. Images and audio clips are decoded
only when a rank asks for a sample's items of that encoder (its encoder consumes them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from bisect import bisect_right
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch

from mimo.config import MimoConfig
from mimo.config.hf_files import processor_dir, tokenizer_dir

from .audio import AudioError, AudioLoader
from .images import ImageError, ImageLoader, MediaReadError, NativeImageLoader, media_name
from .items import LazyItems, grid_patches, is_native, patch_width
from .llava import BadRecord, ConversationEncoder, DataError, Encoded, MediaError, record_id
from .mock import PAD_ID, Sample
from .native_images import native_grid
from .record_file import read_records
from .record_index import (KeyedRows, RecordIndex, RecordMeta, file_digest, fingerprint, gather_index,
                           gather_keyed_index, load_index, save_index)
from .sampler import GlobalSampler
from .worker_start import stop_signal, worker_start


class Planned:
    """One record as a step's plan holds it: its index in the file (or energon's stream) and what
    planning needs (`meta`); its id and media paths (or inline bytes); its tokens once made. Planned
    from the record index, its id and paths are read from the file when first asked for
    (`describe(index)` -> (id, images, audio)), so a rank reads only the records it works on. A
    streamed (energon) record planned from the index keeps the `record` itself, for its tokens."""

    def __init__(self, index: int, meta: RecordMeta, describe: Optional[Callable] = None, *,
                 id: Optional[str] = None, images: Optional[List] = None, audio: Optional[List] = None,
                 encoded: Optional[Encoded] = None, record: Optional[dict] = None):
        self.index, self.meta, self.encoded = index, meta, encoded  # encoded: made when planning tokenised
        self.record = record
        self._describe, self._described = describe, None if id is None else (id, images, audio)

    def _read(self) -> Tuple:
        if self._described is None:
            self._described = self._describe(self.index)
        return self._described

    @property
    def id(self) -> str:
        return self._read()[0]

    @property
    def images(self) -> List:
        return self._read()[1]

    @property
    def audio(self) -> List:
        return self._read()[2]


class _Media(SequenceABC):
    """A sequence's items of one kind ("images" or "audio"), in order: each item's path, or with
    `ids` the id of the record it belongs to. Its length comes from the plan; an item's path is read
    from its record only when asked for (by the ranks that decode it)."""

    def __init__(self, docs: List[Planned], kind: str, ids: bool = False):
        self.docs, self.kind, self.ids = docs, kind, ids
        self.starts = list(accumulate((getattr(d.meta, kind) for d in docs), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, k: int):
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        j = bisect_right(self.starts, k) - 1  # the record holding item k (records without any are skipped)
        doc = self.docs[j]
        return doc.id if self.ids else getattr(doc, self.kind)[k - self.starts[j]]


class PlannedSample(Sample):
    """A sequence of a step's plan. What every rank reads of every sequence (item counts and
    grids, token and loss counts) is known from the plan; the token tensors are made on first use,
    so only the ranks that train on the sequence tokenise its records."""

    def __init__(self, docs: List[Planned], seq_length: int, items: LazyItems, grids, tokens: Callable):
        self.docs, self.seq_length, self.items, self.grids = docs, seq_length, items, grids
        self._tokens, self._made = tokens, None  # tokens(Planned) -> Encoded

    def __repr__(self) -> str:  # the dataclass's would make the tokens (and ids would read the records)
        return f"PlannedSample(records at {[d.index for d in self.docs]})"

    def token_count(self, pad_id: int = PAD_ID) -> int:
        return sum(d.meta.tokens for d in self.docs)

    def document_tokens(self, pad_id: int = PAD_ID) -> List[int]:
        return [d.meta.tokens for d in self.docs]

    def loss_count(self, placeholder_ids=None) -> int:
        return sum(d.meta.loss for d in self.docs)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._tensors()[0]

    @property
    def targets(self) -> torch.Tensor:
        return self._tensors()[1]

    @property
    def document_ids(self) -> torch.Tensor:
        return self._tensors()[2]

    @property
    def position_ids(self) -> torch.Tensor:
        return self._tensors()[3]

    def _tensors(self) -> Tuple[torch.Tensor, ...]:
        """Records laid end to end, padded to seq_length: document ids (-1 on padding) and positions
        that restart at 0 for each record."""
        if self._made is None:
            ids, targets, doc_ids, pos = [], [], [], []
            for k, d in enumerate(self.docs):
                e = d.encoded if d.encoded is not None else self._tokens(d)
                ids += e.input_ids
                targets += e.targets
                doc_ids += [k] * len(e.input_ids)
                pos += range(len(e.input_ids))
            pad = self.seq_length - len(ids)
            self._made = (torch.tensor(ids + [PAD_ID] * pad, dtype=torch.long),
                          torch.tensor(targets + [False] * pad, dtype=torch.bool),
                          torch.tensor(doc_ids + [-1] * pad, dtype=torch.long),
                          torch.tensor(pos + [0] * pad, dtype=torch.long))
        return self._made


def sample_items(dataset, step: int, samples: Sequence[int], encoders: Collection[str]) -> List[Tuple[str, int, int]]:
    """(encoder, sample, item) of every item of `encoders` in the given samples of `step` (for `prefetch`)."""
    G = dataset.G
    return [(n, j, k) for j in samples for n in encoders
            for k in range(dataset.sample_plan(step * G + j).count(n))]


@dataclass
class PlannedStep:
    samples: List[Sample]
    records: List[List[Planned]]  # per sequence, the records packed into it
    packing_efficiency: float     # non-padding fraction of the step's tokens
    skipped_samples: int          # cumulative, through this step

    @property
    def record_ids(self) -> List[List[str]]:
        """Per sequence, the ids of its records (read from the file, for records planned from the index)."""
        return [[d.id for d in s] for s in self.records]

    @property
    def record_tokens(self) -> List[List[int]]:
        """Per sequence, the token count of each of its records."""
        return [[d.meta.tokens for d in s] for s in self.records]


def load_tokenizer(cfg: MimoConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.data.tokenizer or tokenizer_dir(cfg))


class LlavaDataset:
    """`kind: llava` (records from a file, GlobalSampler order) or, with an EnergonSource,
    `kind: energon` (records from energon's loader, in its order)."""

    def __init__(self, cfg: MimoConfig, tokenizer=None, source=None):
        d = cfg.data
        self.cfg = cfg
        # the records, and their file's digest (which the ranks compare in build_index)
        self.records, self.records_digest = read_records(d.path) if source is None else (None, None)
        self.G, self.S = cfg.training.global_batch_size, d.seq_length
        self.packing, self.on_bad = d.packing, d.on_bad_record
        first = lambda kind: next((n for n, e in cfg.model.encoders.items() if e.kind == kind), None)  # noqa: E731
        self.vision, self.audio = first("vision"), first("audio")
        enc = cfg.model.encoders[self.vision] if self.vision else None
        aud = cfg.model.encoders[self.audio] if self.audio else None
        self.native = bool(enc) and is_native(enc)
        self.image_loader = ((NativeImageLoader(enc, processor_dir(cfg, self.vision)) if self.native else
                              ImageLoader(enc.image_size, processor_dir(cfg, self.vision))) if enc else None)
        self.audio_loader = (AudioLoader(aud, f"model.encoders.{self.audio}")
                             if aud and source is None else None)
        self.encoder = ConversationEncoder(
            tokenizer if tokenizer is not None else load_tokenizer(cfg), self.S,
            d.image_root if d.image_root is not None else os.path.dirname(os.path.abspath(d.path)) if source is None
            else "",
            cfg.placeholder_ids[self.vision] if enc else None, enc.tokens_per_item if enc and not self.native else 0,
            cfg.placeholder_ids[self.audio] if self.audio_loader else None, aud.tokens_per_item if aud else 0,
            self.audio_loader.check if self.audio_loader else None,
            # Native resolution: each image's placeholder run from its header's size.
            image_grid=(lambda w, h: native_grid(w, h, enc)) if self.native else None,
            merge=enc.spatial_merge_size if self.native else 1)
        self.loaders = {n: l for n, l in ((self.vision, self.image_loader), (self.audio, self.audio_loader)) if l}
        self.empty = {n: ((patch_width(e),) if is_native(e) else (e.num_channels, e.image_size, e.image_size)
                          if e.kind == "vision" else (e.clip_frames, e.num_mel_bins))
                      for n, e in cfg.model.encoders.items()}
        self.sampler = GlobalSampler(len(self.records), d.seed, d.shuffle) if source is None else source
        self.skipped = 0
        self.bad: Dict[int, str] = {}  # record index -> reason: decided once, identically on every rank
        self.index: Optional[RecordIndex] = None  # built over the ranks (build_index); else planning tokenises
        self._rows: Optional[KeyedRows] = None  # energon: the index's rows by sample key
        self._plans: Dict[int, PlannedStep] = {}
        self._next_step, self._trained = 0, -1
        self._starts: Dict[int, Dict] = {0: self._position()}
        self.num_workers = d.num_workers
        self._stop_signal = stop_signal(cfg.training)
        self._wanted, self._pin = None, False
        # per encoder, items that passed their header check but failed to decode (on this rank)
        self.bad_media: Dict[str, int] = {n: 0 for n in cfg.model.encoders}
        self._named: set = set()  # records already named in a bad-media warning (this rank)
        self._warned: set = set()  # bad records already named in a skipping warning (rank 0)
        # Under `on_bad_record: error`, a trainer defers decode failures (`defer_media_errors`): kept
        # here with zeros in the item's place, so that every rank learns of them in the step and stops
        # after it alike, instead of this rank alone stopping with the others waiting for it.
        self.media_errors: Optional[List[str]] = None
        self._close_prefetch()
        self._peeked = None  # (record index, Planned): the record that did not fit the last sequence

    # -- the trainers' interface ---------------------------------------------------------------

    def build_index(self, group) -> None:
        """Collective over `group` (a mimo.runtime.fan_in.FanIn over every rank, once at start-up,
        before any step is planned): each of its W ranks tokenises every W-th record and checks its
        media, and all gather the numbers planning needs (mimo.data.record_index). From then on a
        rank plans steps from the index and reads only the records it works on (tokenises those of
        the sequences it trains on, reads those whose items it decodes). With `data.index` the index is
        loaded from that file when its fingerprint matches on every rank, else built and written
        there (by rank 0). Energon's records stream in: each rank learns those of its part of the
        dataset (energon's own split) and the index is keyed by sample key (`_index_stream`).

        First the ranks check that they read the same records file (its digest): planned from one
        index, ranks that read another copy (a node with a stale one, a file rewritten while the job
        starts) would agree on every step's plan and then train on, or decode for, other records."""
        import torch.distributed as dist

        if self.records is None:
            self._index_stream(group)
            return
        path = self.cfg.data.index  # every rank the same: the config is one
        # Reading the index file can fail on one rank: that rank still takes its part in the
        # reduction, flagged, so that no rank waits for it.
        index, key, failure = None, None, None
        if path:
            try:
                key = self._index_key()
                index = load_index(path, key, len(self.records))
            except Exception as exc:  # re-raised below, after the reduction (which is not inside the try)
                failure = exc
        # MIN of (loaded, -failed, digest, -digest): the index file is used only if every rank could
        # load it; the records files are the same if the smallest digest is the largest.
        digest = int(self.records_digest[:14], 16)  # 56 bits
        slots = torch.tensor([index is not None, -(failure is not None), digest, -digest], dtype=torch.int64)
        group.all_reduce(slots, op=dist.ReduceOp.MIN)
        loaded, failed, low, neg_high = (int(x) for x in slots)
        if failure is not None:
            raise failure
        if failed:
            raise DataError("error: data.index: another rank failed to load the index file (its own error line names "
                            "the cause)")
        if low != -neg_high:
            raise DataError(f"error: data.path: the ranks read different files at {self.cfg.data.path} (a node with "
                            "another copy, or the file changed while the job started): every rank needs the same "
                            "records file, unchanged during the run")
        if path:
            if loaded:
                self.index = index
                return
            if group.rank == 0:
                why = ("made for other records, tokenizer or settings, or not readable on every rank"
                       if os.path.exists(path) else "not made yet")
                print(f"data.index: {path} {why}: indexing the records", file=sys.stderr, flush=True)
        self.index = gather_index(len(self.records), self.native, self._learn, group)
        if path and group.rank == 0:
            save_index(self.index, path, key)

    def _index_key(self) -> str:
        """The fingerprint of what the index depends on: the records file; how records become tokens
        (the tokenizer's whole pipeline, settings and template, the library versions, mimo's own
        encoding code, seq_length, the placeholders and the encoders' settings, which give native
        grids and audio checks); where media paths point. Not the media files themselves."""
        import PIL
        import tokenizers
        import transformers

        from . import audio, images, llava, native_images, record_index

        e, tok = self.encoder, self.encoder.tok
        backend = getattr(tok, "backend_tokenizer", None)  # a fast tokenizer: normalizer, pre-tokenizer, model...
        kwargs = getattr(tok, "init_kwargs", {})
        settings = {k: v for k, v in kwargs.items() if not k.endswith(("_file", "name_or_path", "_path", "_dir"))}
        # A slow tokenizer's model lives in its files (a SentencePiece model, vocab and merges): their bytes.
        files = sorted(file_digest(v) for k, v in kwargs.items() if k.endswith("_file") and isinstance(v, str)
                       and os.path.isfile(v))
        return fingerprint({
            "records": self.records_digest, "image_root": os.path.abspath(e.image_root),
            "seq_length": self.S, "placeholders": [e.image_token, e.tokens_per_image, e.audio_token, e.tokens_per_audio],
            "encoders": {n: dataclasses.asdict(enc) for n, enc in self.cfg.model.encoders.items()},
            "tokenizer": [type(tok).__name__, backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
                          settings, files, tok.chat_template, tok.all_special_tokens],
            # mimo's code that turns records into the index's numbers (this file: _learn).
            "code": [file_digest(m.__file__) for m in (llava, images, audio, native_images, record_index)]
                    + [file_digest(__file__)],
            "versions": [transformers.__version__, tokenizers.__version__, PIL.__version__]})

    def _index_stream(self, group) -> None:
        """Energon's records, indexed by sample key: each rank learns those of its part of the dataset
        (`EnergonSource.share`, read once at start-up) and all gather them. Steps still stream in
        energon's order; planning looks each record up by its key instead of tokenising it (a key
        the index lacks is tokenised there, on every rank alike). A sample is named by its dataset,
        shard and key; a dataset where two samples share that name has no index: its steps are
        planned by tokenising every record."""
        rows, index = gather_keyed_index(self.sampler.share(group.rank, group.world), self.native,
                                         self._learn_record, group)
        if not rows.repeats:
            self.index, self._rows = index, rows
        elif group.rank == 0:
            print(f"warning: data.path: {self.cfg.data.path}: {rows.repeats} energon sample name(s) repeat; every "
                  "rank tokenises every record to plan the steps", file=sys.stderr, flush=True)

    def _learn(self, idx: int):
        """Record `idx` of the file's RecordMeta, or why it is bad."""
        try:
            record = self.records[idx]
        except BadRecord as exc:  # a JSONL line that is not valid JSON: a bad record like any other
            return str(exc)
        return self._learn_record(record, idx)

    def _learn_record(self, record, idx: int):
        """The record's RecordMeta, or why it is bad."""
        try:
            return RecordMeta.of(self.encoder.encode(record, idx))
        except BadRecord as exc:
            return str(exc)

    def sample(self, index: int) -> Sample:
        """Sample `index` of the run, for training: its step's decoded-ahead items are taken first."""
        step, j = divmod(index, self.G)
        if step > self._trained:
            self._trained = step
            self._fetch(step)
        return self.plan(step).samples[j]

    def sample_plan(self, index: int) -> Sample:
        """Sample `index` as planned (tokens, item counts), without taking any decoded items: what a
        rank reads of a step ahead of training it."""
        step, j = divmod(index, self.G)
        return self.plan(step).samples[j]

    def plan(self, step: int) -> PlannedStep:
        """The sequences of `step`; steps are planned in order (earlier ones are replayed if needed)."""
        if step not in self._plans:
            if step < self._next_step:
                self._seek(self._starts[step])
            while self._next_step <= step:
                try:
                    made = self._plan_next()
                except BaseException:
                    # Back to the step's start, so that planning it again (where the ranks check it, after
                    # a failure while planning ahead) plans it whole, as the other ranks do.
                    start = self._starts[self._next_step]
                    self.sampler.load_state_dict(start["sampler"])
                    self.skipped, self._peeked = int(start["skipped_samples"]), None
                    raise
                self._plans[self._next_step] = made
                self._next_step += 1
                self._starts[self._next_step] = self._position()
        done = min(step, self._trained) - 1  # a step's microbatches may still ask for the previous step
        for old in [s for s in self._plans if s < done]:
            del self._plans[old]
        for old in [s for s in self._starts if s < done]:
            del self._starts[old]  # one position a step (energon's: its loader state) would pile up
        return self._plans[step]

    def plan_digest(self, step: int) -> int:
        """56 bits of a hash of what the ranks must agree on about `step` (mimo.training.agreement): the
        records in each sequence and each record's token count, the records skipped so far, and each
        sequence's items (and native grids). Records of a file are named by their place in it (the
        ranks checked at start-up that they read the same file: no rank reads every record's id);
        energon's, streamed in, by their ids."""
        plan = self.plan(step)
        name = (lambda d: d.index) if self.records is not None else (lambda d: d.id)  # noqa: E731
        what = [[[name(d) for d in s] for s in plan.records], plan.skipped_samples, plan.record_tokens,
                [[s.count(n) for n in sorted(self.loaders)] for s in plan.samples],
                [None if s.grids is None else sorted((n, [list(g) for g in gs]) for n, gs in s.grids.items())
                 for s in plan.samples]]
        blob = json.dumps(what, separators=(",", ":")).encode()
        return int.from_bytes(hashlib.blake2b(blob, digest_size=7).digest(), "little")

    def tokenise(self, step: int, samples: Sequence[int], items: Sequence[Tuple[str, int, int]] = ()) -> None:
        """Make the tokens of the given sequences of `step` now (the rank's own: those it trains on) and
        read the paths of the given items ((encoder, sequence, item): those it decodes), so that a
        record that reads or tokenises unlike the index fails where the ranks check the step."""
        plan = self.plan(step)
        for j in samples:
            plan.samples[j].input_ids
        for n, j, k in items:
            plan.samples[j].items.paths[n][k]

    def skipped_samples(self, step: int) -> int:
        """Records skipped so far (cumulative), up to the end of `step`."""
        return self.plan(step).skipped_samples

    def metrics(self, step: int) -> Dict[str, float]:
        """For the step metrics: `skipped_samples` (cumulative) and `packing_efficiency`."""
        plan = self.plan(step)
        return {"skipped_samples": plan.skipped_samples, "packing_efficiency": plan.packing_efficiency}

    def state_dict(self, next_step: Optional[int] = None) -> Dict:
        """The data position where step `next_step` starts (part of a checkpoint saved after the step
        before it), by default after the last step the trainer asked for; steps planned or loaded
        ahead do not move it."""
        return dict(self._starts[self._trained + 1 if next_step is None else next_step])

    def load_state_dict(self, state: Dict) -> None:
        self._seek(state)
        self._trained = int(state["step"]) - 1
        self._starts = {int(state["step"]): dict(state)}
        self._close_prefetch()

    def prefetch(self, wanted: Callable[[int], List[Tuple[str, int, int]]], pin_memory: bool = False) -> None:
        """Decode ahead, in `data.num_workers` DataLoader workers, the items this rank's encoders
        consume: `wanted(step)` lists them as (encoder, sample within the step, item within the
        sample). Without it (or with num_workers 0) a rank decodes an item when it first reads it."""
        import multiprocessing

        # A daemonic process (ranks started by tools/parity.py) may not start workers: it decodes inline.
        if self.num_workers > 0 and self.loaders and not multiprocessing.current_process().daemon:
            self._wanted, self._pin = wanted, pin_memory

    def _position(self) -> Dict:
        return {"step": self._next_step, "sampler": self.sampler.state_dict(), "skipped_samples": self.skipped,
                "records": self.records_digest}

    def position_problem(self, state: Dict) -> Optional[str]:
        """Why this run's records cannot continue from the saved data position `state` (None if they
        can): asked on every rank before a checkpoint's tensors load. A position counts records of one
        file in one order; the same count in a rewritten file would resume into other records."""
        saved_digest, saved_count = state.get("records"), state["sampler"].get("num_records")
        if saved_count is not None and int(saved_count) != self.sampler.num_records:
            changed = f"it holds {self.sampler.num_records} records, the checkpoint's data position {saved_count}"
        elif saved_digest is not None and self.records_digest is not None and saved_digest != self.records_digest:
            changed = "its contents changed since the checkpoint was saved"
        else:
            return None
        return (f"data.path: {self.cfg.data.path}: {changed}; resuming the data position needs the same records "
                "(training.load_optimizer: false loads the weights only and starts the data afresh)")

    def _seek(self, state: Dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.skipped = int(state["skipped_samples"])
        self._next_step = int(state["step"])
        self._plans.clear()
        self._peeked = None

    # -- decoding ------------------------------------------------------------------------------

    def _paths(self, step: int) -> tuple:
        """(encoder, path) of the items this rank decodes ahead in `step`: none when planning the step
        fails here, ahead of time and on this rank only (a read error; a bad record under
        `on_bad_record: error`). Only where the ranks check the step (mimo.training.agreement) may it
        fail: there every rank learns of it, and a run whose last step comes before it never does."""
        try:
            samples = self.plan(step).samples
            return tuple((n, samples[j].items.paths[n][k]) for n, j, k in self._wanted(step))
        except Exception:  # noqa: BLE001 (planned again, and any failure raised, where the ranks check the step)
            return ()

    def _fetch(self, step: int) -> None:
        """Take the prefetched items of `step` (the loader runs steps in order from where it started)."""
        if self._wanted is None:
            return
        if self._loader_iter is None or self._loader_step != step:
            self._close_prefetch()
            steps = _Steps(self, step)
            # Its own generator: the loader draws its workers' base seed from it, not from torch's
            # global one, which a resumed run would then draw from at another step than a straight run.
            self._loader_iter = iter(torch.utils.data.DataLoader(
                _DecodePaths(self.loaders), batch_size=None, sampler=steps,
                num_workers=self.num_workers, prefetch_factor=2, pin_memory=self._pin,
                generator=torch.Generator().manual_seed(step),
                worker_init_fn=worker_start(self._stop_signal)))
        keys, items = next(self._loader_iter)
        self._decoded = {tuple(k): x for k, x in zip(keys, items)}  # the loader turned tuples into lists
        self._loader_step = step + 1

    def _close_prefetch(self) -> None:
        self._loader_iter, self._loader_step, self._decoded = None, None, {}

    def close(self) -> None:
        """End the data workers (decode workers, and energon's loader workers): the run is over."""
        self._close_prefetch()
        if hasattr(self.sampler, "close"):
            self.sampler.close()

    def _decode(self, name: str, path, record: str, grid=None) -> torch.Tensor:
        got = self._decoded.get((name, path))
        if got is None:
            got = decode_or_reason(self.loaders[name], path)
        # A native-resolution item's zeros take its size from the header (its grid).
        shape = (grid_patches(grid),) + self.empty[name] if grid is not None else self.empty[name]
        if isinstance(got, MediaReadError):  # this rank's read failed mid-step: the run stops, under any
            # on_bad_record, every rank after this step (deferred, as `_bad_media` under `error`)
            if self.media_errors is None:
                raise got
            self.media_errors.append(f"error: data.path: record {record!r}: {got}")
            return torch.zeros(shape)
        if isinstance(got, str):
            return self._bad_media(name, record, got, shape)
        if grid is not None and got.shape[0] != shape[0]:  # the file changed since its header was read
            return self._bad_media(name, record, f"image {media_name(path)} makes {got.shape[0]} patches, its header "
                                   f"gave {shape[0]} when the step was planned (the file changed since; with "
                                   "data.index, since the index was made)", shape)
        return got

    def defer_media_errors(self) -> None:
        """Keep decode failures under `on_bad_record: error`, and read failures while decoding under any
        setting, in `media_errors` instead of raising them."""
        self.media_errors = []

    def take_media_errors(self) -> List[str]:
        """The decode failures kept since the last call (none unless deferred)."""
        if not self.media_errors:
            return []
        taken, self.media_errors = self.media_errors, []
        return taken

    def _bad_media(self, name: str, record: str, reason: str, shape: tuple) -> torch.Tensor:
        """An item whose header was good but whose data is not (a truncated JPEG, say): under `skip`
        zeros of the item's size (the record was planned from its header, so every rank already
        agrees on the step), named once and counted; under `error` the run stops, naming it (deferred:
        zeros meanwhile, and the trainer stops every rank after the step)."""
        if self.on_bad == "error":
            line = f"error: data.path: record {record!r}: {reason}"
            if self.media_errors is None:
                raise MediaError(line)
            self.media_errors.append(line)
            return torch.zeros(shape)
        self.bad_media[name] += 1
        if record not in self._named:
            self._named.add(record)
            print(f"warning: data: record {record!r}: {reason}; trained on with zeros in its place",
                  file=sys.stderr, flush=True)
        return torch.zeros(shape)

    # -- planning ------------------------------------------------------------------------------

    def _planned(self, idx: int) -> Optional[Planned]:
        """The record as planned, or None (counted, warned once) when it is bad."""
        if self._peeked is not None and self._peeked[0] == idx:
            return self._peeked[1]
        if idx not in self.bad:
            try:
                doc = self._plan_record(idx)
                self._peeked = (idx, doc)
                return doc
            except BadRecord as exc:
                # Its id is read from the file only for the message (indexed, the verdict needed none).
                if self.on_bad == "error":
                    raise DataError(f"error: data.path: record {self._record_id(idx)!r}: {exc}") from None
                self.bad[idx] = str(exc)
                # A streamed (energon) record comes back at a new position every epoch: named once by its
                # sample name, as a file's record is by its line.
                name = self._record(idx).get("source", idx) if self.records is None else idx
                if _is_rank0() and name not in self._warned:
                    self._warned.add(name)
                    print(f"warning: data: skipping record {self._record_id(idx)!r}: {exc}", file=sys.stderr,
                          flush=True)
        self.skipped += 1
        return None

    def _record(self, idx: int):
        return self.records[idx] if self.records is not None else self.sampler.record(idx)

    def _record_id(self, idx: int) -> str:
        """A bad record's id, for its message (`#idx` for a JSONL line that is not JSON)."""
        try:
            return record_id(self._record(idx), idx)
        except BadRecord:
            return record_id(None, idx)

    def _plan_record(self, idx: int) -> Planned:
        """From the index when there is one (nothing read: the record's id and media paths are read
        when first asked for, `_describe`); raises BadRecord for a bad record."""
        if self.index is not None and self.records is not None:
            meta = self.index.meta(idx)
            if isinstance(meta, str):
                raise BadRecord(meta)
            return Planned(idx, meta, self._describe)
        planned = self._plan_streamed(idx) if self.index is not None else None
        if planned is not None:
            return planned
        # No index, or a streamed record it does not know as it is: tokenised here.
        enc = self.encoder.encode(self._record(idx), idx)
        return Planned(idx, RecordMeta.of(enc), id=enc.id, images=enc.images, audio=enc.audio, encoded=enc)

    def _plan_streamed(self, idx: int) -> Optional[Planned]:
        """Energon's record `idx` planned from the index by its key (the record is read anyway: it
        streams in), or None when the index does not know it as it is (then it is tokenised)."""
        record = self.sampler.record(idx)
        row = self._rows.row(record["source"])
        if row is None:
            return None
        meta = self.index.meta(row)
        if isinstance(meta, str):
            raise BadRecord(meta)
        images, audio = self.encoder.media(record)
        if (len(images), len(audio)) != (meta.images, meta.audio):
            return None
        return Planned(idx, meta, id=str(record["id"]), images=images, audio=audio, record=record)

    def _describe(self, idx: int) -> Tuple[str, List, List]:
        """An indexed record's id and media paths, read from the file: its media must be as the index
        counted them, which other ranks may have done."""
        got, record = None, None
        try:
            record = self.records[idx]
            images, audio = self.encoder.media(record)
            got = (len(images), len(audio))
        except BadRecord as exc:
            got = exc
        meta = self.index.meta(idx)
        if got != (meta.images, meta.audio):
            raise DataError(f"error: data: record {record_id(record, idx)!r} reads differently on this rank ({got}) "
                            f"than when the ranks indexed the records ({meta.images} image(s), {meta.audio} audio "
                            "clip(s)): every rank needs the same records file, unchanged during the run")
        return record_id(record, idx), images, audio

    def _tokens(self, doc: Planned) -> Encoded:
        """The tokens of an indexed record, for a sequence this rank trains on: its media headers were
        read when it was indexed (and its grids kept), so only the text is tokenised here; the count
        must be the index's, which other ranks may have made."""
        record = doc.record
        try:
            record = record if record is not None else self.records[doc.index]
            enc = self.encoder.encode(record, doc.index, doc.meta.grids, checked=True)
            got = RecordMeta.of(enc)
        except BadRecord as exc:
            got = exc
        if got != doc.meta:
            rid = record_id(record, doc.index)  # as read here (its media paths need not be read)
            raise DataError(f"error: data: record {rid!r} tokenises differently on this rank ({got}) than when "
                            f"the ranks indexed the records ({doc.meta}): every rank needs the same records file "
                            "(unchanged during the run), tokenizer files and transformers/tokenizers versions")
        return enc

    def _plan_next(self) -> PlannedStep:
        seqs: List[List[Planned]] = []
        cur: List[Planned] = []
        used, bad_run = 0, 0
        while len(seqs) < self.G:
            doc = self._planned(self.sampler.peek())
            if doc is None:
                bad_run += 1
                if bad_run > self.sampler.num_records:
                    raise DataError(f"error: data.path: no usable record: all {len(self.bad)} records are bad")
                self.sampler.advance()
                continue
            bad_run = 0
            n = doc.meta.tokens
            if self.packing and cur and used + n > self.S:
                seqs.append(cur)  # the record stays unconsumed: it opens the next sequence (or step)
                cur, used = [], 0
                continue
            cur.append(doc)
            used += n
            self.sampler.advance()
            if not self.packing:
                seqs.append(cur)
                cur, used = [], 0
        samples = [self._sequence(s) for s in seqs]
        real = sum(d.meta.tokens for s in seqs for d in s)
        return PlannedStep(samples, seqs, real / (self.G * self.S), self.skipped)

    def _sequence(self, docs: List[Planned]) -> PlannedSample:
        """A sequence of records with its items (decoded when read) and, made when first read, tokens."""
        grids = [g for d in docs for g in d.meta.grids or ()]
        kinds = {self.vision: "images", self.audio: "audio"}
        paths = {n: _Media(docs, kinds[n]) if n in kinds else [] for n in self.cfg.model.encoders}
        records = {n: _Media(docs, kinds[n], ids=True) if n in kinds else [] for n in self.cfg.model.encoders}
        items = LazyItems(paths, records, self._decode, self.empty, {self.vision: grids} if self.native else None)
        return PlannedSample(docs, self.S, items, {self.vision: grids} if self.native else None, self._tokens)


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _Steps:
    """The DataLoader's sampler: this rank's (encoder, path) items of step start, start + 1, ...
    (planned in the main process, in order, so every rank's plan stays identical)."""

    def __init__(self, dataset: LlavaDataset, start: int):
        self.dataset, self.start = dataset, start

    def __iter__(self):
        step = self.start
        while True:
            yield self.dataset._paths(step)
            step += 1


def decode_or_reason(loader: Callable, path) -> object:
    """The decoded item; or why it failed to decode (str) after its header passed the check; or the
    MediaReadError of a read that failed on this rank, raised where the item is taken (in the rank's own
    process, so its message is one line, not a worker's traceback)."""
    try:
        return loader(path)
    except (ImageError, AudioError) as exc:
        return str(exc)
    except MediaReadError as exc:
        return exc


class _DecodePaths(torch.utils.data.Dataset):
    """Runs in a worker: a step's (encoder, path) items -> (the same keys, their decoded tensors, or
    for an item that fails to decode the reason, handled by the main process as `on_bad_record` says)."""

    def __init__(self, loaders: Dict[str, Callable[[str], torch.Tensor]]):
        self.loaders = loaders

    def __getitem__(self, keys: tuple):
        return keys, [decode_or_reason(self.loaders[n], p) for n, p in keys]
