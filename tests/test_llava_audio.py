"""Audio records in LLaVA-format data: `<audio>` expansion and labels token by token, the log-mel
features against transformers' Whisper feature extractor, every bad audio record, and FP32 parity
of one rank vs a non-colocated layout whose ranks each decode only their own encoder's items."""

import copy
import json
import os
import sys
import wave

import numpy as np
import pytest
import torch

from mimo.config import load_config
from tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_sample_data  # noqa: E402

# TINY's audio encoder: 16 frames of 8 mel bins, 4 frames per token -> 4 tokens per clip;
# 16 frames of 10 ms at 16 kHz: clips of 640 (one token) to 2560 samples.
WINDOW, MIN = 16 * 160, 4 * 160


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("llava_audio"))
    assert make_sample_data.main([out, "--records", "16", "--image-size", "16", "--audio", "8"]) == 0
    return out


def audio_raw(data_dir, path=None, **data):
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["data"] = {"kind": "llava", "path": path or os.path.join(data_dir, "train.json"), "image_root": data_dir,
                   "tokenizer": os.path.join(data_dir, "tokenizer"), "seq_length": 48, "packing": True, **data}
    return raw


def dataset(raw):
    from mimo.data import build_dataset

    return build_dataset(load_config(raw))


def write_wav(path, samples, rate=16000, width=2, channels=1):
    """int samples [n, channels] (already scaled to `width` bytes) -> a PCM WAV file."""
    data = np.asarray(samples, dtype=np.int64).reshape(-1, channels)
    if width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in data.reshape(-1))
    else:
        raw = data.astype({1: np.uint8, 2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return str(path)


def tone(n, freq=440.0, amp=0.5):
    return np.round(32767 * amp * np.sin(2 * np.pi * freq * np.arange(n) / 16000)).astype(np.int64)


def write_records(tmp_path, records):
    path = str(tmp_path / "records.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    return path


def hear(clip, answer="a loud high tone .", rid="hear"):
    return {"id": rid, "audio": clip, "conversations": [
        {"from": "human", "value": "<audio>\nwhat do you hear ?"}, {"from": "gpt", "value": answer}]}


def test_audio_expansion_labels_and_features_token_by_token(sample_dir, tmp_path):
    from transformers import WhisperFeatureExtractor

    from mimo.data import collate

    a = tone(1500)
    clip = write_wav(tmp_path / "a.wav", a)
    both = {"id": "both", "image": "images/img0000.png", "audio": str(clip), "conversations": [
        {"from": "human", "value": "<audio>\nhello <image>\nwhat shape ?"}, {"from": "gpt", "value": "a red square ."}]}
    raw = audio_raw(sample_dir, write_records(tmp_path, [hear(clip), both]), shuffle=False, packing=False)
    raw["training"].update(global_batch_size=2, micro_batch_size=1)
    cfg = load_config(raw)
    ds = dataset(raw)
    tok = ds.encoder.tok
    I, A = cfg.placeholder_ids["images"], cfg.placeholder_ids["audio"]
    t = lambda s: tok.convert_tokens_to_ids(s.split())  # noqa: E731
    # <s>USER: <audio>\nwhat do you hear ?\nASSISTANT: a loud high tone .</s>: the clip's 4 tokens at the tag.
    hear_ids = t("<s> USER :") + [A] * 4 + t("what do you hear ? ASSISTANT : a loud high tone . </s>")
    hear_t = [0] * 14 + [1] * 6
    # Tags in text order: audio first, then the image, each its own encoder's placeholder run.
    both_ids = t("<s> USER :") + [A] * 4 + t("hello") + [I] * 4 + t("what shape ? ASSISTANT : a red square . </s>")
    both_t = [0] * 17 + [1] * 5
    b = collate([ds.sample(0), ds.sample(1)], cfg.placeholder_ids)
    assert b["input_ids"][0].tolist() == hear_ids + [0] * (48 - len(hear_ids))
    assert b["input_ids"][1].tolist() == both_ids + [0] * (48 - len(both_ids))
    for row, targets in ((0, hear_t), (1, both_t)):
        loss = [float(x) for x in targets[1:]] + [0.0] * (48 - len(targets) + 1)
        assert b["loss_mask"][row].tolist() == loss  # no placeholder and no prompt token is a target
    assert b["audio_counts"].tolist() == [1, 1] and b["images_counts"].tolist() == [0, 1]
    # Features: transformers' Whisper log-mel at the encoder's mel bins, padded to its 16 frames, [frames, mels].
    fe = WhisperFeatureExtractor(feature_size=8)
    ref = fe(a / 32768.0, sampling_rate=16000, max_length=WINDOW, padding="max_length",
             return_tensors="pt")["input_features"][0].T
    assert b["audio"].shape == (2, 16, 8)
    torch.testing.assert_close(b["audio"][0], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(b["audio"][0], b["audio"][1])  # the same clip
    # Other PCM layouts decode to the same samples: 24-bit stereo (both channels equal) and 8-bit.
    loader = ds.audio_loader
    wide = write_wav(tmp_path / "w.wav", np.repeat(a[:, None] * 256, 2, axis=1), width=3, channels=2)
    torch.testing.assert_close(loader(wide), ref, rtol=1e-5, atol=1e-5)
    narrow = write_wav(tmp_path / "n.wav", np.zeros(800, dtype=np.int64) + 128, width=1)
    assert torch.equal(loader(narrow), loader(write_wav(tmp_path / "z.wav", np.zeros(800))))


def riff(fmt: bytes, data: bytes, data_size=None, extra=b"") -> bytes:
    """A WAV file's bytes from its format chunk's body and its samples (`data_size`: the size field)."""
    size = len(data) if data_size is None else data_size
    body = (b"WAVE" + b"fmt " + len(fmt).to_bytes(4, "little") + fmt + extra
            + b"data" + size.to_bytes(4, "little") + data)
    return b"RIFF" + len(body).to_bytes(4, "little") + body


def test_wav_headers_the_standard_library_refuses(sample_dir, tmp_path):
    """The extensible header (24-bit PCM, as converters write it) and a streaming writer's unknown data
    size decode to the same features as the plain file; a header whose sizes run past the file or that
    is not PCM is a bad record with its reason (Python 3.11's `wave` raised an empty RuntimeError)."""
    import struct

    from mimo.data.audio import AudioError

    loader = dataset(audio_raw(sample_dir)).audio_loader
    a = tone(1500) * 256  # 24-bit
    plain = write_wav(tmp_path / "plain.wav", a, width=3)
    pcm = open(plain, "rb").read()[44:]
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 48000, 3, 24)
    pcm_guid = bytes.fromhex("0100000000001000800000aa00389b71")
    extensible = struct.pack("<HHIIHH", 0xFFFE, 1, 16000, 48000, 3, 24) + struct.pack("<HHI", 22, 24, 4) + pcm_guid
    odd_chunk = b"LIST" + (3).to_bytes(4, "little") + b"abc\0"  # an odd-sized chunk and its pad byte
    odd_fmt = riff(fmt + b"\0", pcm)  # a 17-byte format chunk, then its pad byte
    odd_fmt = odd_fmt[:36] + b"\0" + odd_fmt[36:]
    good = {"extensible": riff(extensible, pcm), "streamed": riff(fmt, pcm, data_size=0xFFFFFFFF),
            "odd_chunk": riff(fmt, pcm, extra=odd_chunk), "odd_fmt": odd_fmt}
    for name, content in good.items():
        (tmp_path / f"{name}.wav").write_bytes(content)
        loader.check(str(tmp_path / f"{name}.wav"))
        assert torch.equal(loader(str(tmp_path / f"{name}.wav")), loader(plain)), name
    float_guid = bytes.fromhex("0300000000001000800000aa00389b71")
    bad = {"past_the_end": (riff(fmt, pcm, data_size=len(pcm) + 30), "truncated (header says 1510 samples)"),
           "float": (riff(extensible[:24] + float_guid, pcm), "an extensible format that is not integer PCM"),
           "a_law": (riff(struct.pack("<HHIIHH", 6, 1, 16000, 16000, 1, 8), pcm), "unknown format: 6"),
           "fmt_too_big": (riff(fmt, pcm)[:16] + (0xFFFFFFF0).to_bytes(4, "little") + riff(fmt, pcm)[20:],
                           "a format chunk of 4294967280 bytes"),
           "no_fmt": (b"RIFF\x04\x00\x00\x00WAVE" + b"data" + len(pcm).to_bytes(4, "little") + pcm,
                      "the samples come before the format chunk"),
           "odd_block": (riff(struct.pack("<HHIIHH", 1, 2, 16000, 96000, 4, 24), pcm),
                         "frames of 4 bytes for 2 channel(s) of 24-bit samples")}
    for name, (content, reason) in bad.items():
        (tmp_path / f"{name}.wav").write_bytes(content)
        with pytest.raises(AudioError) as exc:
            loader.check(str(tmp_path / f"{name}.wav"))
        assert reason in str(exc.value) and f"{name}.wav" in str(exc.value), (name, str(exc.value))
    os.mkfifo(tmp_path / "pipe.wav")  # opened, it would wait for a writer (on every rank)
    with pytest.raises(AudioError, match="^audio is not a regular file: .*pipe.wav$"):
        loader.check(str(tmp_path / "pipe.wav"))
    # Every cut and every changed header byte of a good file: a verdict (or a good clip), never another error.
    for k in range(len(good["extensible"][:90])):
        for content in (good["extensible"][:k], good["extensible"][:k] + b"\xff" + good["extensible"][k + 1:]):
            (tmp_path / "fuzz.wav").write_bytes(content)
            try:
                loader.check(str(tmp_path / "fuzz.wav"))
            except AudioError:
                pass


def test_hf_audio_encoder_uses_its_saved_feature_extractor(tmp_path):
    from types import SimpleNamespace

    from transformers import WhisperFeatureExtractor

    from mimo.data.audio import AudioError, AudioLoader
    from mimo.data.llava import DataError

    hf = tmp_path / "whisper"
    # A saved extractor unlike the defaults (5 ms hop): its window and features are the ones used.
    WhisperFeatureExtractor(feature_size=8, hop_length=80).save_pretrained(hf)
    enc = SimpleNamespace(hf=str(hf), num_mel_bins=8, clip_frames=16, frames_per_token=2)
    loader = AudioLoader(enc)
    assert (loader.rate, loader.max_samples, loader.min_samples) == (16000, 16 * 80, 2 * 80)
    a = tone(1000)
    with pytest.raises(AudioError, match="too long"):
        loader.check(write_wav(tmp_path / "long.wav", tone(16 * 80 + 1)))
    (tmp_path / "empty.wav").write_bytes(b"")  # a reason, not an empty one
    with pytest.raises(AudioError, match="empty.wav: ends inside its header \\(PCM WAV expected\\)$"):
        loader.check(str(tmp_path / "empty.wav"))
    clip = write_wav(tmp_path / "a.wav", a)
    loader.check(clip)
    ref = WhisperFeatureExtractor.from_pretrained(hf)(a / 32768.0, sampling_rate=16000, max_length=16 * 80,
                                                       return_tensors="pt")["input_features"][0].T
    torch.testing.assert_close(loader(clip), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(DataError, match=r"^error: model.encoders.audio.num_mel_bins: 4, but the feature extractor"):
        AudioLoader(SimpleNamespace(hf=str(hf), num_mel_bins=4, clip_frames=16, frames_per_token=2))


def bad_audio_records(tmp_path):
    good = write_wav(tmp_path / "good.wav", tone(1000))
    (tmp_path / "garbage.wav").write_bytes(b"RIFF this is not a wave file at all")
    with open(good, "rb") as f:
        (tmp_path / "cut.wav").write_bytes(f.read()[:-500])  # the header promises 1000 samples
    return [
        hear(good, rid="good1"),
        hear(str(tmp_path / "nope.wav"), rid="missing"),
        hear(str(tmp_path / "garbage.wav"), rid="garbage"),
        hear(str(tmp_path / "cut.wav"), rid="truncated"),
        hear(write_wav(tmp_path / "long.wav", tone(WINDOW + 1)), rid="toolong"),
        hear(write_wav(tmp_path / "short.wav", tone(MIN - 1)), rid="tooshort"),
        hear(write_wav(tmp_path / "rate.wav", tone(1000), rate=44100), rid="rate"),
        {"id": "tag_without_audio", "conversations": hear(good)["conversations"]},
        {"id": "audio_without_tag", "audio": good, "conversations": [
            {"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes ."}]},
        {"id": "two_tags_one_clip", "audio": [good], "conversations": [
            {"from": "human", "value": "<audio> <audio>"}, {"from": "gpt", "value": "yes ."}]},
        hear(good, rid="good2"),
    ]


REASONS = {"missing": "audio not found", "garbage": "unreadable audio", "truncated": "truncated",
           "toolong": "too long: 0.160 s, the encoder's window is 0.160 s", "tooshort": "too short: 639 samples",
           "rate": "sample rate 44100 Hz, expected 16000 Hz", "tag_without_audio": "1 `<audio>` tag(s) but 0 audio",
           "audio_without_tag": "0 `<audio>` tag(s) but 1 audio", "two_tags_one_clip": "2 `<audio>` tag(s) but 1"}


def test_every_bad_audio_record_is_skipped_and_named(sample_dir, tmp_path, capfd):
    raw = audio_raw(sample_dir, write_records(tmp_path, bad_audio_records(tmp_path)), shuffle=False, packing=False)
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    assert ds.plan(0).record_ids == [["good1"]]
    assert ds.plan(1).record_ids == [["good2"]] and ds.plan(1).skipped_samples == len(REASONS)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning: data:")]
    assert len(lines) == len(REASONS)
    for rid, reason in REASONS.items():
        (line,) = [ln for ln in lines if f"record {rid!r}" in ln]
        assert reason in line, line
    # A model without an audio encoder skips audio records, naming the reason.
    records = [hear(str(tmp_path / "good.wav")), {"id": "text", "conversations": [
        {"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes ."}]}]
    no_audio = audio_raw(sample_dir, write_records(tmp_path, records), shuffle=False, packing=False)
    no_audio["training"].update(global_batch_size=1, micro_batch_size=1)
    del no_audio["model"]["encoders"]["audio"], no_audio["parallelism"]["audio"]
    ds = dataset(no_audio)
    assert ds.plan(0).record_ids == [["text"]]
    assert ds.bad[0] == "has audio clip(s) but the model has no audio encoder"


def test_bad_audio_record_error_mode_names_it(sample_dir, tmp_path):
    from mimo.data.llava import DataError

    raw = audio_raw(sample_dir, write_records(tmp_path, bad_audio_records(tmp_path)), shuffle=False, packing=False,
                    on_bad_record="error")
    raw["training"].update(global_batch_size=1, micro_batch_size=1)
    ds = dataset(raw)
    ds.plan(0)
    with pytest.raises(DataError) as exc:
        ds.plan(1)
    assert str(exc.value) == f"error: data.path: record 'missing': audio not found: {tmp_path / 'nope.wav'}"


def test_prefetch_decodes_only_the_held_encoders_items(sample_dir):
    raw = audio_raw(sample_dir, num_workers=2)
    raw["training"].update(global_batch_size=4, micro_batch_size=1)
    ahead, inline = dataset(raw), dataset({**raw, "data": {**raw["data"], "num_workers": 0}})
    from mimo.data.llava_dataset import sample_items

    # a rank holding the audio encoder only
    ahead.prefetch(lambda step: sample_items(ahead, step, [0, 1, 2, 3], ["audio"]))
    seen = 0
    for step in range(3):
        for j in range(4):
            a, b = ahead.sample(step * 4 + j), inline.sample(step * 4 + j)
            assert torch.equal(a.items["audio"], b.items["audio"])
        clips = {("audio", p) for j in range(4) for p in ahead.plan(step).samples[j].items.paths["audio"]}
        assert set(ahead._decoded) == clips  # decoded ahead in the workers: this step's clips, no image
        seen += len(clips)
    assert seen > 0


def test_one_audio_encoder_per_llava_dataset(sample_dir):
    from mimo.config import ConfigError

    raw = audio_raw(sample_dir)
    raw["model"]["encoders"]["speech"] = dict(raw["model"]["encoders"]["audio"])
    raw["parallelism"]["speech"] = {}
    with pytest.raises(ConfigError, match="error: model.encoders: data.kind llava feeds its audio clips to one audio "
                                          "encoder, found 2"):
        load_config(raw)


# -- layouts -------------------------------------------------------------------------------------

def _train_counting_decodes(raw, steps, silent_too=False):
    """record_run on this rank, plus which encoders' items it decoded; `silent_too`: also train a
    fresh model on the same data with every clip decoded as silence (the negative control)."""
    from mimo.data import audio, images
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.parity import record_run

    img, aud = images.ImageLoader.__call__, audio.AudioLoader.__call__
    silence = lambda self, p: aud(self, os.path.join(os.path.dirname(p), "..", "silence.wav"))  # noqa: E731

    def run(decode_audio):
        calls = {"images": 0, "audio": 0}

        def count(name, original):
            def call(self, path):
                calls[name] += 1
                return original(self, path)
            return call

        images.ImageLoader.__call__, audio.AudioLoader.__call__ = count("images", img), count("audio", decode_audio)
        trainer = Trainer(load_config(raw), select_runtime("cpu"))
        out = record_run(trainer, steps)
        out["decoded"], out["parts"] = calls, sorted(trainer.parts)
        return out

    out = run(aud)
    if silent_too:
        out["silent"] = run(silence)
    return out


def test_noncolocated_audio_layout_matches_one_rank(sample_dir):
    from mimo.runtime import run_on_ranks
    from mimo.training.parity import compare, merge_ranks

    write_wav(os.path.join(sample_dir, "silence.wav"), np.zeros(MIN))
    base = audio_raw(sample_dir)
    base["training"].update(global_batch_size=4, micro_batch_size=2)
    assert any(r.startswith("aud") for s in dataset(base).plan(0).record_ids for r in s)
    # Every module on its own rank.
    noncol = copy.deepcopy(base)
    noncol["parallelism"] = {"language": {}, "images": {"rank_offset": 1}, "audio": {"rank_offset": 2}}

    def run(raw, world, silent_too=False):
        results = run_on_ranks(_train_counting_decodes, world, raw, 1, silent_too)
        return merge_ranks(results), results

    ref, (one,) = run(base, 1, silent_too=True)
    assert one["decoded"]["audio"] > 0 and one["decoded"]["images"] > 0
    got, ranks = run(noncol, 3)
    report = compare(ref, got, 1e-4)
    assert report["ok"], report
    # Each rank decodes only the items of the encoders it holds: LLM ranks open no media file.
    for r in ranks:
        assert [n for n in ("images", "audio") if r["decoded"][n]] == [n for n in ("images", "audio")
                                                                       if n in r["parts"]], r["parts"]
    # Negative control: with every clip replaced by silence the criterion fails (the audio is used).
    silent = dict(ref, **{k: one["silent"][k] for k in ("losses", "grads", "params")})
    assert not compare(ref, silent, 1e-4)["ok"]
