"""Real (LLaVA-format) data: formatting and label masks by hand, packing boundaries, bad records,
the global sampler's resume, config errors, and FP32 parity of layouts on packed data."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from mimo.config import ConfigError, load_config
from tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_sample_data  # noqa: E402


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("llava"))
    assert make_sample_data.main([out, "--records", "48", "--image-size", "16"]) == 0
    return out


def llava_raw(data_dir, path=None, **data):
    """TINY without audio, bitfield attention, on the LLaVA data in data_dir (4 tokens per image)."""
    raw = copy.deepcopy(TINY)
    del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
    raw["model"]["language"]["attention"] = "bitfield"
    raw["data"] = {"kind": "llava", "path": path or os.path.join(data_dir, "train.json"),
                   "tokenizer": os.path.join(data_dir, "tokenizer"), "seq_length": 48, "packing": True, **data}
    return raw


def dataset(raw):
    from mimo.data import build_dataset

    return build_dataset(load_config(raw))


def write_records(tmp_path, records):
    path = str(tmp_path / "records.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    return path


RED = {"id": "red", "image": "images/img0000.png", "conversations": [
    {"from": "human", "value": "<image>\nwhat shape ?"}, {"from": "gpt", "value": "a red square ."}]}
HELLO = {"id": "hello", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes ."}]}


def test_labels_and_packing_token_by_token(sample_dir, tmp_path):
    raw = llava_raw(sample_dir, write_records(tmp_path, [RED, HELLO]), shuffle=False)
    raw["data"]["image_root"] = sample_dir
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    tok = ds.encoder.tok
    P = load_config(raw).placeholder_ids["images"]
    t = lambda s: tok.convert_tokens_to_ids(s.split())  # noqa: E731
    # Default format: <s>USER: {human}\nASSISTANT: {gpt}</s>; targets: the answer and its </s>.
    red = t("<s> USER :") + [P] * 4 + t("what shape ? ASSISTANT : a red square . </s>")
    red_t = [0] * 12 + [1] * 5
    hello = t("<s> USER : hello ASSISTANT : yes . </s>")
    hello_t = [0] * 6 + [1] * 3
    # Greedy packing in sampler order (no shuffle): red, hello, red again (next epoch) = 43 <= 48.
    ids = red + hello + red + [0] * 5
    targets = red_t + hello_t + red_t + [0] * 5
    docs = [0] * 17 + [1] * 9 + [2] * 17 + [-1] * 5
    pos = list(range(17)) + list(range(9)) + list(range(17)) + [0] * 5
    # loss on position i predicts token i + 1: a target of the same document.
    loss = [float(targets[i + 1] and docs[i + 1] == docs[i]) for i in range(47)] + [0.0]

    from mimo.data import collate

    plan = ds.plan(0)
    assert plan.record_ids == [["red", "hello", "red"]]
    assert plan.packing_efficiency == pytest.approx(43 / 48)
    b = collate([ds.sample(0)], load_config(raw).placeholder_ids)
    assert b["input_ids"][0].tolist() == ids
    assert b["labels"][0].tolist() == ids[1:] + [0]
    assert b["loss_mask"][0].tolist() == loss
    assert b["document_ids"][0].tolist() == docs
    assert b["position_ids"][0].tolist() == pos
    assert b["images"].shape == (2, 3, 8, 8) and b["images_counts"].tolist() == [2]
    # No answer token predicts across a boundary: the last token of each document carries no loss.
    assert loss[16] == 0.0 and loss[25] == 0.0 and loss[15] == 1.0
    # The next step starts where packing stopped: `hello` did not fit and opens step 1.
    assert ds.plan(1).record_ids[0][0] == "hello"
    # The attention mask keeps documents apart and padding out.
    from mimo.model import attention_mask

    mask = attention_mask(load_config(raw), b["input_ids"], b["document_ids"])
    assert mask.document_ids[0].tolist() == docs and (mask.bits[0, 43:] == 0).all() and (mask.bits[0, :43] != 0).all()


def test_chat_template_marks_only_the_answer(sample_dir, tmp_path):
    raw = llava_raw(sample_dir, write_records(tmp_path, [RED]), shuffle=False, packing=False)
    raw["data"]["image_root"] = sample_dir
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    tok = ds.encoder.tok
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant :{% endif %}")
    from mimo.data.llava import ConversationEncoder

    ds.encoder = ConversationEncoder(tok, 48, sample_dir, ds.encoder.image_token, 4)
    enc = ds.encoder.encode(RED, 0)
    answer = [i for i, keep in zip(enc.input_ids, enc.targets) if keep]
    assert answer == tok.convert_tokens_to_ids("a red square . </s>".split())
    assert enc.input_ids.count(ds.encoder.image_token) == 4


def _png_claiming(path, width, height):
    """A valid 1x1 PNG whose header (CRC fixed) says width x height: what a decompression bomb shows."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    with open(path, "wb") as f:
        f.write(bytes(data))


def bad_records(tmp_path, sample_dir):
    with open(tmp_path / "garbage.png", "wb") as f:
        f.write(b"this is not an image")
    _png_claiming(tmp_path / "bomb.png", 20000, 10000)
    img = os.path.join(sample_dir, "images", "img0000.png")
    return [
        dict(RED, id="good1", image=img),
        dict(RED, id="missing", image=str(tmp_path / "nope.png")),
        dict(RED, id="garbage", image=str(tmp_path / "garbage.png")),
        dict(RED, id="bomb", image=str(tmp_path / "bomb.png")),
        {"id": "speaker_list", "conversations": [{"from": ["human"], "value": "hello"},
                                                 {"from": "gpt", "value": "yes ."}]},
        {"id": "nogpt", "conversations": [{"from": "human", "value": "hello"}]},
        {"id": "tag_without_image", "conversations": RED["conversations"]},
        {"id": "image_without_tag", "image": img, "conversations": HELLO["conversations"]},
        {"id": "toolong", "conversations": [{"from": "human", "value": "hello " * 60},
                                            {"from": "gpt", "value": "yes ."}]},
        dict(HELLO, id="good2"),
    ]


REASONS = {"missing": "image not found", "garbage": "unreadable image", "nogpt": "no gpt turn",
           "bomb": "too large: Image size (200000000 pixels) exceeds limit",
           "speaker_list": "conversations[0] needs a string `from` and a string `value`",
           "tag_without_image": "1 `<image>` tag(s) but 0 image(s)",
           "image_without_tag": "0 `<image>` tag(s) but 1 image(s)", "toolong": "longer than data.seq_length (48)"}


def test_every_bad_record_is_skipped_and_named(sample_dir, tmp_path, capfd):
    raw = llava_raw(sample_dir, write_records(tmp_path, bad_records(tmp_path, sample_dir)), shuffle=False,
                    packing=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    assert ds.plan(0).record_ids == [["good1"]] and ds.plan(0).skipped_samples == 0
    assert ds.plan(1).record_ids == [["good2"]] and ds.plan(1).skipped_samples == 8
    assert ds.plan(2).record_ids == [["good1"]]
    assert ds.plan(3).skipped_samples == 16  # counted each time the order reaches them ...
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning: data:")]
    assert len(lines) == 8  # ... but named once
    for rid, reason in REASONS.items():
        (line,) = [ln for ln in lines if f"record {rid!r}" in ln]
        assert reason in line, line


def test_a_read_failure_stops_the_run_instead_of_skipping_the_record(sample_dir, tmp_path, monkeypatch):
    """An I/O error (errno set) while reading a header is this rank's, not the record's: skipping the
    record on this rank alone would give the ranks different steps, so it stops with the file named.
    Control: an errno-less error (the content is at fault) is still a bad record."""
    import errno

    from mimo.data import images
    from mimo.data.images import ImageError, MediaReadError, check_image

    img = os.path.join(sample_dir, "images", "img0000.png")
    raw = llava_raw(sample_dir, write_records(tmp_path, [dict(RED, id="good1", image=img), dict(HELLO, id="good2")]),
                    shuffle=False, packing=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)

    def eio(src):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(images, "_open", eio)
    with pytest.raises(MediaReadError) as exc:
        ds.plan(0)
    assert str(exc.value) == (f"[Errno 5] reading {img} failed: Input/output error (a filesystem error, not a bad "
                              "file; the run stops rather than skip it on one rank)")
    assert not ds.bad  # nothing recorded as a bad record

    def content(src):
        raise OSError("image file is truncated")

    def permission(src):
        raise PermissionError(errno.EACCES, "Permission denied")

    for cause in (content, permission):  # every rank meets these alike: the record is bad
        monkeypatch.setattr(images, "_open", cause)
        with pytest.raises(ImageError, match="unreadable image"):
            check_image(img)
    with pytest.raises(ImageError, match=f"^image is a directory: {tmp_path}$"):
        check_image(str(tmp_path))


def test_a_read_failure_while_decoding_or_looking_stops_the_run(sample_dir, tmp_path, monkeypatch):
    """EIO reading pixels whose header was read (at the step, in the rank or in a decode worker) and EIO
    looking the file up (os.stat) are this rank's failures: MediaReadError, never a bad record; mid-step
    in a trainer it is kept, like a decode failure under `error`, and every rank stops after the step.
    Control: a truncated file's errno-less error is still a bad item."""
    import errno
    import pickle

    from mimo.data import images
    from mimo.data.images import ImageError, MediaReadError, check_image
    from mimo.data.llava_dataset import decode_or_reason

    img = os.path.join(sample_dir, "images", "img0000.png")
    raw = llava_raw(sample_dir, write_records(tmp_path, [dict(RED, id="good1", image=img)]), shuffle=False,
                    packing=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    pixels = ds.sample(0).items["images"]  # planned and decoded while the filesystem works
    later = dataset(raw)
    later.plan(0)  # its header is read while the filesystem works; its pixels are read below
    real_open, real_stat = images._open, os.stat

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(images, "_open", eio)
    got = decode_or_reason(ds.image_loader, img)  # as a decode worker returns it to the rank
    assert isinstance(got, MediaReadError) and got.errno == errno.EIO
    again = pickle.loads(pickle.dumps(got))
    assert type(again) is MediaReadError and str(again) == str(got)
    with pytest.raises(MediaReadError, match=f"reading {img} failed: Input/output error"):
        later.sample(0).items["images"]  # outside a trainer: raised where the item is taken
    assert pixels.abs().sum() > 0 and not any(later.bad_media.values())  # not counted as a bad item
    # In a trainer (decode failures deferred): zeros for the step, and the line that stops every rank after it.
    later.defer_media_errors()
    assert torch.equal(later.sample(0).items["images"], torch.zeros_like(pixels))
    assert later.take_media_errors() == [f"error: data.path: record 'good1': [Errno 5] reading {img} failed: "
                                         "Input/output error (a filesystem error, not a bad file; the run stops "
                                         "rather than skip it on one rank)"]
    monkeypatch.setattr(images, "_open", real_open)
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: eio() if p == img else real_stat(p, *a, **k))
    with pytest.raises(MediaReadError, match=f"reading {img} failed"):
        check_image(img)
    monkeypatch.setattr(os, "stat", real_stat)

    def truncated(src):
        raise OSError("image file is truncated")

    monkeypatch.setattr(images, "_open", truncated)
    assert decode_or_reason(ds.image_loader, img) == f"unreadable image {img}: image file is truncated"
    with pytest.raises(ImageError, match="is not a valid file name"):
        check_image(img + "\0")


def test_text_no_tokenizer_or_template_takes_is_a_bad_record(sample_dir, tmp_path, capfd):
    """Half an emoji (a lone surrogate, valid JSON) and a chat template that raises (roles that must
    alternate) make bad records, named; they do not stop the run."""
    records = [dict(HELLO, id="good"),
               {"id": "cut_emoji", "conversations": [{"from": "human", "value": "hi \ud83d"},
                                                     {"from": "gpt", "value": "yes ."}]}]
    raw = llava_raw(sample_dir, write_records(tmp_path, records), shuffle=False, packing=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    assert ds.plan(1).record_ids == [["good"]] and ds.plan(1).skipped_samples == 1
    assert "record 'cut_emoji': conversations[0].value is not valid Unicode text (a lone surrogate at character 3)" \
        in capfd.readouterr().err

    from mimo.data import llava

    enc = ds.encoder
    tok = enc.tok

    def refuse(*args, **kwargs):  # a template's raise_exception, as jinja raises it
        raise Exception("Conversation roles must alternate user/assistant/user/assistant/...")

    original = tok.apply_chat_template
    try:
        tok.apply_chat_template = refuse
        with pytest.raises(llava.BadRecord, match="^the chat template refuses the conversation: Exception: "
                                                  "Conversation roles must alternate"):
            enc._template_segments([("user", "a"), ("user", "b"), ("assistant", "c")])
    finally:
        tok.apply_chat_template = original


def test_error_mode_names_the_record(sample_dir, tmp_path):
    from mimo.data.llava import DataError

    raw = llava_raw(sample_dir, write_records(tmp_path, bad_records(tmp_path, sample_dir)), shuffle=False,
                    packing=False, on_bad_record="error")
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    ds.plan(0)
    with pytest.raises(DataError) as exc:
        ds.plan(1)
    assert str(exc.value).startswith("error: data.path: record 'missing': image not found")
    assert "\n" not in str(exc.value)


def test_error_mode_cli_one_line_exit_2(sample_dir, tmp_path):
    import yaml

    raw = llava_raw(sample_dir, write_records(tmp_path, bad_records(tmp_path, sample_dir)), shuffle=False,
                    packing=False, on_bad_record="error")
    raw["training"].update(global_batch_size=2, micro_batch_size=1, train_iters=2)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pretrain_mimo.py"), "--config",
                        str(cfg_path), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2, r.stderr
    assert errors == ["error: data.path: record 'missing': image not found: " + str(tmp_path / "nope.png")]
    assert "Traceback" not in r.stderr


def test_sampler_resume_gives_the_uninterrupted_samples(sample_dir):
    raw = llava_raw(sample_dir)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    whole = dataset(raw)
    full = [whole.plan(s) for s in range(12)]  # 12 steps of 4 packed sequences: more than one epoch
    assert whole.sampler.epoch >= 1
    first = dataset(raw)
    for s in range(3):
        first.plan(s)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores (plain JSON)
    resumed = dataset(raw)
    resumed.load_state_dict(state)
    for s in range(3, 12):
        got = resumed.plan(s)
        assert got.record_ids == full[s].record_ids
        for a, b in zip(got.samples, full[s].samples):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    # Negative control: another seed is another order.
    other = dataset({**raw, "data": {**raw["data"], "seed": 1}})
    assert other.plan(0).record_ids != full[0].record_ids


def test_config_errors(sample_dir):
    def problems(raw):
        with pytest.raises(ConfigError) as exc:
            load_config(raw)
        return str(exc.value)

    raw = llava_raw(sample_dir)
    del raw["data"]["path"]
    assert "error: data.path: required" in problems(raw)
    raw = llava_raw(sample_dir, path="/nonexistent.json")
    assert "error: data.path: no such file" in problems(raw)
    raw = llava_raw(sample_dir)
    raw["model"]["language"]["vocab_size"] = 32  # the sample tokenizer has 72 tokens
    raw["data"]["seq_length"] = 24
    assert "error: data.tokenizer: vocabulary of 72 tokens does not fit" in problems(raw)
    raw = llava_raw(sample_dir)
    tok_file = os.path.join(sample_dir, "tokenizer", "tokenizer.json")
    raw["data"]["tokenizer"] = tok_file  # the file, not its directory
    assert f"error: data.tokenizer: {tok_file} is a file; name the HF tokenizer directory" in problems(raw)
    raw = llava_raw(sample_dir)
    raw["model"]["language"]["attention"] = "sdpa"
    assert "error: data.packing: needs model.language.attention: bitfield" in problems(raw)
    del raw["model"]["language"]["attention"]  # packing with no attention named: bitfield, its one choice
    assert raw["data"]["packing"] and load_config(raw).model.language.attention == "bitfield"
    raw["data"]["packing"] = False
    assert load_config(raw).model.language.attention == "sdpa"
    raw = llava_raw(sample_dir, on_bad_record="ignore")
    assert "error: data.on_bad_record: must be one of skip, error" in problems(raw)


# -- layouts -------------------------------------------------------------------------------------

def _train_counting_decodes(raw, steps):
    """record_run on this rank, plus how many images this rank decoded and whether it holds the LLM only."""
    from mimo.data import images
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.parity import record_run

    calls = []
    original = images.ImageLoader.__call__
    images.ImageLoader.__call__ = lambda self, path: calls.append(path) or original(self, path)
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    out = record_run(trainer, steps)
    out["decoded"] = len(calls)
    out["llm_only"] = set(trainer.parts) == {"language"}
    return out


def _run_packed(raw, world):
    from mimo.runtime import run_on_ranks

    from mimo.training.parity import merge_ranks

    results = run_on_ranks(_train_counting_decodes, world, raw, 1)
    return merge_ranks(results), results


@pytest.fixture(scope="module")
def packed_reference(sample_dir):
    ref, ref_ranks = _run_packed(llava_raw(sample_dir), 1)
    assert ref_ranks[0]["decoded"] > 0
    return ref


# The colocated layout runs with -m slow; the non-colocated one keeps packed LLaVA parity (and the rule
# that LLM-only ranks decode no image) in the default run.
@pytest.mark.parametrize("parallelism,world", [
    ({"language": {"dp": 2}, "images": {"rank_offset": 2}}, 3),
    pytest.param({"language": {"tp": 2}, "images": {"dp": 2}}, 2, marks=pytest.mark.slow),
], ids=["noncolocated", "colocated"])
def test_layouts_match_one_rank_on_packed_llava(sample_dir, packed_reference, parallelism, world):
    from mimo.training.parity import compare

    raw = llava_raw(sample_dir)
    raw["parallelism"] = parallelism
    got, ranks = _run_packed(raw, world)
    report = compare(packed_reference, got, 1e-4)
    assert report["ok"], report
    for r in ranks:  # LLM-only ranks never decode an image; encoder ranks do
        assert (r["decoded"] == 0) == r["llm_only"], [(x["decoded"], x["llm_only"]) for x in ranks]
    # Negative control: the criterion sees a 1e-3 relative change of the losses.
    other = dict(packed_reference, losses=[x * (1 + 1e-3) for x in packed_reference["losses"]])
    assert not compare(packed_reference, other, 1e-4)["ok"]


def test_prefetching_loader_gives_the_same_items_and_position(sample_dir):
    from mimo.data.llava_dataset import sample_items

    raw = llava_raw(sample_dir, num_workers=2)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    ahead, inline = dataset(raw), dataset({**raw, "data": {**raw["data"], "num_workers": 0}})
    # this rank's encoders consume samples 1 and 3 of each step
    ahead.prefetch(lambda step: sample_items(ahead, step, [1, 3], ["images"]))
    for step in range(3):
        state = torch.get_rng_state()
        ahead.sample(step * 4)  # starts the step's loader: torch's global generator is left alone
        assert torch.equal(torch.get_rng_state(), state)
        for j in range(4):
            a, b = ahead.sample(step * 4 + j), inline.sample(step * 4 + j)
            assert torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.items["images"], b.items["images"])
        # Workers planned steps ahead; the checkpointed position is still the trainer's.
        assert ahead._next_step > step + 1
        assert ahead.state_dict() == inline.state_dict()
    # The prefetched images were used: the samples the rank consumes needed no decode here.
    assert set(ahead._decoded) == {("images", p) for j in (1, 3) for p in ahead.plan(2).samples[j].items.paths["images"]}


# -- megatron-energon ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def energon_dir(tmp_path_factory):
    pytest.importorskip("megatron.energon")
    out = str(tmp_path_factory.mktemp("energon"))
    assert make_sample_data.main([out, "--records", "24", "--image-size", "16", "--energon"]) == 0
    return out


@pytest.mark.parametrize("kind", ["captioning", "vqa"])
def test_energon_dataset_trains_on_llava_records_and_resumes(energon_dir, kind, monkeypatch):
    from mimo.data import collate, energon

    monkeypatch.setattr(energon, "REFRESH_EVERY", 3)  # resume from energon's own state, then replay
    raw = llava_raw(energon_dir, path=os.path.join(energon_dir, f"energon_{kind}"), kind="energon")
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    cfg = load_config(raw)
    ds = dataset(raw)
    b = collate([ds.sample(0)], cfg.placeholder_ids)
    tok = ds.encoder.tok
    text = tok.decode([t for t in b["input_ids"][0].tolist() if t != cfg.placeholder_ids["images"]])
    prompt = "USER : ASSISTANT :" if kind == "captioning" else "USER : what"
    assert text.startswith("<s> " + prompt), text
    answers = tok.decode(b["labels"][0][b["loss_mask"][0].bool()].tolist())
    assert answers.startswith("a ") and answers.endswith("background . </s>"), answers
    assert b["images"].shape[0] == b["images_counts"][0] == int((b["input_ids"][0] == cfg.placeholder_ids["images"]).sum()) // 4
    for s in range(3):
        ds.plan(s)
    state = ds.state_dict()
    assert state["sampler"]["energon"] is not None  # a real energon loader state is part of the position
    full = [ds.plan(s).record_ids for s in range(3, 7)]
    resumed = dataset(raw)
    resumed.load_state_dict(state)
    assert [resumed.plan(s).record_ids for s in range(3, 7)] == full


def test_energon_loader_workers_end_when_the_source_reopens_or_closes(energon_dir):
    """energon's workers are persistent and its loader is in a reference cycle: a source that reopens
    (a resume, a rewind after a failed plan-ahead) or closes ends the workers it started itself.
    Left to the garbage collector, workers that ignore the stop signal made the rank's exit wait."""
    import multiprocessing

    from mimo.data.energon import EnergonSource

    def workers():
        return {p for p in multiprocessing.active_children() if p.is_alive()}

    before = workers()
    src = EnergonSource(os.path.join(energon_dir, "energon_captioning"), seed=0, shuffle=False, num_workers=1)
    first = src.record(src.peek())
    started = workers() - before
    assert started, "the loader should run a worker process"
    src.load_state_dict(src.state_dict())  # reopened where it was
    assert not any(p.is_alive() for p in started)
    assert src.record(src.peek()) == first  # the same position: nothing consumed before the rewind
    src.close()
    assert workers() - before == set()


def test_energon_config_errors(energon_dir):
    raw = llava_raw(energon_dir, path=energon_dir, kind="energon")
    with pytest.raises(ConfigError, match="error: data.path: .* is not a prepared energon dataset"):
        load_config(raw)
    raw = llava_raw(energon_dir, path=os.path.join(energon_dir, "nope"), kind="energon")
    with pytest.raises(ConfigError, match="error: data.path: no such directory: .*nope"):
        load_config(raw)


def test_metrics_of_both_kinds(sample_dir):
    raw = llava_raw(sample_dir)
    m = dataset(raw).metrics(0)
    assert m["skipped_samples"] == 0 and 0.5 < m["packing_efficiency"] <= 1.0
    mock = copy.deepcopy(TINY)
    m = dataset(mock).metrics(0)
    assert m["skipped_samples"] == 0 and 0.5 < m["packing_efficiency"] < 1.0  # mock samples are right-padded
    ids = torch.stack([s.input_ids for s in dataset(mock).global_batch(0)])
    assert m["packing_efficiency"] == pytest.approx(float((ids != 0).float().mean()), rel=1e-6)
    # The samples a rank already made for the step are not made again for its metrics.
    ds, made = dataset(mock), []
    sample = ds.sample
    ds.sample = lambda i: made.append(i) or sample(i)
    G = mock["training"]["global_batch_size"]
    ds.global_batch(1)
    assert 0.5 < ds.metrics(1)["packing_efficiency"] < 1.0 and made == list(range(G, 2 * G))
    ds.metrics(2)  # nothing made yet for step 2: made here
    assert made[G:] == list(range(2 * G, 3 * G)) and ds.skipped_samples(2) == 0


def test_the_data_position_kept_per_step_does_not_grow_with_the_run(sample_dir):
    """One position a planned step is kept only while a save or a replay can ask for it; the position
    where the next step starts is still there (the checkpoint's)."""
    raw = llava_raw(sample_dir)
    ds = dataset(raw)
    G = raw["training"]["global_batch_size"]
    for step in range(12):
        ds.sample(step * G)
        ds.plan(step + 1)  # the read-ahead
    assert sorted(ds._starts) == [10, 11, 12, 13] and ds.state_dict()["step"] == 12
    assert ds.state_dict(12) == ds._starts[12]


def _train_with_data_restart(raw, steps, restart_at):
    """Losses of `steps` steps; at `restart_at` the dataset is replaced by a fresh one restored from
    the old one's state_dict (what a resume does with the checkpointed data position)."""
    from mimo.data import build_dataset
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    losses = []
    for s in range(steps):
        if s == restart_at:
            state = json.loads(json.dumps(trainer.dataset.state_dict(s)))  # where step s starts
            trainer.dataset = build_dataset(cfg)
            trainer.dataset.load_state_dict(state)
        losses.append(trainer.train_step(s).loss)
    return losses


def test_training_resumes_the_data_position_bit_identically(sample_dir):
    from mimo.runtime import run_on_ranks

    raw = llava_raw(sample_dir, num_workers=1)
    raw["training"].update(global_batch_size=4, micro_batch_size=2)
    straight = run_on_ranks(_train_with_data_restart, 1, raw, 3, -1)[0]
    resumed = run_on_ranks(_train_with_data_restart, 1, raw, 3, 2)[0]
    assert resumed == straight  # bit-identical, FP32 on CPU


@pytest.mark.slow  # three 2-rank runs with checkpoints: ~90-160 s on 2 shared cores
def test_checkpoint_resume_continues_with_the_uninterrupted_samples(sample_dir, tmp_path):
    """A packed `kind: llava` run (2 ranks: LLM on rank 0, tower on rank 1, Adam) saved at step 2 and
    resumed with `training.load` sees the samples the uninterrupted run saw: the resumed steps'
    losses and the final weights are bit-identical (the data position is in the checkpoint)."""
    from checkpoint_harness import train, with_ckpt

    from mimo.checkpoint import paths

    raw = llava_raw(sample_dir)
    raw["parallelism"] = {"language": {}, "images": {"rank_offset": 1}}
    raw["training"].update(global_batch_size=4, micro_batch_size=2, train_iters=4, optimizer="adam", lr=0.01)
    ref_dir = str(tmp_path / "ref")
    straight = train(with_ckpt(raw, save=ref_dir, save_interval=2))
    resumed = train(with_ckpt(raw, save=str(tmp_path / "resumed"), load=paths.iter_dir(ref_dir, 2)))
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["params"].keys() == straight["params"].keys()
    for k, v in straight["params"].items():
        assert torch.equal(resumed["params"][k], v), k
    # Negative control: the same checkpoint with its data position rewound to the first record (the
    # step left at 2) trains on other samples, so the saved position is what the resume follows.
    import shutil

    from mimo.checkpoint.checks import COMMON, META
    from mimo.checkpoint.manifest import write_manifest

    rewound = str(tmp_path / "rewound" / "iter_0000002")
    shutil.copytree(paths.iter_dir(ref_dir, 2), rewound)
    common = torch.load(os.path.join(rewound, COMMON), weights_only=False)
    assert common[META]["data"]["step"] == 2
    common[META]["data"]["sampler"].update(epoch=0, index=0)
    torch.save(common, os.path.join(rewound, COMMON))
    os.remove(os.path.join(rewound, "manifest.json"))
    write_manifest(rewound)
    other = train(with_ckpt(raw, load=rewound))
    assert other["start"] == 2 and other["losses"] != straight["losses"][2:]


def _train_tampered(raw, tamper_rank, how):
    """The losses of `train_iters` steps on this rank, or the error it stops with. On `tamper_rank`:
    `bad`: one record of step 0 is taken for bad before planning (as a rank that read another copy of
    the file would); `eio`: planning step 1 fails with a read error (on the loading thread)."""
    import errno

    import torch.distributed as dist

    from mimo.data.images import MediaReadError
    from mimo.data.llava import DataError
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    if dist.get_rank() == tamper_rank and how == "bad":
        trainer.dataset.bad[trainer.dataset.sampler.peek()] = "tampered"
    if dist.get_rank() == tamper_rank and how == "eio":
        digest = trainer.dataset.plan_digest

        def failing(step):
            if step == 1:
                raise MediaReadError(errno.EIO, "reading x.png failed: Input/output error")
            return digest(step)

        trainer.dataset.plan_digest = failing
    losses = []
    try:
        for step in range(raw["training"]["train_iters"]):
            losses.append(trainer.train_step(step).loss)
    except (DataError, MediaReadError) as exc:
        return str(exc)
    return losses


def test_ranks_that_plan_different_steps_stop_with_one_error(sample_dir):
    """Before a step's data moves, the ranks compare digests of their plans: a rank that planned another
    step (one record it took for bad that the others did not) stops every rank with the same line
    instead of posting sends and receives its peers do not expect. A rank whose planning fails (a read
    error, on the thread that loads the next step) still takes part in the comparison, so every rank
    stops instead of waiting for it. Control: the same run untouched."""
    from mimo.runtime import run_on_ranks

    raw = llava_raw(sample_dir)
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"rank_offset": 2}}
    raw["training"]["train_iters"] = 2
    good = run_on_ranks(_train_tampered, 3, raw, None, None, timeout_s=120)
    assert all(len(x) == 2 and all(isinstance(v, float) for v in x) for x in good), good
    bad = run_on_ranks(_train_tampered, 3, raw, 1, "bad", timeout_s=120)
    assert len(set(bad)) == 1 and bad[0].startswith(
        "error: data: the ranks planned different samples for step 0: every rank must read the same records"), bad
    eio = run_on_ranks(_train_tampered, 3, raw, 1, "eio", timeout_s=120)
    assert eio[1] == "[Errno 5] reading x.png failed: Input/output error", eio
    assert eio[0] == eio[2] == "error: data: another rank failed to plan step 1 (its own error line names the cause)"


def _energon_changed(energon_dir, root, changes: dict) -> str:
    """energon_captioning with tar members changed (name -> new bytes, or None: left out), prepared
    again in `root`."""
    import contextlib
    import io
    import tarfile

    from megatron.energon.cli.main import main as energon_cli

    os.makedirs(root)
    with tarfile.open(os.path.join(energon_dir, "energon_captioning", "shard-000000.tar")) as tin, \
            tarfile.open(os.path.join(root, "shard-000000.tar"), "w") as tout:
        for m in tin.getmembers():
            data = changes.get(m.name, tin.extractfile(m).read())
            if data is not None:
                m.size = len(data)
                tout.addfile(m, io.BytesIO(data))
    with contextlib.redirect_stdout(io.StringIO()):
        energon_cli(["prepare", str(root), "--non-interactive", "--split-parts", "train:shard-{000000..000000}.tar",
                     "--sample-type", "CaptioningSample", "--field-map", json.dumps({"image": "png", "caption": "txt"}),
                     "--no-progress", "--num-workers", "1"], standalone_mode=False)
    return str(root)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_energon_sample_energon_cannot_load_is_named_once_or_stops_the_run(energon_dir, tmp_path, capfd,
                                                                             monkeypatch, workers):
    """A sample whose caption file is missing from its tar: energon cannot make it. Under `skip` it is
    left out of the stream and named once in one line (before: energon's traceback and the raw sample
    at every pass, 26 tracebacks in 10 steps); under `error` the stream stops at it with one line,
    also when energon's loader worker met it."""
    from mimo.data import energon
    from mimo.data.llava import DataError

    path = _energon_changed(energon_dir, tmp_path / "broken", {"cap0005.txt": None})
    line = "data.path: energon sample shard-000000.tar/cap0005: FieldAccessError: Cannot access 'txt'"
    import tarfile

    with tarfile.open(os.path.join(path, "shard-000000.tar")) as tar:
        left = {m.name[:-4] for m in tar.getmembers() if m.name.endswith(".txt")}
    assert "cap0005" not in left and len(left) > 10
    monkeypatch.setattr(energon, "_warned", set())
    src = energon.EnergonSource(path, 0, True, workers, None, "skip")
    ids = []
    for _ in range(3 * len(left)):  # three passes over the samples left
        ids.append(src.record(src.peek())["id"])
        src.advance()
    src.close()
    assert set(ids) == left
    err = capfd.readouterr().err
    assert [x for x in err.splitlines() if "cap0005" in x] == [
        f"warning: {line}; skipped (energon drops it, so skipped_samples does not count it)"], err
    src = energon.EnergonSource(path, 0, True, workers, None, "error")
    with pytest.raises(DataError) as exc:
        for _ in range(len(left) + 1):
            src.peek()
            src.advance()
    src.close()
    assert str(exc.value) == f"error: {line}"


def test_an_energon_dataset_without_a_train_split_is_a_config_error(energon_dir, tmp_path):
    import shutil

    root = tmp_path / "val_only"
    shutil.copytree(os.path.join(energon_dir, "energon_captioning"), root)
    (root / ".nv-meta" / "split.yaml").write_text("split_parts:\n  val:\n  - shard-000000.tar\nexclude: []\n")
    with pytest.raises(ConfigError, match=r"data.path: .*val_only has no 'train' split to train on \(.* has: val\)"):
        load_config(llava_raw(energon_dir, path=str(root), kind="energon"))


def test_an_energon_record_with_a_bad_image_is_named_once_by_its_sample(energon_dir, tmp_path, capfd):
    """A streamed record comes back at a new stream position every pass: its skipping warning is
    still printed once (before: at every pass, each time with another `<_io.BytesIO object at 0x...>`)."""
    path = _energon_changed(energon_dir, tmp_path / "bad_image", {"cap0009.png": b"not an image"})
    raw = llava_raw(energon_dir, path=path, kind="energon")
    ds = dataset(raw)
    capfd.readouterr()
    for s in range(12):  # 96 records: several passes over the dataset
        ds.plan(s)
    lines = [x for x in capfd.readouterr().err.splitlines() if "cap0009" in x]
    assert lines == ["warning: data: skipping record 'cap0009': unreadable image (12 bytes inline): cannot identify "
                     "image file"], lines
    assert ds.skipped > 2  # still counted at every pass


def test_resuming_from_a_records_file_that_changed_is_refused_before_the_load(sample_dir, tmp_path):
    """The data position counts records of one file: a file with a record appended, or one line
    rewritten (the same count), is refused before the checkpoint's tensors load, naming data.path
    (before: appending went unnoticed until after the load, `ValueError: ... num_records=8`; a rewrite
    resumed into other records). Loading the weights only (load_optimizer: false) still works."""
    from checkpoint_harness import resume_errors, train, with_ckpt

    from mimo.checkpoint import paths

    img = os.path.join(sample_dir, "images", "img0000.png")
    records = [dict(RED, id=f"red{i}", image=img) if i % 2 else dict(HELLO, id=f"hello{i}") for i in range(8)]
    path = write_records(tmp_path, records)
    raw = llava_raw(sample_dir, path, packing=False)
    raw["training"].update(global_batch_size=2, micro_batch_size=1, train_iters=1)
    saved = str(tmp_path / "ckpt")
    train(with_ckpt(raw, save=saved))
    resume = with_ckpt(raw, load=paths.iter_dir(saved, 1))
    assert resume_errors(resume) == [None]  # control: the same file resumes
    with open(path, "a") as f:
        f.write("\n" + json.dumps(dict(HELLO, id="appended")))
    (err,) = resume_errors(resume)
    assert err == (f"data.path: {path}: it holds 9 records, the checkpoint's data position 8; resuming the data "
                   "position needs the same records (training.load_optimizer: false loads the weights only and "
                   "starts the data afresh)")
    write_records(tmp_path, records[:7] + [dict(HELLO, id="rewritten")])
    (err,) = resume_errors(resume)
    assert err.startswith(f"data.path: {path}: its contents changed since the checkpoint was saved; resuming")
    assert resume_errors(with_ckpt(resume, load_optimizer=False)) == [None]


def test_the_global_order_is_each_epochs_seeded_permutation():
    """Epoch e's order is torch.randperm seeded by (seed, e) (kept as an int64 array, 8 bytes a record),
    or the file order without shuffle; a position restores exactly."""
    import torch

    from mimo.data.sampler import GlobalSampler

    s = GlobalSampler(5, seed=3)
    drawn = []
    for _ in range(10):
        drawn.append(s.peek())
        s.advance()
    expected = [torch.randperm(5, generator=torch.Generator().manual_seed(3 * 1_000_003 + e)).tolist() for e in (0, 1)]
    assert drawn == expected[0] + expected[1] and expected[0] != expected[1]
    assert all(type(i) is int for i in drawn)
    again = GlobalSampler(5, seed=3)
    again.load_state_dict(s.state_dict())
    assert (again.epoch, again.index, again.peek()) == (2, 0, s.peek())
    plain, order = GlobalSampler(3, seed=3, shuffle=False), []
    for _ in range(4):
        order.append(plain.peek())
        plain.advance()
    assert order == [0, 1, 2, 0]


@pytest.mark.parametrize("workers", [0, 1])
def test_an_energon_dataset_where_every_sample_fails_is_one_error_line(energon_dir, tmp_path, monkeypatch, workers):
    """Every caption missing: energon gives up after 100 failures in a row with a FatalSampleError whose
    message holds a raw sample (a traceback before, from the loader or its worker); now one line naming
    the dataset."""
    import tarfile

    from mimo.data import energon
    from mimo.data.llava import DataError

    with tarfile.open(os.path.join(energon_dir, "energon_captioning", "shard-000000.tar")) as tar:
        captions = {m.name: None for m in tar.getmembers() if m.name.endswith(".txt")}
    path = _energon_changed(energon_dir, tmp_path / "no_captions", captions)
    expected = (f"error: data.path: {path}: energon could not load 100 samples in a row and gave up: the dataset "
                "or its field map (.nv-meta/dataset.yaml) is broken")
    src = energon.EnergonSource(path, 0, True, workers, None, "skip")
    with pytest.raises(DataError) as exc:
        src.peek()
    src.close()
    assert str(exc.value) == expected
    assert list(src.share(0, 1)) == []  # indexing reads each sample once: none loads, and the stream says why
    if workers == 0:  # a dataset large enough for energon to give up while a rank indexes its share
        import megatron.energon
        from megatron.energon.errors import FatalSampleError

        def gives_up(dataset):
            raise FatalSampleError("Sample x failed: MapDataset.load failed 100 times in a row. Likely ...")
            yield  # a generator, as energon's loader is iterated

        monkeypatch.setattr(megatron.energon, "get_loader", gives_up)
        with pytest.raises(DataError) as exc:
            list(src.share(0, 1))
        assert str(exc.value) == expected
