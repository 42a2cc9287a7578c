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
    """`error`: only the encoder rank that decodes the cut JPEG can find it. It trains the step with
    zeros in its place and flags it in the step's loss sum, so every rank stops after that step
    with exit code 2 on its own, with no launcher to stop the others: that rank names the record,
    rank 0 says another rank failed, the third rank says nothing more. Started by hand (no torchrun):
    when the rank raised at once, the others waited in the step for it until gloo reset them."""
    from checkpoint_harness import start_by_hand, wait_all

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_raw(data_dir, "bad.json", on_bad_record="error")))
    procs, outs = start_by_hand([sys.executable, SCRIPT, "--config", str(cfg), "--device", "cpu"], 3,
                                str(tmp_path), {**os.environ, "PYTHONPATH": ROOT, "MIMO_DEBUG": ""})
    codes, text = wait_all(procs, outs, timeout_s=240)
    assert codes == [2, 2, 2], (codes, [t[-2000:] for t in text])
    errors = [[line for line in t.splitlines() if line.startswith("error:")] for t in text]
    named = [r for r in (1, 2) if errors[r]]
    assert len(named) == 1, errors
    assert len(errors[named[0]]) == 1 and "record 'truncated-jpeg'" in errors[named[0]][0]
    assert "cut.jpg" in errors[named[0]][0], errors
    assert errors[0] == ["error: data: step 3: 1 media item(s) failed to decode on other ranks (under "
                         "data.on_bad_record: error, or a filesystem read error; the ranks that decoded them name "
                         "the records)"], errors
    assert errors[3 - named[0]] == [], errors
    # Every rank trained steps 1 and 2 (rank 0 prints them) and stopped in step 3, before it was logged.
    assert [line.split()[1] for line in text[0].splitlines() if line.startswith("step ")] == ["1", "2"], text[0]
    assert not any(f'File "{ROOT}/mimo' in t for t in text)  # no traceback


def _steps_until_media_error(raw):
    """Train until the MediaError: (the step it came after, whether this rank decoded the bad item, its text)."""
    from mimo.data.llava import MediaError
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    for step in range(STEPS):
        try:
            trainer.train_step(step)
        except MediaError as exc:
            return step, exc.own, str(exc)
    return None


def test_a_truncated_image_under_error_stops_every_homogeneous_rank_after_its_step(data_dir):
    """The same on a homogeneous layout (data parallel 2, each rank decoding its own samples' images):
    both ranks raise after step 3 (index 2), one of them naming the record."""
    raw = _raw(data_dir, "bad.json", on_bad_record="error")
    raw["parallelism"] = {"language": {"dp": 2}, "images": {"dp": 2}}
    out = run_on_ranks(_steps_until_media_error, 2, raw, timeout_s=300, daemon=False)
    assert [o[0] for o in out] == [2, 2], out
    assert sorted(o[1] for o in out) == [False, True], out
    own = next(o[2] for o in out if o[1])
    assert "record 'truncated-jpeg'" in own and "cut.jpg" in own, out
