"""Checkpoint command lines: convert / inspect, and bad checkpoints giving one `error:` line."""

import copy
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from checkpoint_harness import layout, start_by_hand, train, wait_all, with_ckpt
from mimo.checkpoint import CheckpointError, paths, preflight
from mimo.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
ENV = {**os.environ, "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-rank, two-step Adam run saved at step 2 (and its config file)."""
    d = str(tmp_path_factory.mktemp("ckpt"))
    raw = with_ckpt(layout(), save=d, train_iters=2)
    out = train(raw)
    cfg_path = os.path.join(d, "..", "run.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(raw, f)
    return dict(out, dir=d, raw=raw, config=os.path.abspath(cfg_path))


def _tree_digest(d):
    h = hashlib.sha256()
    for dirpath, _, names in sorted(os.walk(d)):
        for n in sorted(names):
            with open(os.path.join(dirpath, n), "rb") as f:
                h.update(n.encode() + f.read())
    return h.hexdigest()


def _copy(saved, tmp_path):
    import shutil

    d = str(tmp_path / "ck")
    shutil.copytree(saved["dir"], d)
    return d


def test_convert_writes_the_full_unsharded_weights(saved, tmp_path):
    out = str(tmp_path / "full.pt")
    r = subprocess.run([sys.executable, "-m", "mimo.checkpoint", "convert", paths.iter_dir(saved["dir"], 2),
                        "--to-torch", out], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    full = torch.load(out)
    flat = {f"{m}.{k}": t for m, tensors in full.items() for k, t in tensors.items()}
    assert flat.keys() == saved["params"].keys()
    for k, v in saved["params"].items():
        assert torch.equal(flat[k], v), k
    r = subprocess.run([sys.executable, "-m", "mimo.checkpoint", "inspect", saved["dir"]],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 2" in r.stdout and "language" in r.stdout and "images" in r.stdout


def test_output_paths_that_are_directories_are_one_error(saved, tmp_path, capsys):
    from mimo.checkpoint.__main__ import main as checkpoint_cli
    from mimo.training.hf_export import out_dir_problem

    assert checkpoint_cli(["convert", saved["dir"], "--to-torch", str(tmp_path)]) == 2  # before any load
    assert capsys.readouterr().err == f"error: --to-torch: {tmp_path} is a directory; name the file to write\n"
    assert out_dir_problem(None, "") == "an empty path; name the directory to write"  # hf export --out ''
    # Under a file (before: a FileExistsError traceback after the load), and a disk that refuses the write.
    (tmp_path / "afile").write_text("x")
    assert checkpoint_cli(["convert", saved["dir"], "--to-torch", str(tmp_path / "afile" / "w.pt")]) == 2
    assert capsys.readouterr().err == (f"error: --to-torch: {tmp_path / 'afile' / 'w.pt'} cannot be made: "
                                       f"{tmp_path / 'afile'} is a file\n")
    if os.path.exists("/dev/full"):
        assert checkpoint_cli(["convert", saved["dir"], "--to-torch", "/dev/full"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --to-torch: writing /dev/full failed: ") and len(err.splitlines()) == 1, err
    assert out_dir_problem(None, str(tmp_path / "afile" / "hf")) == (f"{tmp_path / 'afile' / 'hf'} cannot be made: "
                                                                     f"{tmp_path / 'afile'} is a file")


def test_output_files_and_directories_of_a_run_are_checked_with_the_config(tmp_path):
    """training.log_json, training.timeline (files) and training.tensorboard_dir (a directory): a
    directory where a file goes, a file where a directory goes, a path under a file are config
    errors, found before the run rather than at its first write (the timeline at timeline_step)."""
    from mimo.config import ConfigError

    from tiny import TINY

    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {("log_json", str(tmp_path)): f"{tmp_path} is a directory; name the file to write",
             ("timeline", str(afile / "t.json")): f"{afile / 't.json'} cannot be made: {afile} is a file",
             ("tensorboard_dir", str(afile)): f"{afile} exists and is not a directory"}
    for (key, value), reason in cases.items():
        raw = copy.deepcopy(TINY)
        raw["training"][key] = value
        with pytest.raises(ConfigError, match=re.escape(f"training.{key}: {reason}")):
            load_config(raw)
        raw["training"][key] = str(tmp_path / "new" / "out")  # to be made: fine
        assert getattr(load_config(raw).training, key)


def test_a_damaged_format_record_is_named(saved, tmp_path):
    from mimo.checkpoint.checks import read_checked

    ckpt = paths.iter_dir(_copy(saved, tmp_path), 2)
    record = os.path.join(ckpt, "metadata.json")
    with open(record, "w") as f:
        f.write("not json")
    with pytest.raises(CheckpointError, match=f"^{record}: unreadable \\(JSONDecodeError: "):
        read_checked(ckpt)
    os.remove(record)
    with pytest.raises(CheckpointError, match=f"^{record}: missing"):
        read_checked(ckpt)


def test_convert_names_a_damaged_shard_the_manifest_vouches_for(saved, tmp_path, capsys):
    """A `.distcp` file cut short and the manifest rewritten to match: every check before the read
    passes, and torch's reader fails with a BaseException that used to escape as a traceback."""
    from mimo.checkpoint import manifest
    from mimo.checkpoint.__main__ import main as checkpoint_cli

    ckpt = paths.iter_dir(_copy(saved, tmp_path), 2)
    victim = os.path.join(ckpt, sorted(n for n in manifest.listing(ckpt) if n.endswith(".distcp"))[0])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    manifest.write_manifest(ckpt)
    assert checkpoint_cli(["convert", ckpt, "--to-torch", str(tmp_path / "full.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt}: cannot read the checkpoint's tensors: rank 0: EOFError (the files "
                          "match the manifest's sizes and checksums"), err
    assert err.count("\n") == 1 and not (tmp_path / "full.pt").exists(), err


def test_a_checkpoint_at_train_iters_says_there_is_nothing_to_train(saved):
    r = _run_cli(saved["config"], f"training.load={saved['dir']}", "training.save=null")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-2:] == [f"resumed from {saved['dir']} at step 2", "nothing to train: the checkpoint "
                                          "is at step 2 and training.train_iters is 2 (raise it to train on)"], r.stdout


def test_a_resume_at_another_precision_says_so(saved):
    """An fp32 checkpoint resumed in bf16 loads (weights load at any precision) but does not continue the
    saved run exactly: rank 0 says so once. Control: at the saved precision, no warning."""
    r = _run_cli(saved["config"], f"training.load={saved['dir']}", "training.save=null", "training.precision=bf16")
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: training.precision")]
    assert len(warnings) == 1 and "saved by a fp32 run and this run trains in bf16" in warnings[0], r.stderr[-2000:]
    r = _run_cli(saved["config"], f"training.load={saved['dir']}", "training.save=null")
    assert r.returncode == 0 and "warning: training.precision" not in r.stderr


def _run_cli(config, *sets, preexec_fn=None, env=None):
    args = [sys.executable, SCRIPT, "--config", config, "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, env={**ENV, "MIMO_DEBUG": "", **(env or {})},
                          timeout=300, preexec_fn=preexec_fn)


def test_an_error_no_restart_fixes_is_written_where_a_launcher_reads_it(saved, tmp_path):
    """A checkpoint of another model is found only after the start (its shapes, at the load), so a
    launcher that restarts failed jobs would meet it again: with MIMO_ERROR_FILE set, the trainer writes
    its error line there (examples/slurm reads it and does not requeue)."""
    marker = tmp_path / "error"
    r = _run_cli(saved["config"], f"training.load={saved['dir']}", "training.save=null",
                 "model.language.hidden_size=64", env={"MIMO_ERROR_FILE": str(marker)})
    assert r.returncode == 2, r.stderr[-2000:]
    line = marker.read_text()
    assert line.startswith("error: ") and "shape" in line and line.count("\n") == 1, line
    assert line.strip() in r.stderr


def _files_up_to(nbytes):
    """For a child process: no file it (or a process it forks) writes may grow past `nbytes`, as on a
    full disk; the write fails with EFBIG instead of the process being killed by SIGXFSZ."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_cannot_write_stops_with_one_line_and_keeps_the_last_checkpoint(saved, tmp_path, async_save):
    """A real write failure (the OS refuses to grow a shard file past a size limit) in megatron-core's
    writer processes: the run stops with one line naming the step and the cause, not torch's
    CheckpointException traceback, and the checkpoint of step 2 stays the one `latest` names."""
    d = _copy(saved, tmp_path)
    before = _tree_digest(paths.iter_dir(d, 2))
    r = _run_cli(saved["config"], f"training.load={d}", f"training.save={d}", "training.train_iters=4",
                 "training.save_interval=2", f"training.async_save={str(async_save).lower()}",
                 preexec_fn=_files_up_to(100_000))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "step 4 |" in r.stdout  # trained on, then the save failed
    line = _one_error_line(r)  # the writer's reason depends on which write met the limit first
    assert line.startswith(f"error: training.save: step 4 was not saved ({d}/iter_0000004.partial): rank 0: "
                           "RuntimeError: Worker failure: "), line
    assert line.endswith("; the checkpoints saved before it are untouched"), line
    assert paths.read_latest(d) == 2 and paths.complete_steps(d) == [2]
    assert _tree_digest(paths.iter_dir(d, 2)) == before


def _one_error_line(r):
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return errors[0]


def test_bad_checkpoints_give_one_error_line_and_stay_untouched(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    ckpt = paths.iter_dir(d, 2)
    before = _tree_digest(d)
    # A different architecture: named by its first mismatching parameter, with both shapes.
    line = _one_error_line(_run_cli(saved["config"], f"training.load={d}", "training.save=null",
                                    "model.language.vocab_size=256"))
    assert "language.embedding.word_embeddings.weight" in line and "[128, 32]" in line and "[256, 32]" in line
    assert _tree_digest(d) == before
    # A corrupt shard (same size, one byte changed): found by the checksum before the load.
    shard = os.path.join(ckpt, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    before = _tree_digest(d)
    line = _one_error_line(_run_cli(saved["config"], f"training.load={d}", "training.save=null"))
    assert line == f"error: {shard}: corrupt (CRC32 differs from the manifest)"  # the file, named once
    assert _tree_digest(d) == before
    # `inspect` checks every file's presence and size, and with --checksums its CRC32: one line, exit 2.
    from mimo.checkpoint.__main__ import main as checkpoint_cli

    capsys.readouterr()
    assert checkpoint_cli(["inspect", d]) == 0 and "step 2" in capsys.readouterr().out
    assert checkpoint_cli(["inspect", d, "--checksums"]) == 2
    assert capsys.readouterr().err == f"error: {shard}: corrupt (CRC32 differs from the manifest)\n"
    with open(shard, "r+b") as f:
        f.truncate(100)
    assert checkpoint_cli(["inspect", d]) == 2
    assert capsys.readouterr().err.startswith(f"error: {shard}: truncated or modified (100 bytes, the manifest says")
    # `latest` naming a directory that is not there.
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("7\n")
    before = _tree_digest(d)
    line = _one_error_line(_run_cli(saved["config"], f"training.load={d}", "training.save=null"))
    assert "iter_0000007" in line
    assert _tree_digest(d) == before


def test_preflight_finds_truncated_shards_and_config_changes(saved, tmp_path):
    d = _copy(saved, tmp_path)
    raw = copy.deepcopy(saved["raw"])
    raw["training"].update(load=d, save=None)
    assert preflight(load_config(raw)) == paths.iter_dir(d, 2)
    changed = copy.deepcopy(raw)
    changed["training"]["optimizer"] = "sgd"
    with pytest.raises(CheckpointError, match="training.optimizer"):
        preflight(load_config(changed))
    changed["training"]["load_optimizer"] = False  # weights only: allowed
    assert preflight(load_config(changed)) == paths.iter_dir(d, 2)
    shard = os.path.join(paths.iter_dir(d, 2), "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="__0_0.distcp: truncated"):
        preflight(load_config(raw))
    os.remove(shard)
    with pytest.raises(CheckpointError, match="__0_0.distcp: missing"):
        preflight(load_config(raw))
    empty = copy.deepcopy(raw)
    empty["training"].update(load=str(tmp_path / "none"), save=str(tmp_path / "none"))
    assert preflight(load_config(empty)) is None  # save == load, nothing saved yet: start fresh
    empty["training"]["save"] = None
    if not os.path.isdir(tmp_path / "none"):
        with pytest.raises(CheckpointError, match=f"^training.load: {tmp_path / 'none'}: no such directory$"):
            preflight(load_config(empty))
    os.makedirs(tmp_path / "none", exist_ok=True)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        preflight(load_config(empty))
    # A file; a directory with a complete step but no `latest` (its run died between the two renames),
    # also as its own training.save (before: started fresh, and its first save moved the step aside).
    (tmp_path / "afile.txt").write_text("")
    empty["training"]["load"] = str(tmp_path / "afile.txt")
    with pytest.raises(CheckpointError, match=f"^training.load: {tmp_path / 'afile.txt'} is a file; name the"):
        preflight(load_config(empty))
    unnamed = tmp_path / "unnamed"
    shutil.copytree(paths.iter_dir(saved["dir"], 2), paths.iter_dir(str(unnamed), 2))
    for save in (None, str(unnamed)):
        empty["training"].update(load=str(unnamed), save=save)
        with pytest.raises(CheckpointError, match=re.escape(
                f"training.load: {unnamed} holds no `latest` file, only step directories (newest iter_0000002)")):
            preflight(load_config(empty))
    empty["training"].update(load=paths.iter_dir(str(unnamed), 2), save=None)
    assert preflight(load_config(empty)) == paths.iter_dir(str(unnamed), 2)  # the fix the message gives
    # A `training.save` that can never hold a checkpoint: found before the run, not at its first save.
    afile = tmp_path / "afile"
    afile.write_text("")
    fresh = copy.deepcopy(raw)
    fresh["training"].update(load=None, save=str(afile))
    with pytest.raises(CheckpointError, match=f"^training.save: {afile} exists and is not a directory$"):
        preflight(load_config(fresh))
    fresh["training"]["save"] = str(afile / "run" / "ckpt")
    with pytest.raises(CheckpointError, match=f"^training.save: {afile}/run/ckpt cannot be made: {afile} is a file$"):
        preflight(load_config(fresh))
    # Where no file can be made (checked by making one: root may write anywhere os.access looks).
    fresh["training"]["save"] = "/proc/mimo_run/ckpt"
    with pytest.raises(CheckpointError, match="^training.save: /proc/mimo_run/ckpt cannot be written \\(making a "
                                              "file in /proc: "):
        preflight(load_config(fresh))
    fresh["training"]["save"] = str(tmp_path / "new" / "ckpt")  # made at the first save
    assert preflight(load_config(fresh)) is None
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mimo-write-probe-")]  # the probe is gone


@pytest.mark.parametrize("read_by_all", [False, True])
def test_a_truncated_file_in_another_ranks_share_stops_the_job_with_that_ranks_line(saved, tmp_path, read_by_all):
    """A file in one rank's share is checked by that rank alone, after the process groups exist, and the
    ranks agree on it: every rank stops, rank 0 prints the line once, whatever the launcher (here by
    hand: three processes and no launcher to stop the others; before, the owner found it at start-up
    and exited alone, and the other ranks waited for it until `training.timeout_minutes`). The index,
    which every rank reads, every rank checks at start-up: rank 0 names it (not "unreadable"), once."""
    from mimo.checkpoint import manifest

    d = _copy(saved, tmp_path)
    ckpt = paths.iter_dir(d, 2)
    raw = copy.deepcopy(saved["raw"])
    raw["parallelism"] = {"language": {}, "images": {"rank_offset": 1}, "audio": {"rank_offset": 2}}
    raw["training"].update(load=d, save=None, timeout_minutes=5)
    cfg = tmp_path / "three.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    owner = 2
    share = [n for n in manifest.shares(manifest.listing(ckpt), 3)[owner] if n not in ("common.pt", ".metadata")]
    victim = os.path.join(ckpt, ".metadata" if read_by_all else share[0])
    with open(victim, "r+b") as f:
        f.truncate(7)
    procs, outs = start_by_hand([sys.executable, SCRIPT, "--config", str(cfg), "--device", "cpu"], 3, str(tmp_path),
                                {**ENV, "MIMO_DEBUG": ""})
    codes, err = wait_all(procs, outs)
    assert codes == [2, 2, 2], (codes, err)  # every rank stopped, none left waiting
    errors = [line for e in err for line in e.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err[0].splitlines()[-1] == errors[0], err  # once, by rank 0
    assert errors[0].startswith(f"error: {victim}: truncated or modified (7 bytes"), errors
    assert not any("Traceback" in e for e in err), err


def test_tools_name_an_output_under_a_file(tmp_path, capsys):
    """tools/make_sample_data.py OUT_DIR and tools/timeline.py --out: one line, exit 2 (before: a traceback)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_sample_data
    import timeline

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert make_sample_data.main([str(afile)]) == 2
    assert capsys.readouterr().err == f"error: OUT_DIR: {afile} exists and is not a directory\n"
    demo = os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")
    assert timeline.main(["--simulate", demo, "--gpu", "cpu", "--out", str(afile / "t.png")]) == 2
    assert capsys.readouterr().err == f"error: --out: {afile / 't.png'} cannot be made: {afile} is a file\n"


def test_a_damaged_latest_manifest_or_common_record_is_one_error_line(saved, tmp_path, capsys):
    """`latest` that is a directory or not text, `manifest.json` that is a directory, and a common state
    whose mimo record lacks its fields (resealed in the manifest, so only its content is wrong): one line
    naming the file (before: IsADirectoryError, UnicodeDecodeError or KeyError tracebacks), from `inspect`
    and, for the first, from the run's pre-flight as well."""
    from mimo.checkpoint.__main__ import main as checkpoint_cli
    from mimo.checkpoint.manifest import write_manifest

    def inspect_says(d, expected):
        capsys.readouterr()
        assert checkpoint_cli(["inspect", d]) == 2
        assert capsys.readouterr().err == f"error: {expected}\n"

    d = _copy(saved, tmp_path / "dir")
    latest = os.path.join(d, "latest")
    os.remove(latest)
    os.mkdir(latest)
    expected = f"{latest}: unreadable (Is a directory); it should hold the step number of the last complete checkpoint"
    inspect_says(d, expected)
    assert _one_error_line(_run_cli(saved["config"], f"training.load={d}", "training.save=null")) == f"error: {expected}"
    os.rmdir(latest)
    with open(latest, "wb") as f:
        f.write(b"\xff\xfe2\n")
    inspect_says(d, f"{latest}: unreadable (not text); it should hold the step number of the last complete checkpoint")

    d = _copy(saved, tmp_path / "manifest")
    manifest = os.path.join(paths.iter_dir(d, 2), "manifest.json")
    os.remove(manifest)
    os.mkdir(manifest)
    inspect_says(d, f"{manifest}: unreadable (Is a directory)")

    d = _copy(saved, tmp_path / "record")
    ckpt = paths.iter_dir(d, 2)
    common = os.path.join(ckpt, "common.pt")
    state = torch.load(common, weights_only=True)
    del state["mimo"]["step"], state["mimo"]["config"]
    torch.save(state, common)
    os.remove(os.path.join(ckpt, "manifest.json"))
    write_manifest(ckpt)
    inspect_says(d, f"{common}: its 'mimo' record lacks step, config (damaged, or not written by mimo)")
