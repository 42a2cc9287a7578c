"""Stopping cleanly before the allocation ends (training.exit_signal_handler, exit_duration_minutes).

* A SIGTERM sent to one rank only of a job started by hand (no launcher): every rank finishes the same
  step, the checkpoint of that step is published, every rank exits 0, and the same command resumes
  from it. Without the agreement in the step's loss all-reduce the other rank would train on alone
  (and wait for its peer forever); without the handler the signalled rank dies.
* exit_duration_minutes: the run stops after the step in which its minutes ran out, with a checkpoint.
* The config rules: the signal's name, a positive duration, both need training.save.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from checkpoint_harness import layout, start_by_hand, wait_all, with_ckpt
from mimo.checkpoint import paths
from mimo.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
ENV = {**os.environ, "PYTHONPATH": ROOT, "MIMO_DEBUG": ""}


def _config(tmp_path, **training):
    raw = with_ckpt(layout(language={"dp": 2}, images={"dp": 2}, audio={"dp": 2}), save=str(tmp_path / "ck"),
                    load=str(tmp_path / "ck"), **training)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return raw, str(path)


def _start(cfg_path, world, tmp_path, *sets):
    args = [sys.executable, SCRIPT, "--config", cfg_path, "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    return start_by_hand(args, world, str(tmp_path), ENV)


def _steps(text):
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]


def _wait_for_steps(proc, out, n, timeout_s=180):
    """Until `proc` has printed `n` step lines (or exited, or `timeout_s` passed)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        out.seek(0)
        if len(_steps(out.read())) >= n:
            return
        time.sleep(0.2)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    raw, cfg = _config(tmp_path, train_iters=100000, exit_signal_handler=True, timeout_minutes=3)
    procs, outs = _start(cfg, 2, tmp_path)
    _wait_for_steps(procs[0], outs[0], 3)
    procs[1].send_signal(signal.SIGTERM)  # rank 1 only; rank 0 learns it in the step's all-reduce
    codes, text = wait_all(procs, outs)
    assert codes == [0, 0], (codes, [t[-3000:] for t in text])
    done = _steps(text[0])[-1]
    assert 3 <= done < 100000
    ck = str(tmp_path / "ck")
    assert paths.read_latest(ck) == done and paths.complete_steps(ck) == [done]
    assert text[0].splitlines()[-1] == (
        f"stopped after step {done} (another rank received its exit signal or passed its deadline): saved "
        f"{paths.iter_dir(ck, done)} (training.load: {ck} resumes it)"), text[0][-2000:]
    assert "Traceback" not in text[0] + text[1]
    # The same command (two more steps) resumes from the stop.
    procs, outs = _start(cfg, 2, tmp_path, f"training.train_iters={done + 2}")
    codes, text = wait_all(procs, outs)
    assert codes == [0, 0], (codes, [t[-3000:] for t in text])
    assert f"resumed from {ck} at step {done}" in text[0] and _steps(text[0]) == [done + 1, done + 2], text[0][-2000:]


@pytest.mark.parametrize("kind", ["llava", "energon"])
def test_a_sigterm_to_torchrun_after_earlier_saves_still_saves_the_stop_step(tmp_path, kind):
    """torchrun signals each worker's whole process group. It holds megatron-core's write-results
    manager from the first save on, and the data workers (`data.num_workers`: the media decode
    workers of `kind: llava`, energon's own loader workers): all must outlive the signal for the
    stop's save (before, that save failed with a BrokenPipeError, and a killed worker failed the
    step). torchrun itself exits 1 (its SignalException)."""
    cfg = _with_data_workers(tmp_path, kind, save_interval=2)
    procs, outs = _torchrun(cfg, tmp_path, "stop")
    _wait_for_steps(procs[0], outs[0], 5)  # saved at steps 2 and 4
    procs[0].send_signal(signal.SIGTERM)
    code, (text,) = wait_all(procs, outs)
    assert code == [1], text[-3000:]  # torchrun's own exit on a signal
    done = _steps(text)[-1]
    ck = str(tmp_path / "ck")
    assert paths.read_latest(ck) == done and done >= 5, text[-3000:]
    assert f"stopped after step {done} (received SIGTERM): saved {paths.iter_dir(ck, done)}" in text, text[-3000:]
    assert "error" not in text.replace("errors", ""), text[-3000:]
    # A run that ends at train_iters exits too: the workers that ignore the signal are ended with the
    # loop (Python's own exit would stop them with SIGTERM and wait for them forever).
    procs, outs = _torchrun(cfg, tmp_path, "resume", f"training.train_iters={done + 2}")
    code, (text,) = wait_all(procs, outs, timeout_s=120)
    assert code == [0], text[-3000:]
    assert _steps(text) == [done + 1, done + 2], text[-3000:]


def test_an_interrupt_that_ends_the_run_ends_the_data_workers_too(tmp_path):
    """Ctrl-C (SIGINT, not the exit signal) raises KeyboardInterrupt: the rank says so in one line and
    exits 130. The data workers, which ignore the exit signal, must still end with the rank: left to
    Python's exit, which stops them with SIGTERM, the rank waited for them forever."""
    cfg = _with_data_workers(tmp_path, "llava", language={"dp": 1}, images={"dp": 1})
    procs, outs = _start(cfg, 1, tmp_path)
    _wait_for_steps(procs[0], outs[0], 3)
    procs[0].send_signal(signal.SIGINT)
    codes, text = wait_all(procs, outs, timeout_s=60)
    assert codes[0] == 130, (codes, text[0][-3000:])
    assert "rank 0: interrupted (SIGINT): the step in progress is not saved" in text[0], text[0][-3000:]
    assert "Traceback" not in text[0], text[0][-3000:]  # one line, not Python's KeyboardInterrupt trace


def _with_data_workers(tmp_path, kind, language={"dp": 2}, images={"dp": 2}, **training):
    """The config of a run that stops on SIGTERM (training.exit_signal_handler) and reads `kind` data
    (llava or energon, sample data written here) with one data worker."""
    if kind == "energon":
        pytest.importorskip("megatron.energon")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_sample_data

    data = str(tmp_path / "data")
    extra = ["--energon"] if kind == "energon" else []
    assert make_sample_data.main([data, "--records", "16", "--image-size", "16", *extra]) == 0
    raw = with_ckpt(layout(language=language, images=images), save=str(tmp_path / "ck"), load=str(tmp_path / "ck"),
                    train_iters=100000, exit_signal_handler=True, timeout_minutes=3, **training)
    del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
    path = os.path.join(data, "energon_captioning") if kind == "energon" else os.path.join(data, "train.json")
    raw["data"] = {"kind": kind, "path": path, "tokenizer": os.path.join(data, "tokenizer"),
                   "seq_length": 48, "packing": False, "num_workers": 1}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return str(cfg)


def _torchrun(cfg_path, tmp_path, name, *sets):
    """torchrun on two ranks (`wait_all` kills it with its ranks). Its wait for
    the ranks after a signal is longer than `wait_all`'s, so a rank that does not exit shows as a
    test failure, not as a kill by torchrun."""
    from mimo.runtime.launch import free_port

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--shutdown-timeout", "600",
            "--master-port", str(free_port()), SCRIPT, "--config", cfg_path, "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    out = open(tmp_path / f"{name}.out", "w+")
    return [subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=ENV)], [out]


def test_exit_duration_stops_after_the_step_in_which_it_ran_out(tmp_path):
    raw, cfg = _config(tmp_path, train_iters=50, exit_duration_minutes=1e-6)
    procs, outs = _start(cfg, 2, tmp_path)
    codes, text = wait_all(procs, outs)
    assert codes == [0, 0], (codes, [t[-3000:] for t in text])
    assert _steps(text[0]) == [1]
    ck = str(tmp_path / "ck")
    assert paths.read_latest(ck) == 1
    assert text[0].splitlines()[-1].startswith("stopped after step 1 (training.exit_duration_minutes passed): saved ")


@pytest.mark.parametrize("fields,field,needle", [
    (dict(exit_signal="SIGKILL", exit_signal_handler=True), "training.exit_signal", "must be one of SIGTERM"),
    (dict(exit_duration_minutes=0), "training.exit_duration_minutes", "must be a positive number"),
    (dict(exit_signal_handler=True, save=None, load=None), "training.exit_signal_handler", "needs training.save"),
    (dict(exit_duration_minutes=5, save=None, load=None), "training.exit_duration_minutes", "needs training.save"),
])
def test_config_rules(tmp_path, fields, field, needle):
    raw = with_ckpt(layout(), save=str(tmp_path / "ck"))
    raw["training"].update(fields)
    with pytest.raises(ConfigError) as exc:
        load_config(raw)
    assert any(p == field and needle in r for p, r in exc.value.problems), exc.value.problems


def test_export_from_a_checkpoint_drops_the_fields_that_need_save(tmp_path):
    """`python -m mimo.hf export --load` restores a checkpoint with the run's config minus training.save:
    the stop fields, which need it, go too (the config check would refuse the export otherwise)."""
    from mimo.training.hf_export import checkpoint_export_config

    raw = with_ckpt(layout(), save=str(tmp_path / "ck"), exit_signal_handler=True, exit_duration_minutes=60,
                    async_save=True, keep_last=2, save_interval=5)
    load_config(raw)
    got = checkpoint_export_config(raw, str(tmp_path / "ck"))
    assert load_config(got).training.save is None
