"""A worker SIGKILLed under `torchrun --max-restarts 1` resumes from `latest` and ends bit-identical."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
import yaml

from checkpoint_harness import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
STEPS = 4


def _torchrun(config, d, log, restarts):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), SCRIPT, "--config", config, "--device", "cpu",
            "--set", f"training.save={d}", "--set", f"training.load={d}", "--set", "training.save_interval=1",
            "--log-json", log]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)


def _rank_pid(launcher: int, rank: int):
    """The worker of `rank` among the launcher's children (torchrun sets RANK in its environment)."""
    kids = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    for pid in kids:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def _final(d):
    from mimo.checkpoint.convert import full_weights

    return full_weights(d)


def _losses(log):
    by_step = {}
    for line in open(log):
        rec = json.loads(line)
        by_step[rec["step"]] = rec["loss"]  # a resumed step logged again replaces the first record
    return [by_step[s] for s in sorted(by_step)]


def test_killed_worker_restarts_from_latest_and_matches_an_uninterrupted_run(tmp_path):
    raw = layout(images=dict(rank_offset=1), audio=dict(rank_offset=1))
    raw["training"]["train_iters"] = STEPS
    config = str(tmp_path / "run.yaml")
    yaml.safe_dump(raw, open(config, "w"))

    ref_dir, ref_log = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    p = _torchrun(config, ref_dir, ref_log, 0)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]

    d, log = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    p = _torchrun(config, d, log, 1)
    killed = False
    deadline = time.time() + 600
    while p.poll() is None and time.time() < deadline:
        if not killed and os.path.exists(os.path.join(d, "latest")) and open(os.path.join(d, "latest")).read().strip() == "2":
            agent = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                                    text=True).stdout.split()]
            pid = _rank_pid(p.pid, 1) or next((q for a in agent for q in [_rank_pid(a, 1)] if q), None)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.2)
    out, _ = p.communicate(timeout=60)
    assert killed, out[-3000:]
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(log) == _losses(ref_log)
    got, ref = _final(d), _final(ref_dir)
    assert got.keys() == ref.keys()
    for m in ref:
        for k in ref[m]:
            assert torch.equal(got[m][k], ref[m][k]), f"{m}.{k}"
