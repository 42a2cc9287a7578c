"""The record index (mimo.data.record_index): three gloo ranks that each tokenise a third of the
records and plan from the gathered index plan exactly the steps one process plans by tokenising
every record (tokens, loss targets, documents, positions, items, native grids, skipped records);
a rank that fails to index ends every rank with a message; a rank that tokenises a record unlike
the index stops naming it."""

import os

import pytest
import torch

from mimo.config import load_config
from mimo.runtime import run_on_ranks
from mimo.runtime.fan_in import FanIn
from test_llava_data import (RED, bad_records, energon_dir, llava_raw, sample_dir,  # noqa: F401 (fixtures)
                             write_records)
from test_native_training import qwen_data, qwen_llava  # noqa: F401 (fixture)

STEPS = 6


def _described(ds, steps):
    """Everything a step's plan holds, as plain lists; the token tensors made from the plan."""
    from mimo.data import Sample

    out = []
    for step in range(steps):
        plan = ds.plan(step)
        rows = []
        for s in plan.samples:
            rows.append({"ids": s.input_ids.tolist(), "targets": s.targets.tolist(),
                         "docs": s.document_ids.tolist(), "pos": s.position_ids.tolist(),
                         "counts": {n: s.count(n) for n in ds.cfg.model.encoders},
                         "paths": {n: list(p) for n, p in s.items.paths.items()},
                         "grids": s.grids,
                         # the plan's counts, and the same counts from the tensors (Sample's own methods)
                         "tokens": (s.token_count(), Sample.token_count(s)),
                         "loss": (s.loss_count(ds.cfg.placeholder_ids), Sample.loss_count(s, ds.cfg.placeholder_ids))})
        out.append({"records": plan.record_ids, "skipped": plan.skipped_samples, "rows": rows,
                    "efficiency": plan.packing_efficiency, "digest": ds.plan_digest(step)})
    return out


def _plan_on_rank(raw, steps, index):
    import torch.distributed as dist

    from mimo.data import build_dataset

    ds = build_dataset(load_config(raw))
    if index:
        ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
        assert not ds.index.missing()
    return _described(ds, steps)


def _same_plans(raw, steps):
    indexed = run_on_ranks(_plan_on_rank, 3, raw, steps, True, timeout_s=300)
    (reference,) = run_on_ranks(_plan_on_rank, 1, raw, steps, False, timeout_s=300)
    for got in indexed:
        assert got == reference
    for step in reference:
        for row in step["rows"]:
            assert row["tokens"][0] == row["tokens"][1] and row["loss"][0] == row["loss"][1], row
    return reference


def test_indexed_ranks_plan_what_one_process_plans_with_bad_records(sample_dir, tmp_path):  # noqa: F811
    records = bad_records(tmp_path, sample_dir) * 3 + [dict(r, id=f"{r['id']}-{k}") for k in range(4)
                                                       for r in bad_records(tmp_path, sample_dir)[:1]]
    raw = llava_raw(sample_dir, write_records(tmp_path, records), shuffle=True)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    reference = _same_plans(raw, STEPS)
    assert reference[-1]["skipped"] > 0  # bad records met and skipped alike
    assert any(len(r) > 1 for step in reference for r in step["records"])  # packed sequences


def test_a_broken_jsonl_line_is_skipped_alike_on_every_rank(sample_dir, tmp_path):  # noqa: F811
    """A JSONL line cut short (and a last line cut, as in a file still being written) is a bad record
    under `on_bad_record: skip` on indexed ranks too; it stopped the rank that indexed it."""
    path = write_records(tmp_path, [dict(RED, id=f"r{k}") for k in range(12)])
    lines = open(path).read().split("\n")
    lines[3], lines[-1] = lines[3][:20], lines[-1][:30]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    raw = llava_raw(sample_dir, path, shuffle=False, image_root=sample_dir)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    reference = _same_plans(raw, STEPS)
    assert reference[-1]["skipped"] >= 2
    assert not {"r3", "r11"} & {i for step in reference for seq in step["records"] for i in seq}


def _plan_stream_on_rank(raw, steps):
    """Energon: the records tokenised while planning `steps` after the keyed index is built (or
    without it, on one process), and the plans."""
    import torch.distributed as dist

    from mimo.data import build_dataset
    from mimo.data.llava import ConversationEncoder

    ds = build_dataset(load_config(raw))
    if dist.get_world_size() > 1:
        ds.build_index(FanIn(5, per_node=2))
        assert len(ds._rows.hashes) == len(ds.index) > 0 and not ds.index.missing()
    tokenised = []
    encode = ConversationEncoder.encode
    ConversationEncoder.encode = lambda self, *a, **k: tokenised.append(a[1]) or encode(self, *a, **k)
    for step in range(steps):
        ds.plan(step)
    planning = len(tokenised)
    ConversationEncoder.encode = encode
    return planning, _described(ds, steps)


def test_energon_ranks_plan_from_a_keyed_index_what_one_process_plans(energon_dir):  # noqa: F811
    """Each of 3 ranks learns its part of the energon dataset (energon's own split) at start-up; the
    ranks then plan the streamed steps from the gathered index, tokenising no record, and plan
    exactly what one process plans by tokenising every record."""
    raw = llava_raw(energon_dir, path=os.path.join(energon_dir, "energon_vqa"), kind="energon")
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    (one,) = run_on_ranks(_plan_stream_on_rank, 1, raw, STEPS, timeout_s=300)
    indexed = run_on_ranks(_plan_stream_on_rank, 3, raw, STEPS, timeout_s=300)
    assert one[0] > 0 and all(got[0] == 0 for got in indexed)
    assert all(got[1] == one[1] for got in indexed)
    assert any(len(r) > 1 for step in one[1] for r in step["records"])  # packed: several records a sequence


def test_keyed_rows_find_each_key_and_count_repeats():
    import numpy as np

    from mimo.data.record_index import KeyedRows, key_hash

    keys = [f"/data:shard-{i % 3}.tar\0k{i // 3}" for i in range(30)]  # one key in three shards: three names
    rows = KeyedRows(np.array([key_hash(k) for k in keys], dtype=np.int64))
    assert rows.repeats == 0 and [rows.row(k) for k in keys] == list(range(30)) and rows.row("/data:x\0k0") is None
    assert KeyedRows(np.array([key_hash(k) for k in keys + keys[:2]], dtype=np.int64)).repeats == 2


def _losses(raw):
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    return [trainer.train_step(step).loss for step in range(raw["training"]["train_iters"])]


def test_energon_trains_from_the_keyed_index_as_one_process(energon_dir):  # noqa: F811
    """The LLM at DP 2 on ranks 0-1 and the vision encoder on rank 2, planning energon's stream from
    the keyed index (each LLM rank tokenising its own sequences from the streamed records): the
    losses of one process that tokenises every record."""
    raw = llava_raw(energon_dir, path=os.path.join(energon_dir, "energon_vqa"), kind="energon")
    raw["training"].update(global_batch_size=4, micro_batch_size=1, train_iters=3)
    (one,) = run_on_ranks(_losses, 1, raw, timeout_s=300)
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"rank_offset": 2}}
    for got in run_on_ranks(_losses, 3, raw, timeout_s=300):
        assert got == pytest.approx(one, rel=1e-6, abs=0)


def test_indexed_ranks_plan_what_one_process_plans_native_images(qwen_data):  # noqa: F811
    raw = qwen_llava(qwen_data)
    reference = _same_plans(raw, 3)
    grids = [g for step in reference for row in step["rows"] for g in (row["grids"] or {}).get("images", [])]
    assert len(set(map(tuple, grids))) > 1  # images of several sizes, their grids from the index


def _index_failing_on(raw, rank_failing):
    import errno

    import torch.distributed as dist

    from mimo.data import build_dataset
    from mimo.data.images import MediaReadError
    from mimo.data.llava import DataError

    ds = build_dataset(load_config(raw))
    if dist.get_rank() == rank_failing:
        learn = ds._learn

        def failing(idx):
            if idx > 10:
                raise MediaReadError(errno.EIO, "reading x.png failed: Input/output error")
            return learn(idx)

        ds._learn = failing
    try:
        ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
    except (DataError, MediaReadError) as exc:
        return str(exc)
    return "indexed"


def test_a_rank_that_fails_to_index_ends_every_rank_with_the_cause(sample_dir):  # noqa: F811
    got = run_on_ranks(_index_failing_on, 3, llava_raw(sample_dir), 1, timeout_s=120)
    assert got[1] == "[Errno 5] reading x.png failed: Input/output error"
    assert got[0] == got[2] == "error: data: rank 1 failed to index the records: [Errno 5] reading x.png failed: " \
                               "Input/output error"


def _indexed_dataset(raw):
    """A dataset with its index made in this process (what build_index gathers over the ranks)."""
    from mimo.data.record_index import RecordIndex
    from test_llava_data import dataset

    ds = dataset(raw)
    ds.index = RecordIndex.of(len(ds.records), ds.native, ((i, ds._learn(i)) for i in range(len(ds.records))))
    return ds


def test_a_record_that_tokenises_unlike_the_index_stops_naming_it(sample_dir):  # noqa: F811
    from mimo.data.llava import DataError

    raw = llava_raw(sample_dir, shuffle=False)
    raw["training"].update(global_batch_size=2, micro_batch_size=1)
    ds = _indexed_dataset(raw)
    assert ds.plan(0).samples[1].input_ids.shape == (48,)  # the index as made: the tokens agree
    ds = _indexed_dataset(raw)
    ds.index.counts[0, 1] += 1  # record 0 (first, unshuffled): another rank's tokenizer counted one more target
    first = ds.plan(0).samples[0]
    assert first.docs[0].index == 0 and first.loss_count() > 0  # its metadata stays readable without tokens
    with pytest.raises(DataError, match="record 'cap0000' tokenises differently on this rank .* every rank "
                                        "needs the same records file"):
        first.input_ids


class _CountedReads(list):
    """A records list that notes each record read."""

    def __init__(self, records):
        super().__init__(records)
        self.reads = []

    def __getitem__(self, i):
        self.reads.append(i)
        return super().__getitem__(i)


def test_planning_from_the_index_reads_no_record(sample_dir, monkeypatch):  # noqa: F811
    """Planning and the step's digest read only the index; a record is read when its tokens are made
    or its items' paths are asked for, and tokenised only for its tokens."""
    from mimo.data.llava import ConversationEncoder

    raw = llava_raw(sample_dir)
    raw["training"].update(global_batch_size=8, micro_batch_size=1)
    ds = _indexed_dataset(raw)
    ds.records = _CountedReads(ds.records)
    calls = []
    encode = ConversationEncoder.encode
    monkeypatch.setattr(ConversationEncoder, "encode", lambda self, *a, **k: calls.append(a[1]) or encode(self, *a, **k))
    plan = ds.plan(0)
    ds.plan_digest(0)
    assert calls == [] and ds.records.reads == [] and sum(s.token_count() for s in plan.samples) > 0
    assert sum(s.count("images") for s in plan.samples) > 0  # counted from the index
    plan.samples[3].input_ids
    mine = sorted(d.index for d in plan.samples[3].docs)
    assert sorted(calls) == sorted(ds.records.reads) == mine
    with_images = next(j for j, s in enumerate(plan.samples) if j != 3 and s.count("images"))
    ds.tokenise(0, [], [("images", with_images, 0)])  # an item's path: its record read, not tokenised
    holder = next(d.index for d in plan.samples[with_images].docs if d.meta.images)  # of the sequence's first image
    assert ds.records.reads[len(mine):] == [holder] and sorted(calls) == mine
    images = [p for s in plan.samples for p in s.items.paths["images"]]
    assert images and all(os.path.exists(p) for p in images)  # each image's path, from the record
    assert [r for s in plan.samples for r in s.items.records["images"]] == \
        [d.id for s in plan.samples for d in s.docs for _ in range(d.meta.images)]


def _records_read(raw):
    """The records this rank read from the file over a 2-step run, each step's records, and which of
    them hold images."""
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))  # the index built: each rank a third
    ds = trainer.dataset
    ds.records = _CountedReads(ds.records)
    for step in range(2):
        trainer.train_step(step)
    steps = [[d.index for s in ds.plan(step).samples for d in s.docs] for step in range(2)]
    return ds.records.reads, steps, [i for s in steps for i in s if ds.index.meta(i).images]


def test_each_rank_reads_only_the_records_it_works_on(sample_dir):  # noqa: F811
    """LLM DP 2 on ranks 0-1, the vision encoder on rank 2: an LLM rank reads its own sequences'
    records (to tokenise them), once each; the encoder rank those holding images (their paths),
    none of the others."""
    raw = llava_raw(sample_dir, packing=False)
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"rank_offset": 2}}
    raw["training"].update(global_batch_size=8, micro_batch_size=2, train_iters=2)
    got = run_on_ranks(_records_read, 3, raw, timeout_s=120)
    steps, with_images = got[0][1], set(got[0][2])
    assert all(g[1] == steps for g in got) and len(set(steps[0] + steps[1])) == 16
    llm = [g[0] for g in got[:2]]
    assert all(len(r) == len(set(r)) for r in llm) and not set(llm[0]) & set(llm[1])  # once each, disjoint
    assert sorted(llm[0] + llm[1]) == sorted(steps[0] + steps[1])
    assert 0 < len(with_images) < 16 and set(got[2][0]) == with_images


def test_a_record_whose_media_read_unlike_the_index_stops_naming_it(sample_dir):  # noqa: F811
    from mimo.data.llava import DataError

    raw = llava_raw(sample_dir, shuffle=False)
    raw["training"].update(global_batch_size=2, micro_batch_size=1)
    ds = _indexed_dataset(raw)
    ds.index.counts[0, 2] += 1  # record 0 (first, unshuffled): another rank's file had one image more
    first = ds.plan(0).samples[0]
    assert first.docs[0].meta.images == 2  # as the ranks planned it
    with pytest.raises(DataError, match="record 'cap0000' reads differently on this rank \\(\\(1, 0\\)\\) than when "
                                        "the ranks indexed the records \\(2 image"):
        first.items.paths["images"][0]


def test_a_records_loss_count_is_what_collate_counts_wherever_it_is_laid():
    """A record's first token never carries a loss in a sequence (the token before it is another
    document's, or none), even when it is a target; the others do when they are targets."""
    from mimo.data import Sample, collate
    from mimo.data.llava import Encoded
    from mimo.data.record_index import RecordMeta

    first_is_target = Encoded("a", [5, 6, 7, 8], [True, False, True, True], [])
    other = Encoded("b", [9, 10, 11], [False, True, True], [])
    assert RecordMeta.of(first_is_target).loss == 2 and RecordMeta.of(other).loss == 2
    for docs in ([first_is_target, other], [other, first_is_target]):
        ids = [t for e in docs for t in e.input_ids] + [0]
        targets = [t for e in docs for t in e.targets] + [False]
        doc_ids = [k for k, e in enumerate(docs) for _ in e.input_ids] + [-1]
        s = Sample(input_ids=torch.tensor(ids), items={}, targets=torch.tensor(targets),
                   document_ids=torch.tensor(doc_ids), position_ids=torch.zeros(len(ids), dtype=torch.long))
        assert collate([s], {})["loss_mask"].sum() == sum(RecordMeta.of(e).loss for e in docs) == 4


def _cached_on_rank(raw, steps):
    """Plans of `steps` steps after build_index with `data.index`, and the records this rank indexed."""
    import torch.distributed as dist

    from mimo.data import build_dataset
    from mimo.data.llava import ConversationEncoder

    learned = []
    encode = ConversationEncoder.encode

    def spy(self, record, index, *a, **k):
        if not k.get("checked"):
            learned.append(index)
        return encode(self, record, index, *a, **k)

    ConversationEncoder.encode = spy
    ds = build_dataset(load_config(raw))
    ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
    return {"plans": _described(ds, steps), "learned": len(learned)}


def test_the_index_file_is_reused_and_rebuilt_when_the_records_change(sample_dir, tmp_path):  # noqa: F811
    import json

    records = json.load(open(os.path.join(sample_dir, "train.json")))
    path = write_records(tmp_path, records)
    raw = llava_raw(sample_dir, path, index=str(tmp_path / "train.index"))
    raw["data"]["image_root"] = sample_dir
    raw["training"].update(global_batch_size=4, micro_batch_size=1)

    def run():
        got = run_on_ranks(_cached_on_rank, 3, raw, 3, timeout_s=300)
        assert got[0]["plans"] == got[1]["plans"] == got[2]["plans"]
        return got[0]["plans"], sum(r["learned"] for r in got)

    first, learned = run()
    assert learned == len(records) and os.path.isfile(tmp_path / "train.index")
    again, learned = run()
    assert learned == 0 and again == first  # loaded: nothing tokenised at start-up, the same steps
    path = write_records(tmp_path, records + [dict(records[0], id="one-more")])  # the records changed
    _, learned = run()
    assert learned == len(records) + 1  # another fingerprint: indexed again (and the file replaced)
    _, learned = run()
    assert learned == 0
    (tmp_path / "train.index").write_bytes(b"PK\x03\x04 not a whole file")  # damaged: indexed again
    damaged, learned = run()
    assert learned == len(records) + 1
    (reference,) = run_on_ranks(_plan_on_rank, 1, raw, 3, False, timeout_s=300)
    assert damaged == reference


def test_a_damaged_or_foreign_index_file_is_not_used(tmp_path, capsys):
    from mimo.data.record_index import RecordIndex, RecordMeta, load_index, save_index

    index = RecordIndex.of(3, True, [(2, RecordMeta(7, 3, 2, 0, ((1, 2, 4), (1, 4, 4)))),
                                     (0, RecordMeta(5, 2, 1, 0, ((1, 2, 2),))), (1, "image not found: x.png")])
    assert index.meta(0).grids == ((1, 2, 2),) and index.meta(2).grids == ((1, 2, 4), (1, 4, 4))
    path = str(tmp_path / "i.index")
    save_index(index, path, "key")
    got = load_index(path, "key", 3)
    assert [got.meta(i) for i in range(3)] == [index.meta(i) for i in range(3)]
    assert load_index(path, "another key", 3) is None and load_index(path, "key", 4) is None
    assert capsys.readouterr().err == ""  # another fingerprint is not a warning: the file is simply rebuilt
    for damage in (b"", b"PK\x03\x04 cut", open(path, "rb").read()[:-40]):
        with open(path, "wb") as f:
            f.write(damage)
        assert load_index(path, "key", 3) is None
        assert "warning: data.index: cannot read" in capsys.readouterr().err
    import numpy as np

    with open(path, "wb") as f:  # pickled objects: never loaded, and the warning does not suggest it
        np.savez(f, key=np.array([{"key": 1}], dtype=object))
    assert load_index(path, "key", 3) is None
    assert capsys.readouterr().err == (f"warning: data.index: cannot read {path} (it holds pickled objects, which an "
                                       "index mimo writes never does); indexing the records again\n")


def test_a_file_that_is_no_index_is_never_replaced(tmp_path):
    """data.index naming some other file (the records file, a text file, another zip archive): the
    start stops with one line and leaves the file as it is. Before, it warned, indexed the records
    and wrote the index over the file (the records file too)."""
    import zipfile

    from mimo.data.llava import DataError
    from mimo.data.record_index import load_index

    records = tmp_path / "train.json"
    records.write_text('[{"id": "a", "conversations": []}]')
    other_zip = tmp_path / "images.zip"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("img0.png", b"not really")
    for path in (records, other_zip):
        before = path.read_bytes()
        with pytest.raises(DataError, match=f"data.index: {path} is not a record index .* left as it is"):
            load_index(str(path), "key", 1)
        assert path.read_bytes() == before


def test_index_config_errors(sample_dir, tmp_path):  # noqa: F811
    from mimo.config import ConfigError

    from tiny import TINY

    with pytest.raises(ConfigError, match="data.index: only data.kind llava has a record index"):
        load_config(dict(TINY, data=dict(TINY.get("data", {}), kind="mock", index=str(tmp_path / "x"))))
    with pytest.raises(ConfigError, match="data.index: .* is a directory"):
        load_config(llava_raw(sample_dir, index=str(tmp_path)))
    with pytest.raises(ConfigError, match="data.index: no such directory"):
        load_config(llava_raw(sample_dir, index=str(tmp_path / "nope" / "train.index")))
    assert load_config(llava_raw(sample_dir, index=str(tmp_path / "train.index"))).data.index
    raw = llava_raw(sample_dir)
    with pytest.raises(ConfigError, match=r"data.index: .* is the records file \(data.path\)"):
        load_config(llava_raw(sample_dir, index=raw["data"]["path"]))


def test_a_native_image_whose_size_changed_since_planning_is_bad_media(qwen_data, capfd):  # noqa: F811
    """Its patches no longer match the grid every rank planned with: zeros of the planned size,
    named and counted, instead of a sequence whose placeholders and patches disagree."""
    from test_native_training import _dataset

    ds = _dataset(qwen_llava(qwen_data))
    sample = next(s for s in ds.plan(0).samples if s.count("images"))
    path, grid = sample.items.paths["images"][0], sample.grids["images"][0]
    assert ds._decode("images", path, "rec", grid).shape[0] == grid[0] * grid[1] * grid[2]
    other = (1, grid[1] + 2, grid[2])
    got = ds._decode("images", path, "rec", other)
    assert got.shape[0] == other[0] * other[1] * other[2] and not got.any() and ds.bad_media["images"] == 1
    assert "the file changed since" in capfd.readouterr().err


def _train_other_copy(raw, other_rank):
    """Losses, or the error this rank stops with. `other_rank` reads another copy of the records (each
    answer one word longer) as a node with a stale copy of data.path would, in what it reads of the
    file (its digest the same)."""
    import torch.distributed as dist

    import mimo.data.llava_dataset as lds
    from mimo.data.llava import DataError
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    if dist.get_rank() == other_rank:
        read = lds.read_records

        def other(path):
            records, digest = read(path)
            for r in records:
                r["conversations"][-1]["value"] += " red"
            return records, digest

        lds.read_records = other
    losses = []
    try:
        trainer = Trainer(load_config(raw), select_runtime("cpu"))
        for step in range(raw["training"]["train_iters"]):
            losses.append(trainer.train_step(step).loss)
    except DataError as exc:
        return str(exc)
    return losses


def test_ranks_that_read_another_copy_of_the_records_stop_together(sample_dir):  # noqa: F811
    """The ranks plan from one gathered index, so their plans agree; the copy shows where a rank makes
    its own sequences' tokens, inside the agreement: every rank stops at step 0 with an error line,
    the encoder-only rank (2) too, instead of waiting in the step's collectives."""
    raw = llava_raw(sample_dir)
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"rank_offset": 2}}
    raw["training"]["train_iters"] = 2
    got = run_on_ranks(_train_other_copy, 3, raw, 1, timeout_s=120)
    assert all(isinstance(g, str) for g in got), got
    assert any("tokenises differently on this rank" in g for g in got), got
    assert got[2] == "error: data: another rank failed to plan step 0 (its own error line names the cause)", got


def _index_another_file(raw, other_rank, other_file):
    """build_index, as the trainer calls it at start-up, with `other_rank` reading `other_file` in
    place of data.path: "indexed", or the error this rank stops with."""
    import torch.distributed as dist

    import mimo.data.llava_dataset as lds
    from mimo.data import build_dataset
    from mimo.data.llava import DataError

    if dist.get_rank() == other_rank:
        read = lds.read_records
        lds.read_records = lambda path: read(other_file)
    ds = build_dataset(load_config(raw))
    try:
        ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
    except DataError as exc:
        return str(exc)
    return "indexed"


def test_ranks_that_read_another_records_file_stop_at_start_up(sample_dir, tmp_path):  # noqa: F811
    """Planned from one index, ranks that read different files would agree on every step and train
    on other records: the files' digests are compared when the index is built, on every rank."""
    import json

    with open(os.path.join(sample_dir, "train.json")) as f:
        records = json.load(f)
    records[-1]["conversations"][-1]["value"] += " red"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(records))
    got = run_on_ranks(_index_another_file, 3, llava_raw(sample_dir), 1, str(other), timeout_s=120)
    path = os.path.join(sample_dir, "train.json")
    assert got == [f"error: data.path: the ranks read different files at {path} (a node with another copy, or "
                   "the file changed while the job started): every rank needs the same records file, unchanged "
                   "during the run"] * 3, got


def test_the_fingerprint_covers_the_tokenizers_pipeline(sample_dir, tmp_path):  # noqa: F811
    """Same vocabulary, template and special tokens, another pre-tokenizer: another fingerprint, so a
    kept index is not loaded for it (it would not match its tokens)."""
    import json
    import shutil

    from test_llava_data import dataset

    tok = tmp_path / "tokenizer"
    shutil.copytree(os.path.join(sample_dir, "tokenizer"), tok)
    raw = llava_raw(sample_dir, tokenizer=str(tok))
    before = dataset(raw)._index_key()
    assert dataset(raw)._index_key() == before
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    assert dataset(raw)._index_key() != before


def test_a_compressed_member_damaged_inside_is_a_rebuild_not_a_traceback(tmp_path, capsys):
    import struct
    import zipfile

    import numpy as np

    from mimo.data.record_index import load_index

    path, n = str(tmp_path / "i.index"), 3000
    with open(path, "wb") as f:
        np.savez_compressed(f, key=np.array("key"), counts=np.random.default_rng(0).integers(0, 100, (n, 4)),
                            native=np.array(False), grids=np.zeros((0, 3), np.int64), bad_rows=np.zeros(0, np.int64),
                            bad_reasons=np.array("[]"))
    with zipfile.ZipFile(path) as z:
        at = z.getinfo("counts.npy").header_offset
    data = bytearray(open(path, "rb").read())
    name, extra = struct.unpack("<HH", data[at + 26:at + 30])
    at += 30 + name + extra + 5  # inside the member's deflate stream: zlib.error when read
    data[at:at + 3] = b"\0" * 3
    open(path, "wb").write(bytes(data))
    assert load_index(path, "key", n) is None
    assert "warning: data.index: cannot read" in capsys.readouterr().err


def _index_one_rank_blind(raw, blind_rank, steps):
    import torch.distributed as dist

    import mimo.data.llava_dataset as lds
    from mimo.data import build_dataset

    if dist.get_rank() == blind_rank:
        lds.load_index = lambda *a, **k: None  # this rank's node does not see the file
    ds = build_dataset(load_config(raw))
    ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
    return [ds.plan(s).record_ids for s in range(steps)]


def test_a_rank_that_cannot_read_the_index_file_makes_every_rank_index_again(sample_dir, tmp_path):  # noqa: F811
    raw = llava_raw(sample_dir, index=str(tmp_path / "i.index"))
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    first = run_on_ranks(_index_one_rank_blind, 3, raw, None, 2, timeout_s=120)
    again = run_on_ranks(_index_one_rank_blind, 3, raw, 1, 2, timeout_s=120)
    assert again == first


def _index_key_failing_on(raw, rank_failing):
    import errno

    import torch.distributed as dist

    from mimo.data import build_dataset
    from mimo.data.images import MediaReadError
    from mimo.data.llava import DataError

    ds = build_dataset(load_config(raw))
    if dist.get_rank() == rank_failing:
        def failing():
            raise MediaReadError(errno.EIO, "reading train.json failed: Input/output error")

        ds._index_key = failing
    try:
        ds.build_index(FanIn(5, per_node=2))  # two nodes of 2 and 1 ranks
    except (DataError, MediaReadError) as exc:
        return str(exc)
    return "indexed"


def test_a_rank_that_fails_to_read_for_the_index_file_ends_every_rank(sample_dir, tmp_path):  # noqa: F811
    got = run_on_ranks(_index_key_failing_on, 3, llava_raw(sample_dir, index=str(tmp_path / "i.index")), 2,
                       timeout_s=120)
    assert got[2] == "[Errno 5] reading train.json failed: Input/output error"
    assert got[0] == got[1] == ("error: data.index: another rank failed to load the index file "
                                "(its own error line names the cause)")


def _train_until(raw, rank_failing=None, first_failing=None, once=False):
    """Losses of the run, or the error it stops with; from `first_failing` on, JSONL reads fail with EIO
    on `rank_failing` once the index is built (a disk that fails later, on one node; `once`: only the
    first such read fails)."""
    import errno

    import torch.distributed as dist

    from mimo.data.llava import DataError
    from mimo.data.record_file import JsonLines
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    if dist.get_rank() == rank_failing:
        read = JsonLines.__getitem__

        failed = []

        def failing(self, i):
            if i >= first_failing and not (once and failed):
                failed.append(i)
                raise OSError(errno.EIO, "Input/output error")
            return read(self, i)

        JsonLines.__getitem__ = failing
    losses = []
    try:
        for step in range(raw["training"]["train_iters"]):
            losses.append(trainer.train_step(step).loss)
    except (DataError, OSError) as exc:
        return str(exc)
    return losses


def _ahead_raw(sample_dir, tmp_path, records, **data):  # noqa: F811
    """LLM DP 2 on ranks 0-1, the vision encoder on rank 2 decoding ahead in two DataLoader workers
    (which plans steps ahead on rank 2 alone), 3 steps of 8 one-record sequences."""
    raw = llava_raw(sample_dir, write_records(tmp_path, records), shuffle=False, packing=False, num_workers=2,
                    image_root=sample_dir, **data)
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"rank_offset": 2}}
    raw["training"]["train_iters"] = 3
    return raw


def test_planning_ahead_for_the_decoders_fails_nowhere_alone(sample_dir, tmp_path):  # noqa: F811
    """A bad record under `on_bad_record: error` in step 3 of a 3-step run, and a read error on the
    encoder rank for records of step 3: the run trains its 3 steps. The encoder rank plans steps ahead
    of the others to decode their images; a failure there is left for where every rank checks the
    step (here never reached). Before, that rank stopped alone at step 0 and the LLM ranks were left
    in the step's collectives."""
    from test_llava_data import HELLO

    bad = {"id": "bad", "conversations": [{"from": "human", "value": "hi"}]}
    records = [dict(RED, id=f"r{k}") for k in range(24)] + [bad] + [dict(HELLO, id=f"h{k}") for k in range(7)]
    got = run_on_ranks(_train_until, 3, _ahead_raw(sample_dir, tmp_path, records, on_bad_record="error"),
                       timeout_s=180, daemon=False)
    assert all(isinstance(x, list) and len(x) == 3 for x in got), got
    records = [dict(RED, id=f"r{k}") for k in range(32)]
    got = run_on_ranks(_train_until, 3, _ahead_raw(sample_dir, tmp_path, records), 2, 24, timeout_s=180,
                       daemon=False)
    assert all(isinstance(x, list) and len(x) == 3 for x in got), got
    got = run_on_ranks(_train_until, 3, _ahead_raw(sample_dir, tmp_path, records), 2, 10, timeout_s=180,
                       daemon=False)  # a read error in a step the run trains: every rank stops, named
    assert got[2] == "[Errno 5] Input/output error", got
    assert got[0] == got[1] and got[0].startswith("error: data: another rank failed to plan step 1"), got
    # One failed read while planning ahead (mid-step): the step is planned again from its start where
    # the ranks check it, whole, as the others plan it; the run trains its 3 steps.
    got = run_on_ranks(_train_until, 3, _ahead_raw(sample_dir, tmp_path, records), 2, 10, True, timeout_s=180,
                       daemon=False)
    assert all(isinstance(x, list) and len(x) == 3 for x in got), got
