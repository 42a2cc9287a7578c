"""Metrics: JSONL records, FLOP formula (hand counts), timeline trace and pictures, writers, progress bar."""

import copy
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from mimo.attention.mask import CAUSAL, LOW
from mimo.config import build_config, load_config, validate
from mimo.data import Sample
from mimo.training.flops import StepWork, attention_pairs, module_flops, peak_tflops, step_work
from mimo.training.metrics import Progress, missing_packages

from tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
TIMELINE = os.path.join(ROOT, "tools", "timeline.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def cfg_of(raw):
    cfg, problems = build_config(copy.deepcopy(raw))
    assert not problems, problems
    return cfg


# -- FLOP formula against hand counts ----------------------------------------------------------------

TEXT_ONLY = {"model": {"language": dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                                        ffn_hidden_size=16, vocab_size=10, max_sequence_length=8)},
             "parallelism": {"language": {}}, "data": {"seq_length": 4},
             "training": {"global_batch_size": 2}}


def test_flops_text_only_hand_count():
    cfg = cfg_of(TEXT_ONLY)
    work = StepWork(samples=2, positions=8, tokens=7, items={}, llm_attention_pairs=2 * (4 * 5 // 2))
    # per position and layer: QKV 2*8*(2*4 + 2*1*4) = 256, out proj 2*8*8 = 128, MLP 4*8*16 = 512 -> 896
    layers = 2 * 8 * 896
    attn = 2 * 4 * 20 * 8            # layers * 4 * pairs * hidden
    head = 2 * 8 * 8 * 10            # LM head over 8 positions
    f = module_flops(cfg, work)["language"]
    assert f.forward == layers + attn + head
    # trainable LLM: weight grads (= matmul forward) + input grads (matmul forward + 2x attention core)
    assert f.backward == (layers + head) + (layers + head + 2 * attn)


def test_flops_frozen_encoder_hand_count():
    raw = copy.deepcopy(TEXT_ONLY)
    raw["model"]["encoders"] = {"images": dict(kind="vision", num_layers=1, hidden_size=4, num_attention_heads=1,
                                               ffn_hidden_size=8, image_size=4, patch_size=2, frozen=True,
                                               projector={"kind": "linear"})}
    raw["model"]["language"]["frozen"] = True
    raw["parallelism"]["images"] = {}
    cfg = cfg_of(raw)
    work = StepWork(samples=2, positions=8, tokens=8, items={"images": 3}, llm_attention_pairs=40)
    flops = module_flops(cfg, work)
    t = 4  # tokens per image
    stem = 2 * 3 * t * (3 * 2 * 2) * 4                      # patch conv: C p^2 -> 4
    layer = 3 * t * (2 * 4 * 12 + 2 * 4 * 4 + 4 * 4 * 8)    # QKV (1 group = MHA), proj, MLP
    attn = 4 * (3 * t * t) * 4
    proj = 2 * 3 * t * 4 * 8
    enc = flops["images"]
    assert enc.forward == stem + layer + attn + proj
    assert enc.backward == proj      # frozen encoder: only the projector's weight gradient
    llm = flops["language"]
    lin = 2 * 8 * 896 + 2 * 8 * 8 * 10
    attn_l = 2 * 4 * 40 * 8
    assert llm.backward == lin + 2 * attn_l  # frozen LLM, trainable projector: input gradients only
    # negative control: with the projector frozen too nothing upstream trains and the LLM backward is 0
    raw["model"]["encoders"]["images"]["projector"]["frozen"] = True
    raw["model"]["language"]["frozen"] = False
    f2 = module_flops(cfg_of(raw), work)
    assert f2["images"].backward == 0 and f2["language"].backward > 0


def test_bitfield_pairs_match_dense_mask():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (3, 17), generator=g)
    text = CAUSAL | 1 | (1 << 1)
    bits = torch.where(ids == 0, 0, torch.where(ids == 1, 1 << 1, torch.where(ids == 2, 1 << 2, text)))
    low = bits & LOW
    pos = torch.arange(17)
    causal = (pos[None, None, :] <= pos[None, :, None]) & ((low[:, :, None] & low[:, None, :]) != 0)
    bidir = (low[:, :, None] == low[:, None, :]) & (low[:, :, None] != 0)
    dense = torch.where((bits[:, :, None] & CAUSAL) != 0, causal, bidir)
    assert attention_pairs(bits) == int(dense.sum())


def _allowed_pairs(bits, docs):
    """The attention contract's own dense mask (mimo.attention.inputs), counted."""
    from mimo.attention.inputs import allowed_matrix, check_inputs
    b, s = bits.shape
    x = torch.zeros(b, s, 1, 1)
    return int(allowed_matrix(check_inputs(x, x, x, bits, bits, None, None, docs, docs)).sum())


@pytest.mark.parametrize("seed", range(4))
def test_bitfield_pairs_keep_packed_documents_apart(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (3, 29), generator=g)
    text = CAUSAL | 1 | (1 << 1)
    bits = torch.where(ids == 0, 0, torch.where(ids == 1, 1 << 1, torch.where(ids == 2, 1 << 2, text)))
    # Packed documents: runs of random length, padding (-1) at the end; the
    # last case reuses an id out of order, which the mask still treats as one document.
    cuts = torch.sort(torch.randint(1, 29, (3, 4), generator=g), dim=1).values
    docs = (torch.arange(29)[None, :, None] >= cuts[:, None, :]).sum(-1)
    docs[:, 25:] = -1
    docs[2, 3:6] = docs[2, 20]
    bits = bits.masked_fill(docs < 0, 0)
    assert attention_pairs(bits, docs) == _allowed_pairs(bits, docs)
    assert attention_pairs(bits) == _allowed_pairs(bits, None) > attention_pairs(bits, docs)


def test_step_work_counts_packed_documents_apart():
    # Two documents of 4 tokens packed in one 8-token sample: 2 x 10 causal
    # pairs, not the 36 of one 8-token sequence; padding (-1) counts nothing,
    # and token id 0 inside a document is a real token.
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"   # what data.packing needs
    cfg = cfg_of(raw)
    ids = torch.tensor([7, 0, 7, 7, 7, 7, 7, 7, 0, 0])
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, -1, -1])
    s = Sample(ids, {"images": torch.zeros(0, 3, 8, 8), "audio": torch.zeros(0)}, document_ids=docs)
    w = step_work(cfg, [s])
    assert (w.tokens, w.llm_attention_pairs) == (8, 2 * 4 * 5 // 2)


def test_step_work_counts_tokens_items_and_causal_pairs():
    cfg = cfg_of(TINY)
    s = Sample(torch.tensor([5, 6, 0, 0] + [7] * 44), {"images": torch.zeros(2, 3, 8, 8), "audio": torch.zeros(0)})
    w = step_work(cfg, [s, s])
    assert (w.tokens, w.positions, w.items) == (2 * 46, 96, {"images": 4, "audio": 0})
    assert w.llm_attention_pairs == 2 * 48 * 49 // 2


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert peak_tflops("NVIDIA H100 NVL") == 835 and peak_tflops("NVIDIA H100 PCIe") == 756
    assert peak_tflops(None) is None and peak_tflops(None, 100.0) == 100.0


# -- config, progress bar ------------------------------------------------------------------------------

def test_config_fields_validated():
    raw = copy.deepcopy(TINY)
    raw["training"].update(peak_tflops=-1, timeline="t.json", timeline_step=9)
    cfg, problems = build_config(raw)
    paths = {p for p, _ in validate(cfg, 1)}
    assert {"training.peak_tflops", "training.timeline_step"} <= paths


def test_missing_writer_package_is_a_config_error():
    raw = copy.deepcopy(TINY)
    raw["training"]["wandb_project"] = "x"
    problems = missing_packages(cfg_of(raw))
    try:
        import wandb  # noqa: F401
        assert problems == []
    except ImportError:
        assert problems and problems[0][0] == "training.wandb_project" and "wandb" in problems[0][1]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal():
    plain = io.StringIO()
    p = Progress(3, plain)
    p.step(1.5, "step 1 | loss 1.5000")
    p.close()
    assert plain.getvalue() == "step 1 | loss 1.5000\n"
    tty = _Tty()
    p = Progress(3, tty)
    p.step(1.5, "step 1 | loss 1.5000")
    p.close()
    out = tty.getvalue()
    assert "step 1 | loss 1.5000" in out and "1/3" in out and "loss 1.5000" in out and "\r" in out


# -- end to end on CPU ranks -----------------------------------------------------------------------------

KEYS = {"step": int, "loss": float, "grad_norm": float, "lr": float, "tokens": int, "samples": int,
        "step_time_s": float, "tokens_per_s": float, "tflops_per_gpu": float, "max_memory_gb": float,
        "skipped_samples": int, "module_time_s": dict, "boundary_time_s": dict, "packing_efficiency": float}


def test_run_writes_jsonl_trace_tensorboard_and_pictures(tmp_path):
    cfg = os.path.join(ROOT, "examples", "configs", "cpu_mixed_placement.yaml")
    trace, log, tb = tmp_path / "trace.json", tmp_path / "m.jsonl", tmp_path / "tb"
    # The example's mixed placement squeezed onto 2 ranks (cheap): LLM and images colocated on rank 0,
    # audio on rank 1 (a non-colocated edge).
    small = ["parallelism.language.tp=1", "parallelism.language.dp=1", "parallelism.images.dp=1",
             "parallelism.audio.tp=1", "parallelism.audio.rank_offset=1"]
    r = subprocess.run(TORCHRUN + ["--nproc-per-node", "2", SCRIPT, "--config", cfg, "--device", "cpu",
                                   "--set", "training.train_iters=2", "--set", f"training.timeline={trace}",
                                   "--set", f"training.tensorboard_dir={tb}", "--set", "training.lr_warmup_iters=1",
                                   "--log-json", str(log)]
                       + [a for kv in small for a in ("--set", kv)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    # plain lines (stdout is a pipe): the old shape plus TFLOPS/GPU, MFU, memory; no progress bar
    lines = re.findall(r"^step (\d) \| loss [\d.]+ \| tokens/s \d+ \| step_time [\d.]+ ms \| tokens/s/rank \d+ \| "
                       r"grad_norm [\d.]+ \| TFLOPS/GPU \S+ \| MFU n/a \| mem [\d.]+ GB$", r.stdout, re.M)
    assert lines == ["1", "2"], r.stdout
    assert "\r" not in r.stdout and "it/s" not in r.stdout
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    # The schedule's lr each step trained with: one warmup step from 0, then the configured lr.
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == load_config(cfg).training.lr
    for row in rows:
        for key, tp in KEYS.items():
            assert isinstance(row[key], tp), (key, row[key])
        assert row["mfu"] is None  # CPU: peak unknown
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(row["tokens"], rel=1e-12)
        assert set(row["module_time_s"]) == {"images", "audio", "language"}
        assert all(v > 0 for v in row["module_time_s"].values())
        assert row["boundary_time_s"]["audio"] > 0  # non-colocated edge
        assert row["skipped_samples"] == 0 and row["samples"] == 8 and row["tflops_per_gpu"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(2))
    assert {e["args"]["module"] for e in spans} == {"images", "audio", "language"}
    assert all(e["dur"] >= 0 and e["name"] == f"{e['args']['module']} {e['args']['action']} {e['args']['microbatch']}"
               for e in spans)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    png = tmp_path / "t.png"
    r = subprocess.run([sys.executable, TIMELINE, str(trace), "--out", str(png)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulated_timeline_png(tmp_path):
    png = tmp_path / "sim.png"
    cfg = os.path.join(ROOT, "examples", "configs", "cpu_mixed_placement.yaml")
    r = subprocess.run([sys.executable, TIMELINE, "--simulate", cfg, "--gpu", "cpu", "--out", str(png)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = subprocess.run([sys.executable, TIMELINE, "--out", str(png)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ")
    rows = tmp_path / "run.jsonl"  # a --log-json file given for the trace: named, one line
    rows.write_text('{"step": 1}\n{"step": 2}\n')
    r = subprocess.run([sys.executable, TIMELINE, str(rows), "--out", str(png)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {rows}: not a Chrome trace (invalid JSON: "), r.stderr


def test_wandb_offline_run_holds_the_step_scalars(tmp_path, monkeypatch):
    """training.wandb_project with WANDB_MODE=offline: a local run file, no network. wandb is the
    optional `metrics` extra, so CI (which installs `test` only) skips this; with wandb installed it runs."""
    pytest.importorskip("wandb")
    from mimo.training.metrics import MetricsWriters

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    raw = copy.deepcopy(TINY)
    raw["training"]["wandb_project"] = "mimo-test"
    cfg, problems = build_config(raw)
    assert not problems
    writers = MetricsWriters(cfg)
    for step in (1, 2):
        writers.write({"step": step, "loss": 1.0 / step, "mfu": None, "module_time_s": {"language": 0.1}})
    writers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
