"""Checkpoints: bit-identical same-layout resume, resume on other layouts, atomic publishing."""

import os

import pytest
import torch

from checkpoint_harness import layout, optimizer_request_sizes, resume_errors, train, with_ckpt
from mimo.checkpoint import paths
from mimo.config import load_config
from mimo.training.parity import max_rel_diff

NONCOLOCATED = dict(images=dict(rank_offset=1), audio=dict(rank_offset=1))   # LLM on rank 0, encoders on 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step Adam run (non-colocated) that saves at steps 2 and 4."""
    d = str(tmp_path_factory.mktemp("ref"))
    out = train(with_ckpt(layout(**NONCOLOCATED), save=d, save_interval=2))
    return dict(out, dir=d)


def test_a_run_saves_every_interval_and_publishes_latest(reference):
    d = reference["dir"]
    assert paths.complete_steps(d) == [2, 4] and paths.read_latest(d) == 4
    assert not [n for n in os.listdir(d) if n.endswith(".partial")]


def test_same_layout_resume_is_bit_identical(reference, tmp_path):
    got = train(with_ckpt(layout(**NONCOLOCATED), save=str(tmp_path), load=paths.iter_dir(reference["dir"], 2)))
    assert got["start"] == 2
    assert got["losses"] == reference["losses"][2:]
    assert got["params"].keys() == reference["params"].keys()
    for k, v in reference["params"].items():
        assert torch.equal(got["params"][k], v), k
    assert paths.read_latest(str(tmp_path)) == 4


def test_resume_on_other_layouts(reference, tmp_path):
    """non-colocated -> colocated TP2 (steps 2, 3; saves at 3), then TP2 -> LLM PP2 (step 3)."""
    tp2 = train(with_ckpt(layout(language=dict(tp=2), images=dict(tp=2), audio=dict(tp=2)), save=str(tmp_path),
                          save_interval=1, load=paths.iter_dir(reference["dir"], 2)))
    assert tp2["start"] == 2
    torch.testing.assert_close(torch.tensor(tp2["losses"]), torch.tensor(reference["losses"][2:]), rtol=1e-4, atol=0)
    assert max_rel_diff(tp2["params"], reference["params"]) <= 1e-4
    pp2 = train(with_ckpt(layout(language=dict(pp=2), images=dict(dp=2), audio=dict(dp=2)),
                          load=paths.iter_dir(str(tmp_path), 3)))
    assert pp2["start"] == 3
    torch.testing.assert_close(torch.tensor(pp2["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-4, atol=0)
    assert max_rel_diff(pp2["params"], reference["params"]) <= 1e-4


def test_resume_on_the_layout_the_planner_writes_for_more_gpus(reference, tmp_path):
    """The README's recovery path: plan the run's config for another GPU count, resume on it."""
    import subprocess
    import sys

    import yaml

    src = tmp_path / "run.yaml"
    src.write_text(yaml.safe_dump(layout(**NONCOLOCATED), sort_keys=False))   # the encoders' order is the model's
    planned = tmp_path / "planned.yaml"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "plan.py"), "--config", str(src), "--gpus", "4",
                        "--gpu", "cpu", "--out", str(planned)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    raw = yaml.safe_load(planned.read_text())
    assert load_config(raw).world_size == 4
    got = train(with_ckpt(raw, load=paths.iter_dir(reference["dir"], 2)))
    assert got["start"] == 2
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"][2:]), rtol=1e-4, atol=0)
    assert max_rel_diff(got["params"], reference["params"]) <= 1e-4


def test_load_optimizer_false_restarts_step_and_optimizer(reference, tmp_path):
    got = train(with_ckpt(layout(), load=reference["dir"], load_optimizer=False, train_iters=1))
    assert got["start"] == 0
    # Negative control: the same weights without the Adam state take a different first step.
    assert max_rel_diff(got["params"], reference["params"]) > 1e-4


def test_a_save_that_died_never_becomes_latest(tmp_path):
    """A partial directory (a save killed half-way) is ignored; `latest` stays; the next save replaces it."""
    d = str(tmp_path)
    os.makedirs(paths.iter_dir(d, 2))
    open(os.path.join(paths.iter_dir(d, 2), "x"), "w").close()
    os.makedirs(paths.partial_dir(d, 2))  # stands for a published step 2 being rewritten (see publish)
    paths.publish(d, 2)
    assert paths.read_latest(d) == 2 and os.listdir(paths.iter_dir(d, 2)) == []
    os.makedirs(paths.partial_dir(d, 4))  # dies here: no manifest, no rename, no latest
    assert paths.read_latest(d) == 2 and paths.complete_steps(d) == [2]
    assert paths.resolve(d) == paths.iter_dir(d, 2)
    for step in (4, 6, 8):
        os.makedirs(paths.partial_dir(d, step), exist_ok=True)
        paths.publish(d, step)
    pruned = paths.prune(d, 2)  # renamed aside at once, deleted by the caller
    assert pruned == [paths.iter_dir(d, s) + ".pruned" for s in (2, 4)] and all(map(os.path.isdir, pruned))
    assert paths.complete_steps(d) == [6, 8] and paths.read_latest(d) == 8
    paths.delete_pruned(pruned[:1])
    paths.discard_leftovers(d)  # what a deletion cut short by a crash left
    assert not [n for n in os.listdir(d) if n.endswith(".pruned")]



def test_a_save_over_the_latest_step_never_loses_it(tmp_path, monkeypatch):
    """A run rolled back to an older checkpoint saves the step `latest` names again: a save that dies
    between moving the old directory aside and renaming the new one in still resumes from the old one,
    and the next save of that step cleans up."""
    d = str(tmp_path)
    for step, mark in ((2, "old"), (4, "old")):
        os.makedirs(paths.partial_dir(d, step))
        open(os.path.join(paths.partial_dir(d, step), mark), "w").close()
        paths.publish(d, step)
    os.makedirs(paths.partial_dir(d, 4))
    open(os.path.join(paths.partial_dir(d, 4), "new"), "w").close()
    rename = os.rename

    def dies_at_the_second_rename(src, dst):
        if src == paths.partial_dir(d, 4):
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    monkeypatch.setattr(paths.os, "rename", dies_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        paths.publish(d, 4)
    monkeypatch.setattr(paths.os, "rename", rename)
    assert paths.read_latest(d) == 4 and os.listdir(paths.resolve(d)) == ["old"]
    assert paths.resolve(paths.iter_dir(d, 4)) == paths.replaced_dir(d, 4)  # named by its iter_ directory
    paths.discard_leftovers(d)  # the next save starts: the `.replaced` one is what `latest` reads
    assert os.listdir(paths.resolve(d)) == ["old"] and not os.path.exists(paths.partial_dir(d, 4))
    os.makedirs(paths.partial_dir(d, 4))
    open(os.path.join(paths.partial_dir(d, 4), "new"), "w").close()
    paths.publish(d, 4)
    assert paths.resolve(d) == paths.iter_dir(d, 4) and os.listdir(paths.iter_dir(d, 4)) == ["new"]
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000004", "latest"]
    # A leftover `.replaced` of a step that has its directory, and a dead save's `.partial`, are discarded.
    os.makedirs(paths.replaced_dir(d, 2))
    os.makedirs(paths.partial_dir(d, 6))
    paths.discard_leftovers(d)
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000004", "latest"]


def test_async_save_resumes_bit_identically(reference, tmp_path):
    """megatron-core's asynchronous writer on CPU ranks: the run saves in the background at steps 2
    and 4 (the save at 2 publishes while step 3 trains) and equals the synchronous run; resuming
    from its step-2 checkpoint is bit-identical."""
    d = str(tmp_path / "async")
    run = train(with_ckpt(layout(**NONCOLOCATED), save=d, save_interval=2, async_save=True))
    assert paths.complete_steps(d) == [2, 4] and paths.read_latest(d) == 4
    assert run["losses"] == reference["losses"]
    got = train(with_ckpt(layout(**NONCOLOCATED), load=paths.iter_dir(d, 2)))
    assert got["start"] == 2 and got["losses"] == reference["losses"][2:]
    for k, v in reference["params"].items():
        assert torch.equal(got["params"][k], v), k


def test_checkpoint_fields_are_validated():
    from mimo.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_config(with_ckpt(layout(), save_interval=0, keep_last=2))
    msg = str(exc.value)
    assert "training.keep_last" in msg and "needs training.save" in msg
    assert "training.save_interval" in msg
    with pytest.raises(ConfigError, match="training.save"):
        load_config(with_ckpt(layout(), save=""))
    assert load_config(with_ckpt(layout(), save="d", save_interval=5, keep_last=2, load="d")).training.keep_last == 2
    # Weights only into the directory it loads: every restart would fine-tune again from step 0 over it.
    for load in ("./d", "d/iter_0000002"):  # the directory, or one of its checkpoints
        with pytest.raises(ConfigError, match="training.load_optimizer: false needs training.load"):
            load_config(with_ckpt(layout(), save="d", load=load, load_optimizer=False))
    assert not load_config(with_ckpt(layout(), save="d2", load="d/iter_0000002", load_optimizer=False)).training.load_optimizer
    assert not load_config(with_ckpt(layout(), save="e", load="d", load_optimizer=False)).training.load_optimizer


def test_distributed_optimizer_state_resumes_on_one_rank(tmp_path):
    """DP2 with the distributed optimizer saves per-parameter Adam state gathered from its owners;
    one rank without it resumes and continues like the uninterrupted DP2 run."""
    dp2 = layout(language=dict(dp=2), images=dict(dp=2), audio=dict(dp=2))
    ref = train(with_ckpt(dp2, save=str(tmp_path / "ref"), save_interval=2, use_distributed_optimizer=True))
    got = train(with_ckpt(layout(), load=paths.iter_dir(str(tmp_path / "ref"), 2)))
    assert got["start"] == 2
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][2:]), rtol=1e-4, atol=0)
    assert max_rel_diff(got["params"], ref["params"]) <= 1e-4


def test_distributed_optimizer_resumes_bit_identically_loading_only_its_piece(tmp_path):
    """TP2 x DP2 with the distributed optimizer resumes on the same layout bit for bit, each rank
    loading only the rows around the optimizer-state piece it owns (not its whole TP shard's state)."""
    tp2dp2 = layout(**{m: dict(tp=2, dp=2) for m in ("language", "images", "audio")})
    raw = with_ckpt(tp2dp2, save=str(tmp_path / "ref"), save_interval=2, use_distributed_optimizer=True)
    ref = train(raw)
    ckpt = paths.iter_dir(str(tmp_path / "ref"), 2)
    got = train(with_ckpt(tp2dp2, load=ckpt, use_distributed_optimizer=True))
    assert got["start"] == 2
    assert got["losses"] == ref["losses"][2:]
    for k, v in ref["params"].items():
        assert torch.equal(got["params"][k], v), k
    for requested, owned, slack, everything in optimizer_request_sizes(raw, ckpt):
        assert owned <= requested <= owned + slack, (requested, owned, slack)
        assert requested < 0.75 * everything  # DP 2: about half, not all of it


def test_bf16_distributed_optimizer_resumes_its_fp32_master_pieces_bit_identically(tmp_path):
    """bf16 with the distributed optimizer: each DP rank's fp32 master piece (not the bf16 weights)
    comes back from the checkpoint, so the resumed run equals the uninterrupted one bit for bit."""
    dp2 = layout(**{m: dict(dp=2) for m in ("language", "images", "audio")})
    knobs = dict(use_distributed_optimizer=True, precision="bf16")
    ref = train(with_ckpt(dp2, save=str(tmp_path / "ref"), save_interval=2, **knobs))
    got = train(with_ckpt(dp2, load=paths.iter_dir(str(tmp_path / "ref"), 2), **knobs))
    assert got["start"] == 2
    assert got["losses"] == ref["losses"][2:]
    for k, v in ref["params"].items():
        assert torch.equal(got["params"][k], v), k


def test_the_manifest_lists_every_file_with_its_checksum(reference):
    """Written from the ranks' shares: the same as one process reading every file."""
    from mimo.checkpoint import manifest

    for step in (2, 4):
        ckpt = paths.iter_dir(reference["dir"], step)
        assert manifest.read_manifest(ckpt) == manifest.checksum_files(ckpt, list(manifest.listing(ckpt)))


def test_every_rank_stops_on_a_corrupt_file_in_another_ranks_share(reference, tmp_path):
    """Rank 1 checksums the file on load; both ranks stop before the load with the same line."""
    import shutil

    from mimo.checkpoint import manifest

    d = str(tmp_path / "ck")
    shutil.copytree(reference["dir"], d)
    ckpt = paths.iter_dir(d, 4)
    raw = with_ckpt(layout(**NONCOLOCATED), load=ckpt)
    world = load_config(raw).world_size
    victim = os.path.join(ckpt, manifest.shares(manifest.listing(ckpt), world)[1][0])  # rank 1's largest
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    assert resume_errors(raw) == [f"{victim}: corrupt (CRC32 differs from the manifest)"] * world


def test_every_rank_stops_on_a_truncated_file_only_one_rank_checks(reference, tmp_path):
    """Sizes are checked per share too (no rank stats every file): rank 1 finds its file short, and
    every rank stops with that rank's line before the load."""
    import shutil

    from mimo.checkpoint import manifest

    d = str(tmp_path / "ck")
    shutil.copytree(reference["dir"], d)
    ckpt = paths.iter_dir(d, 4)
    raw = with_ckpt(layout(**NONCOLOCATED), load=ckpt)
    world = load_config(raw).world_size
    split = manifest.shares(manifest.listing(ckpt), world)
    victim = os.path.join(ckpt, split[1][-1])  # rank 1's smallest
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 1)
    assert resume_errors(raw) == [f"{victim}: truncated or modified ({size - 1} bytes, the manifest says "
                                  f"{size})"] * world


def test_a_damaged_file_its_manifest_vouches_for_is_one_line_on_every_rank(reference, tmp_path):
    """A shard cut short after its manifest was rewritten to match (so every check before the load
    passes): megatron-core's load meets the end of the file. Every rank stops with one line naming
    the checkpoint and the reader's reason, not a traceback."""
    import shutil

    from mimo.checkpoint import manifest

    d = str(tmp_path / "ck")
    shutil.copytree(reference["dir"], d)
    ckpt = paths.iter_dir(d, 4)
    raw = with_ckpt(layout(**NONCOLOCATED), load=ckpt)
    world = load_config(raw).world_size
    victim = os.path.join(ckpt, sorted(n for n in manifest.listing(ckpt) if n.endswith(".distcp"))[0])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    manifest.write_manifest(ckpt)
    errors = resume_errors(raw)
    assert len(errors) == world and len(set(errors)) == 1, errors
    assert errors[0].startswith(f"{ckpt}: cannot read the checkpoint's tensors: "), errors[0]
    assert "\n" not in errors[0] and "Traceback" not in errors[0], errors[0]


def test_every_rank_names_a_checkpoint_parameter_no_rank_holds(reference):
    """A model with one LLM layer against a two-layer checkpoint: layer 1's parameters are held by
    no rank, found by the reduction over the checkpoint's parameter list, the same line everywhere."""
    raw = with_ckpt(layout(**NONCOLOCATED), load=paths.iter_dir(reference["dir"], 4))
    raw["model"]["language"]["num_layers"] = 1
    errors = resume_errors(raw)
    assert len(set(errors)) == 1 and len(errors) == load_config(raw).world_size, errors
    assert "language.decoder.layers.1." in errors[0] and "but not in this model" in errors[0], errors[0]


def test_keep_last_deletes_old_checkpoints_off_the_step(tmp_path):
    """A save every step keeping the last 2: the older ones are gone by the end of the run, the kept
    ones resume, and no renamed-aside directory is left."""
    d = str(tmp_path / "ck")
    train(with_ckpt(layout(), save=d, save_interval=1, keep_last=2, train_iters=4))
    assert paths.complete_steps(d) == [3, 4] and paths.read_latest(d) == 4
    assert sorted(os.listdir(d)) == ["iter_0000003", "iter_0000004", "latest"]


def _resume_error_with_a_failing_read(raw, failing_rank):
    """`_resume_error`, with every checksum read on `failing_rank` failing as a flaky filesystem would."""
    import errno

    import torch.distributed as dist

    from checkpoint_harness import _resume_error
    from mimo.checkpoint import manifest

    if dist.get_rank() == failing_rank:
        def fail(path, *a):
            raise OSError(errno.EIO, "Input/output error", path)

        manifest.crc32 = fail
    return _resume_error(raw)


def test_a_read_that_fails_on_one_rank_stops_every_rank_with_its_line(reference):
    """An OSError on one rank (not a CheckpointError) is carried by the agreement too: no rank is
    left waiting in it, and every rank names the failed read."""
    from mimo.runtime import run_on_ranks

    ckpt = paths.iter_dir(reference["dir"], 4)
    raw = with_ckpt(layout(**NONCOLOCATED), load=ckpt)
    errors = run_on_ranks(_resume_error_with_a_failing_read, 2, raw, 1, timeout_s=240, daemon=False)
    assert len(set(errors)) == 1 and errors[0].startswith(f"{ckpt}: [Errno 5] Input/output error"), errors
