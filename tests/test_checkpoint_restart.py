"""A worker SIGKILLed under `torchrun --max-restarts 1` resumes from `latest` and ends bit-identical."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import torch
import yaml

from checkpoint_harness import children, command_line, layout, process_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
STEPS = 4  # the kill lands after the checkpoint of step 2 or 3, so at least one step is trained again


def _torchrun(config, d, log, restarts, out):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), SCRIPT, "--config", config, "--device", "cpu",
            "--set", f"training.save={d}", "--set", f"training.load={d}", "--set", "training.save_interval=1",
            "--log-json", log]
    # Output to a file: helper processes of megatron-core's checkpoint writer may outlive the
    # workers and would keep a pipe open.
    return subprocess.Popen(args, stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)


def _rank_pid(launcher: int, rank: int):
    """The worker of `rank` among the launcher's children (torchrun sets RANK in its environment)."""
    for pid in children(launcher):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _final(d, out):
    """The last checkpoint's full weights, through the convert command (one process)."""
    subprocess.run([sys.executable, "-m", "mimo.checkpoint", "convert", d, "--to-torch", out], check=True,
                   env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True)
    return torch.load(out)


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
    ref_out = str(tmp_path / "ref.out")
    p = _torchrun(config, ref_dir, ref_log, 0, ref_out)
    assert p.wait(timeout=600) == 0, open(ref_out).read()[-3000:]

    d, log = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    run_out = str(tmp_path / "run.out")
    p = _torchrun(config, d, log, 1, run_out)
    killed = False
    deadline = time.time() + 600
    while p.poll() is None and time.time() < deadline and not killed:
        latest = os.path.join(d, "latest")
        step = int(open(latest).read().strip() or 0) if os.path.exists(latest) else 0
        if 2 <= step < STEPS:  # mid-run, after a checkpoint: kill rank 1 the hard way
            pid = _rank_pid(p.pid, 1)
            if pid:
                # The helper processes of both ranks (megatron-core's writer queue manager, the
                # resource tracker): rank 1 is killed, rank 0 stopped by torchrun, and neither
                # may leave its helpers running (mimo/checkpoint/writer_helper.py).
                helpers = children(pid) + children(_rank_pid(p.pid, 0))
                what = {h: command_line(h)[:200] for h in helpers}  # named in a failure message
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.05)
    assert p.wait(timeout=600) == 0, open(run_out).read()[-3000:]
    out = open(run_out).read()
    assert killed, out[-3000:]
    # The queue managers (mimo/checkpoint/writer_helper.py) must die with their ranks. Python's resource
    # tracker beside each exits only once every process holding its pipe has: in two of about ten
    # full-suite runs one outlived the 90 s below, before the writers a rank forks were tied to it too
    # (the holder was not identified; a forked writer is the likely one). It is waited for and then
    # removed, but not asserted on.
    managers = [h for h in helpers if "resource_tracker" not in what[h]]
    deadline = time.time() + 90
    while any(map(process_alive, helpers)) and time.time() < deadline:
        time.sleep(0.2)
    survivors = {h: what[h] for h in helpers if process_alive(h)}
    for h in survivors:  # leave no orphans
        try:
            os.kill(h, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert managers and not [h for h in managers if h in survivors], (what, survivors)
    assert "resumed from" in out
    assert _losses(log) == _losses(ref_log)
    got, ref = _final(d, str(tmp_path / "run.pt")), _final(ref_dir, str(tmp_path / "ref.pt"))
    assert got.keys() == ref.keys()
    for m in ref:
        for k in ref[m]:
            assert torch.equal(got[m][k], ref[m][k]), f"{m}.{k}"


def test_a_save_killed_mid_write_leaves_latest_valid(tmp_path):
    """One rank saving every step is SIGKILLed while a checkpoint is still `iter_N.partial`:
    `latest` names the previous complete checkpoint, which passes every check and resumes."""
    from mimo.checkpoint import paths, preflight
    from mimo.config import load_config

    raw = layout()
    raw["training"]["train_iters"] = 200
    config = str(tmp_path / "run.yaml")
    yaml.safe_dump(raw, open(config, "w"))
    d = str(tmp_path / "ck")
    p = subprocess.Popen([sys.executable, SCRIPT, "--config", config, "--device", "cpu",
                          "--set", f"training.save={d}", "--set", "training.save_interval=1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    killed_during = None
    deadline = time.time() + 300
    try:
        while p.poll() is None and time.time() < deadline:
            # One listing for both: two could see step N's partial directory and then, after its
            # rename, step N complete without `latest` yet (the kill would land between the two).
            names = os.listdir(d) if os.path.isdir(d) else []
            partial = [n for n in names if n.endswith(".partial")]
            if partial and any(re.fullmatch(r"iter_\d{7,}", n) for n in names):  # a save after a complete one
                os.killpg(p.pid, signal.SIGKILL)  # the worker and its helpers, mid-write
                killed_during = partial[0]
                break
            time.sleep(0.002)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert killed_during, "no save was caught in progress"
    latest = paths.read_latest(d)
    assert os.path.basename(paths.iter_dir(d, latest)) + ".partial" != killed_during
    assert latest == max(paths.complete_steps(d))
    raw["training"].update(load=d, save=d)
    assert preflight(load_config(raw)) == paths.iter_dir(d, latest)  # files, sizes and config all check out
    r = subprocess.run([sys.executable, "-m", "mimo.checkpoint", "inspect", d], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 0 and f"step {latest}" in r.stdout, r.stderr[-2000:]
