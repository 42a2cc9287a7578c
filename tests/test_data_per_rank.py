"""Each rank loads only its own share of a step's data, and bad media never stop a run under `skip`.

Counted from outside the data pipeline: Pillow's pixel decoders (`PIL.Image._getdecoder`, which
`ImageFile.load` asks for each time it decodes a file's pixels; reading a header asks for none) are
counted in every rank. The layout is the one where every rank used to decode every image: the LLM alone on rank 0,
the vision encoder at DP 2 on ranks 1-2 (non-colocated).
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from mimo.config import load_config
from mimo.runtime import run_on_ranks
from tiny import TINY

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import make_sample_data  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
RECORDS, G, STEPS = 40, 8, 5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """40 one-image records (images and tokenizer from make_sample_data), and a truncated JPEG."""
    from PIL import Image

    out = str(tmp_path_factory.mktemp("per_rank"))
    assert make_sample_data.main([out, "--records", "48", "--image-size", "16"]) == 0
    records = [{"id": f"r{i:02d}", "image": f"images/img{i:04d}.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat is it ?"}, {"from": "gpt", "value": "a red square ."}]}
        for i in range(RECORDS)]
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(records, f)
    # A JPEG whose header is valid but whose data stops half way.
    jpeg = os.path.join(out, "images", "cut.jpg")
    Image.effect_noise((128, 128), 60).convert("RGB").save(jpeg, quality=95)  # noise: mostly pixel data
    data = open(jpeg, "rb").read()
    open(jpeg, "wb").write(data[:len(data) // 2])
    bad = copy.deepcopy(records)
    bad[19]["image"] = "images/cut.jpg"  # consumed in step 3 (samples 16-23)
    bad[19]["id"] = "truncated-jpeg"
    with open(os.path.join(out, "bad.json"), "w") as f:
        json.dump(bad, f)
    return out


def _raw(data_dir, path="train.json", **data):
    raw = copy.deepcopy(TINY)
    del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
    raw["data"] = {"kind": "llava", "path": os.path.join(data_dir, path),
                   "tokenizer": os.path.join(data_dir, "tokenizer"), "seq_length": 48, "packing": False, **data}
    raw["training"].update(global_batch_size=G, micro_batch_size=2, train_iters=STEPS)
    raw["parallelism"] = {"language": {}, "images": {"dp": 2, "rank_offset": 1}}
    return raw


def _count_decodes(raw):
    """This rank's Pillow pixel decodes over the run, and the bad-media count the trainer reports."""
    from PIL import Image

    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    from mimo.data.llava import ConversationEncoder

    calls, encoded, tokenised = [], [], []
    getdecoder = Image._getdecoder
    Image._getdecoder = lambda *a, **k: calls.append(1) or getdecoder(*a, **k)
    encode = ConversationEncoder.encode  # tokenises the record (and, unless `checked`, checks its media headers)

    def spy(self, record, index, *a, **k):
        (tokenised if k.get("checked") else encoded).append(index)
        return encode(self, record, index, *a, **k)

    ConversationEncoder.encode = spy
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    # What the read-ahead (data.num_workers > 0) would decode: the same items.
    ahead = sum(len(trainer._prefetched(s)) for s in range(STEPS)) if trainer.decoding else 0
    results = [trainer.train_step(s) for s in range(STEPS)]
    return {"decodes": len(calls), "ahead": ahead, "encoded": encoded, "tokenised": tokenised,
            "losses": [r.loss for r in results]}


def test_each_image_is_decoded_once_by_the_encoder_rank_that_encodes_it(data_dir):
    out = run_on_ranks(_count_decodes, 3, _raw(data_dir), timeout_s=300, daemon=False)
    decodes = [r["decodes"] for r in out]
    assert decodes[0] == 0, decodes  # the LLM-only rank decodes no media
    assert sum(decodes) == RECORDS, decodes  # each of the 40 images exactly once (was 120)
    assert abs(decodes[1] - decodes[2]) <= 2 * STEPS, decodes  # encoder DP ranks: about half each
    assert [r["ahead"] for r in out] == decodes  # the read-ahead lists exactly the items each rank decodes
    # The record index: each record is tokenised and header-checked once, by one rank (was: by every rank).
    indexed = [i for r in out for i in r["encoded"]]
    assert sorted(indexed) == list(range(RECORDS)), [r["encoded"] for r in out]
    assert all(abs(len(r["encoded"]) - RECORDS / 3) < 1 for r in out), [r["encoded"] for r in out]
    # Tokens for training: the LLM rank (DP 1) tokenises every record it trains on, once; the encoder
    # ranks, which never read a token, none.
    assert sorted(out[0]["tokenised"]) == list(range(RECORDS)), out[0]["tokenised"]
    assert out[1]["tokenised"] == out[2]["tokenised"] == [], [r["tokenised"] for r in out]


def _torchrun(cfg_path, *extra):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           SCRIPT, "--config", str(cfg_path), "--device", "cpu", *extra], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT, "MIMO_DEBUG": ""}, cwd=ROOT, timeout=300)


def test_truncated_image_is_skipped_named_and_counted(data_dir, tmp_path):
    """`skip`: every step trains, the record is named once (by the rank that decoded it) and the
    `--log-json` rows count it from step 3 on (cumulative)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_raw(data_dir, "bad.json", on_bad_record="skip")))
    log = tmp_path / "log.jsonl"
    r = _torchrun(cfg, "--log-json", str(log))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["bad_media"] for row in rows] == [0, 0, 1, 1, 1]
    assert r.stderr.count("record 'truncated-jpeg'") == 1, r.stderr[-3000:]


def test_truncated_image_stops_every_rank_under_error(data_dir, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_raw(data_dir, "bad.json", on_bad_record="error")))
    r = _torchrun(cfg)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "record 'truncated-jpeg'" in errors[0] and "cut.jpg" in errors[0], r.stderr[-3000:]
    assert f'File "{ROOT}/mimo' not in r.stderr  # no traceback from mimo (torchrun prints its own)
