"""examples/pretrain_mimo.py end to end under torchrun on CPU ranks."""

import os
import re
import signal
import subprocess
import sys
import time

from checkpoint_harness import children

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
DEMO = os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_demo_trains_and_logs_every_step():
    r = subprocess.run(TORCHRUN + [SCRIPT, "--config", DEMO, "--device", "cpu", "--set", "training.train_iters=8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^step (\d+) \| loss ([\d.]+) \| tokens/s (\d+) \| step_time ([\d.]+) ms", r.stdout, re.M)
    assert [int(s[0]) for s in steps] == list(range(1, 9)), r.stdout  # one line per step, rank 0 only
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0]


def test_bad_config_exits_2_with_one_line_per_problem():
    r = subprocess.run(TORCHRUN + [SCRIPT, "--config", DEMO, "--set", "training.lr=-1", "--set", "parallelism.language.tp=3"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert any(l.startswith("error: training.lr:") for l in errors), r.stderr
    assert any(l.startswith("error: parallelism.language.tp:") for l in errors)
    assert "Traceback" not in r.stderr.split("error: ")[0]


def test_device_cuda_without_cuda_is_a_config_error():
    one_rank = ["--set", "parallelism.language.dp=1", "--set", "parallelism.images.dp=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, SCRIPT, "--config", DEMO, "--device", "cuda"] + one_rank, capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT})
    assert (r.returncode, r.stderr) == (2, "error: --device: cuda was requested but CUDA is not available on this "
                                           "machine\n")


def test_a_log_json_path_that_is_a_directory_is_an_error_before_the_run(tmp_path):
    """Before: the run started and rank 0 died at its first step with an IsADirectoryError."""
    one_rank = ["--set", "parallelism.language.dp=1", "--set", "parallelism.images.dp=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, SCRIPT, "--config", DEMO, "--device", "cpu", "--log-json", str(tmp_path)]
                       + one_rank, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "PYTHONPATH": ROOT})
    assert (r.returncode, r.stderr) == (2, f"error: --log-json: {tmp_path} is a directory; name the file to write\n")


def test_killed_rank_stops_every_rank():
    proc = subprocess.Popen(TORCHRUN + [SCRIPT, "--config", DEMO, "--device", "cpu", "--set", "training.train_iters=100000",
                                        "--set", "training.timeout_minutes=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.time() + 240
        for line in proc.stdout:
            if line.startswith("step 2 |"):
                break
            assert time.time() < deadline, "training never started"
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        rc = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0
    assert all(subprocess.run(["kill", "-0", str(w)], capture_output=True).returncode != 0 for w in workers)
    assert "SIGKILL" in err or "Signal 9" in err, err[-2000:]
