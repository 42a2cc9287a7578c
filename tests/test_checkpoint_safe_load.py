"""Loading a checkpoint never runs code from it.

A checkpoint's pickles (`common.pt`, `rng/rank_NNNNN.pt`, torch's `.metadata` index)
are replaced by pickles that create a marker file when unpickled without
restriction, and the manifest is resealed (as anyone who can write the files can
do). `inspect`, `convert` and a resume must refuse each with one `error:` line
naming the file, and the marker must never appear. Checkpoints written by the
previous code (numpy's RNG key as an array) still resume.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from checkpoint_harness import Payload, layout, poison, resume_errors, train, with_ckpt
from mimo.checkpoint import CheckpointError, paths
from mimo.checkpoint.manifest import write_manifest
from mimo.checkpoint.safe_load import load_torch_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
ENV = {**os.environ, "PYTHONPATH": ROOT, "MIMO_DEBUG": ""}
DP2 = layout(language={"dp": 2}, images={"dp": 2}, audio={"dp": 2})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-step Adam run of TINY at DP 2 (2 ranks) saved at step 2."""
    d = str(tmp_path_factory.mktemp("safe"))
    raw = with_ckpt(DP2, save=d, train_iters=2)
    out = train(raw)
    return dict(out, dir=d, raw=raw)


def _poisoned(saved, tmp_path, rel, how="torch"):
    """A copy of the checkpoint with file `rel` replaced by a payload pickle, the manifest resealed."""
    d = str(tmp_path / "ck")
    shutil.copytree(saved["dir"], d)
    ckpt = paths.iter_dir(d, 2)
    marker = str(tmp_path / "ran")
    return d, ckpt, poison(ckpt, rel, marker, plain_pickle=how == "pickle"), marker


def _one_error_line(r, torchrun=False):
    assert r.returncode != 0, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    # torchrun reports a failed worker with a traceback of its own launcher; none from mimo's code
    ours = f'File "{ROOT}/mimo' not in r.stderr and 'pretrain_mimo.py", line' not in r.stderr
    assert ours if torchrun else "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


def _cli(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)


def test_payload_runs_when_loaded_unrestricted(tmp_path):
    """Negative control: the payload is live, so its absence below means it was never unpickled."""
    marker = str(tmp_path / "ran")
    path = str(tmp_path / "x.pt")
    torch.save({"mimo": Payload(marker)}, path)
    torch.load(path, weights_only=False)
    assert os.path.isdir(marker)
    with pytest.raises(CheckpointError, match=r"x\.pt: holds objects a checkpoint may not hold \(posix\.mkdir\)"):
        load_torch_file(path)


@pytest.mark.parametrize("rel,how", [("common.pt", "torch"), (".metadata", "pickle")])
def test_inspect_and_convert_refuse_a_file_that_runs_code(saved, tmp_path, rel, how):
    d, ckpt, path, marker = _poisoned(saved, tmp_path, rel, how)
    line = _one_error_line(_cli("-m", "mimo.checkpoint", "inspect", d))
    assert line.startswith(f"error: {path}: holds objects a checkpoint may not hold (posix.mkdir)"), line
    line = _one_error_line(_cli("-m", "mimo.checkpoint", "convert", ckpt, "--to-torch", str(tmp_path / "w.pt")))
    assert line.startswith(f"error: {path}: holds objects"), line
    assert not os.path.exists(marker)


def test_inspect_never_runs_an_rng_file(saved, tmp_path):
    d, _, _, marker = _poisoned(saved, tmp_path, os.path.join("rng", "rank_00001.pt"))
    r = _cli("-m", "mimo.checkpoint", "inspect", d)  # inspect does not need the RNG states
    assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.exists(marker)


def test_resume_refuses_common_state_that_runs_code(saved, tmp_path):
    """Through the training command: one line, exit 2, found before any collective (preflight)."""
    import yaml

    d, _, path, marker = _poisoned(saved, tmp_path, "common.pt")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(with_ckpt(saved["raw"], load=d, train_iters=3)))
    line = _one_error_line(_cli("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT,
                                "--config", str(cfg), "--device", "cpu", "--set", "training.save=null"), torchrun=True)
    assert line.startswith(f"error: {path}: holds objects a checkpoint may not hold"), line
    assert not os.path.exists(marker)


def test_resume_refuses_an_rng_file_that_runs_code(saved, tmp_path):
    """Rank 1's RNG file: every rank stops with the same line naming it (agreed before the load)."""
    d, _, path, marker = _poisoned(saved, tmp_path, os.path.join("rng", "rank_00001.pt"))
    errors = resume_errors(with_ckpt(saved["raw"], load=d, train_iters=3))
    assert len(set(errors)) == 1 and errors[0].startswith(f"{path}: holds objects"), errors
    assert not os.path.exists(marker)


def test_checkpoints_of_the_previous_format_still_resume(saved, tmp_path):
    """RNG files as the previous code wrote them (numpy's key as an array) load and restore: the
    resumed run's steps equal the straight run's (losses bit-identical)."""
    d = str(tmp_path / "old")
    shutil.copytree(saved["dir"], d)
    ckpt = paths.iter_dir(d, 2)
    for name in os.listdir(os.path.join(ckpt, "rng")):
        path = os.path.join(ckpt, "rng", name)
        state = load_torch_file(path)
        algorithm, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = (algorithm, key.numpy().astype(np.uint32), pos, has_gauss, gauss)
        torch.save(state, path)
        assert isinstance(torch.load(path, weights_only=False)["numpy"][1], np.ndarray)  # the old form
    write_manifest(ckpt)
    straight = train(with_ckpt(DP2, train_iters=4))
    resumed = train(with_ckpt(saved["raw"], load=d, save=None, train_iters=4))
    assert resumed["start"] == 2 and resumed["losses"] == straight["losses"][2:]


def test_no_unrestricted_load_in_the_code():
    hits = []
    for top in ("mimo", "tools", "examples"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith((".py", ".sh")):
                    with open(os.path.join(dirpath, n), encoding="utf-8") as f:
                        if "weights_only=False" in f.read():
                            hits.append(os.path.join(dirpath, n))
    assert hits == []


def test_energon_data_positions_are_stored_as_plain_data(tmp_path):
    """megatron-energon's loader state (a tree of its dataclasses and dict subclass) is stored as
    plain containers: it loads with the safe loader and rebuilds equal; a class named in a stored
    position that is not energon's is refused (negative control)."""
    pytest.importorskip("megatron.energon")
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.state import FlexState

    from mimo.data.energon import energon_state, plain_state
    from mimo.data.llava import DataError

    state = FlexState(a=SliceState(index=3, current=5), rng=b"\x01\x02", items=[1, (2, 3)])
    path = str(tmp_path / "common.pt")
    torch.save({"mimo": {"data": plain_state(state)}}, path)
    back = energon_state(load_torch_file(path)["mimo"]["data"])
    assert type(back) is FlexState and back == state and type(back["a"]) is SliceState
    torch.save({"mimo": {"data": state}}, path)  # the classes themselves are not plain data
    with pytest.raises(CheckpointError, match="holds objects a checkpoint may not hold"):
        load_torch_file(path)
    forged = plain_state(state)
    forged["__energon_flex_state__"]["a"]["__energon_dataclass__"] = "mimo.config.schema.TrainingConfig"
    with pytest.raises(DataError, match="is not an energon state class"):
        energon_state(forged)


def test_a_damaged_file_is_named_with_the_reason(tmp_path):
    from mimo.checkpoint.safe_load import check_dcp_metadata, load_torch_file

    bad = tmp_path / "common.pt"
    bad.write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(CheckpointError) as exc:
        load_torch_file(str(bad))
    assert str(exc.value) == f"{bad}: unreadable (RuntimeError: PytorchStreamReader failed reading zip archive: " \
                             "not a ZIP archive)"
    (tmp_path / ".metadata").write_bytes(b"\x80\x04 cut")
    with pytest.raises(CheckpointError) as exc:
        check_dcp_metadata(str(tmp_path))
    assert str(exc.value) == f"{tmp_path / '.metadata'}: unreadable (UnpicklingError: invalid load key, ' '.)"


def test_energon_resume_needs_the_same_loader_workers():
    """energon's sample order depends on its number of loader workers: a position saved with 2 resumes
    only with 2 (before: an empty AssertionError from energon after the model load, or, before its first
    saved state, a silently different stream)."""
    import dataclasses

    from mimo.checkpoint.checks import config_problems
    from mimo.config import load_config
    from tiny import tiny

    cfg = load_config(tiny())
    cfg.data = dataclasses.replace(cfg.data, kind="energon", path="/data/vqa", num_workers=2)
    saved = dataclasses.asdict(cfg)
    assert config_problems(saved, cfg, True) == []
    cfg.data = dataclasses.replace(cfg.data, num_workers=0)
    assert config_problems(saved, cfg, True) == [
        "data.num_workers: the checkpoint was saved with 2, this run has 0 (resuming needs the same; "
        "training.load_optimizer: false loads the weights only)"]
    assert config_problems(saved, cfg, False) == []
