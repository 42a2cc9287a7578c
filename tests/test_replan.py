"""Elastic re-plan (`training.replan: auto`, mimo/checkpoint/replan.py).

In-process (no ranks): which world sizes get templates, that a stored template is read (an
oracle: a valid layout the search would not choose is the one taken) and that a template for the
wrong world size is refused and re-planned (the negative control), and the one-line errors.
End to end (torchrun, CPU ranks): 6 ranks -> 4 ranks from the step-4 checkpoint, losses of steps
5-8 against the uninterrupted 6-rank run; the same restart without replan is today's error.
"""

import copy
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
import yaml

from mimo.checkpoint.replan import TEMPLATES, load_for_world, read_templates, template_sizes, write_templates
from mimo.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mimo.py")
# The LLM TP2 x PP2 on ranks 0-3, the (frozen) vision encoder DP2 on ranks 4-5.
CONFIG = os.path.join(ROOT, "examples", "configs", "cpu_noncolocated.yaml")


def _auto(d):
    return ["training.replan=auto", f"training.save={d}", f"training.load={d}"]


def _fake_checkpoint(d):
    """Enough of a checkpoint for the re-plan's check (which runs before the real load's)."""
    os.makedirs(os.path.join(d, "iter_0000002"), exist_ok=True)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("2\n")


def _quiet(fn, *args):
    out = io.StringIO()
    with redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def test_template_sizes_step_by_node_or_by_rank():
    assert template_sizes(32, 16, 8) == [24, 16]         # 4 nodes of 8: each lost node
    assert template_sizes(6, None, 6) == [5, 4, 3]       # one node: each lost rank, down to half
    assert template_sizes(6, 4, 6) == [5, 4]
    assert template_sizes(6, 6, 6) == []


def test_first_start_stores_templates_and_a_restart_reads_them(tmp_path):
    d = str(tmp_path / "ck")
    _, out = _quiet(load_for_world, CONFIG, _auto(d), 6, "cpu", 0, 6)
    assert f"templates for 5, 4, 3 ranks of cpu stored in {d}/{TEMPLATES}" in out
    stored, _ = read_templates(d)
    assert sorted(stored["cpu"]) == ["3", "4", "5"]
    # A valid 4-rank layout the search does not choose (LLM TP2 x DP2, images DP4, colocated):
    # a restart that takes it read the template rather than searching.
    odd = {"language": {"tp": 2, "dp": 2}, "images": {"dp": 4}}
    stored["cpu"]["4"]["parallelism"] = odd
    write_templates(d, stored)
    _fake_checkpoint(d)
    cfg, out = _quiet(load_for_world, CONFIG, _auto(d), 4, "cpu", 0, 6)
    assert out.startswith("replanned for 4 ranks: images tp1 pp1 dp4 [0-3], language tp2 cp1 pp1 dp2 [0-3]")
    assert "layout from the template" in out
    assert (cfg.parallelism["language"].tp, cfg.parallelism["language"].dp) == (2, 2)
    written = yaml.safe_load(open(os.path.join(d, "layout_4.yaml")))
    assert written["parallelism"] == odd and written["model"] == yaml.safe_load(open(CONFIG))["model"]


def test_a_template_for_the_wrong_world_size_is_refused_and_replanned(tmp_path):
    d = str(tmp_path / "ck")
    _quiet(load_for_world, CONFIG, _auto(d), 6, "cpu", 0, 6)
    stored, _ = read_templates(d)
    good = copy.deepcopy(stored["cpu"]["4"])
    # Negative control: the 6-rank layout filed under 4 ranks.
    stored["cpu"]["4"]["parallelism"] = yaml.safe_load(open(CONFIG))["parallelism"]
    write_templates(d, stored)
    _fake_checkpoint(d)
    cfg, out = _quiet(load_for_world, CONFIG, _auto(d), 4, "cpu", 0, 6)
    assert "layout from a fresh search (the template for 4 ranks is refused (parallelism.images: needs ranks " \
           "[4, 6) but the world size is 4))" in out
    assert cfg.world_size == 4
    assert {n: p["dp"] for n, p in good["parallelism"].items()} == {n: p.dp for n, p in cfg.parallelism.items()}
    # Another GPU kind has no template: planned afresh for it.
    stored["cpu"]["4"] = good
    write_templates(d, stored)
    _, out = _quiet(load_for_world, CONFIG, _auto(d), 4, "NVIDIA H100 80GB HBM3", 0, 6)
    assert "layout from a fresh search (no template for 4 ranks of h100)" in out


def test_growth_replans_for_more_ranks(tmp_path):
    d = str(tmp_path / "ck")
    _fake_checkpoint(d)
    cfg, out = _quiet(load_for_world, CONFIG, _auto(d), 8, "cpu", 0, 8)
    assert out.startswith("replanned for 8 ranks:") and cfg.world_size == 8
    assert os.path.exists(os.path.join(d, "layout_8.yaml"))


def test_replan_off_keeps_the_world_size_error(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_for_world(CONFIG, [], 4, "cpu", 0, 4)
    assert str(exc.value) == "error: parallelism.images: needs ranks [4, 6) but the world size is 4"


def _main(argv, world, monkeypatch):
    """pretrain_mimo.main on rank 0 of `world` ranks: every error here comes before any process group."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_mimo

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    err = io.StringIO()
    with redirect_stderr(err):
        rc = pretrain_mimo.main(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("case", ["unset", "empty", "unnamed"])
def test_replan_without_a_checkpoint_is_one_error(tmp_path, monkeypatch, case):
    d = str(tmp_path / "ck")
    sets = ["training.replan=auto", f"training.save={d}"] + ([f"training.load={d}"] if case != "unset" else [])
    if case == "unnamed":  # a complete step whose run died before `latest` named it
        os.makedirs(os.path.join(d, "iter_0000004"))
    rc, err = _main(["--config", CONFIG, "--device", "cpu"] + [a for s in sets for a in ("--set", s)], 4,
                    monkeypatch)
    why = {"unset": "training.load is unset", "empty": f"{d} holds no checkpoint yet; start on 6 ranks",
           "unnamed": f"{d} holds no `latest` file, only step directories (newest iter_0000004): resume it with "
                      f"training.load: {d}/iter_0000004"}[case]
    assert rc == 2 and err == f"error: training.replan: auto on 4 ranks (the layout uses 6) resumes training.load, " \
                              f"but {why}\n"


def test_fewer_ranks_than_any_layout_fits_is_one_error(tmp_path, monkeypatch):
    raw = yaml.safe_load(open(CONFIG))
    # An LLM whose weights and Adam state alone (~180 GB) exceed a CPU rank's 64 GiB.
    raw["model"]["language"].update(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                                    vocab_size=32000)
    config = str(tmp_path / "big.yaml")
    yaml.safe_dump(raw, open(config, "w"))
    d = str(tmp_path / "ck")
    _fake_checkpoint(d)
    rc, err = _main(["--config", config, "--device", "cpu"] + [a for s in _auto(d) for a in ("--set", s)], 1,
                    monkeypatch)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: training.replan: no layout for 1 ranks of cpu: no layout fits on 1 x cpu"), err


def test_a_model_without_bitfield_attention_is_replanned_without_context_parallelism(tmp_path):
    """Context parallelism needs bitfield attention, which the re-plan does not switch on: no CP layout is
    tried, and a size only CP could fill gets the planner's own reason. (On 7 ranks this config's only
    layouts put the LLM at CP 3; the reason used to be "context parallelism needs bitfield attention".)"""
    d = str(tmp_path / "ck")
    _fake_checkpoint(d)
    with pytest.raises(ConfigError) as err:
        _quiet(load_for_world, CONFIG, _auto(d), 7, "cpu", 0, 6)
    assert "no layout splits 7 GPUs" in str(err.value) and "bitfield" not in str(err.value), str(err.value)
    cfg, _ = _quiet(load_for_world, CONFIG, _auto(d), 5, "cpu", 0, 6)
    assert cfg.world_size == 5 and all(p.cp == 1 for p in cfg.parallelism.values())


def test_a_replanned_layout_keeps_encoder_offload_only_where_it_has_the_phase_for_it():
    """with_layout: the flag stays on for a layout whose colocated encoders are idle while the LLM runs
    (their own dp), and is turned off for one without that phase (encoders apart, or every module on the
    LLM's layout), so the written config passes the check that refuses a flag that does nothing."""
    from mimo.checkpoint.replan import with_layout

    raw = yaml.safe_load(open(CONFIG))
    raw["training"]["offload_encoders"] = True
    three_phase = {"language": {"tp": 2, "dp": 2}, "images": {"dp": 4}}
    apart = {"language": {"tp": 2, "dp": 1}, "images": {"dp": 2, "rank_offset": 2}}
    same = {"language": {"dp": 4}, "images": {"dp": 4}}
    for par, kept in ((three_phase, True), (apart, False), (same, False)):
        out = with_layout(raw, par, 1)
        assert out["training"]["offload_encoders"] is kept, par
        load_config(out)  # the check accepts it as written
    assert raw["training"]["offload_encoders"] is True  # the user's config is not changed


@pytest.mark.parametrize("damage", ["binary", "directory", "list_entry", "truncated"])
def test_a_damaged_templates_file_is_planned_afresh_and_replaced(tmp_path, damage):
    """templates.json is a cache of a deterministic search: a file that cannot be used is ignored (a
    fresh search at a restart) and replaced at the next start on the configured size, never an error
    (before: tracebacks, or an error on every start until someone deleted it)."""
    d = str(tmp_path / "ck")
    os.makedirs(d)
    path = os.path.join(d, TEMPLATES)
    if damage == "directory":
        os.makedirs(path)
    else:
        content = {"binary": b"\xff\xfe\x00garbage", "list_entry": b'{"cpu": []}', "truncated": b'{"cpu": {"4"'}
        with open(path, "wb") as f:
            f.write(content[damage])
    _fake_checkpoint(d)
    cfg, out = _quiet(load_for_world, CONFIG, _auto(d), 4, "cpu", 0, 6)
    assert cfg.world_size == 4 and "layout from a fresh search" in out and "; ignored)" in out, out
    if damage == "directory":
        return
    err = io.StringIO()
    with redirect_stderr(err):
        _, out = _quiet(load_for_world, CONFIG, _auto(d), 6, "cpu", 0, 6)
    assert err.getvalue().startswith("warning: training.replan: ") and "planned again" in err.getvalue()
    assert "templates for 5, 4, 3 ranks of cpu stored" in out
    assert sorted(read_templates(d)[0]["cpu"]) == ["3", "4", "5"]
    if damage == "truncated":  # no size to plan ahead: the damaged file is still replaced
        with open(path, "w") as f:
            f.write('{"cpu": {"4"')
        with redirect_stderr(io.StringIO()):
            _, out = _quiet(load_for_world, CONFIG, _auto(d) + ["training.replan_min_ranks=6"], 6, "cpu", 0, 6)
        assert read_templates(d) == ({}, "") and out.startswith(f"replan: no templates stored in {path}"), out


def test_replan_min_ranks_bounds_the_templates_not_the_restart(tmp_path):
    """It bounds the sizes planned ahead; a restart below it is planned afresh (it used to be copied
    into the new layout's config, whose check then refused every layout for fewer ranks)."""
    d = str(tmp_path / "ck")
    _, out = _quiet(load_for_world, CONFIG, _auto(d) + ["training.replan_min_ranks=4"], 6, "cpu", 0, 6)
    assert "templates for 5, 4 ranks of cpu" in out
    _fake_checkpoint(d)
    cfg, out = _quiet(load_for_world, CONFIG, _auto(d) + ["training.replan_min_ranks=4"], 3, "cpu", 0, 6)
    assert cfg.world_size == 3 and "layout from a fresh search (no template for 3 ranks of cpu)" in out, out


def test_gpu_kind_takes_whole_names_and_their_memory():
    from mimo.checkpoint.replan import gpu_kind

    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100" and gpu_kind("NVIDIA H200") == "h200"
    assert gpu_kind("NVIDIA A100-SXM4-80GB") == "a100" and gpu_kind("cpu") == "cpu"
    # Negative controls: another chip whose name holds a known one, and a smaller memory size.
    assert gpu_kind("NVIDIA GH200 480GB") is None and gpu_kind("NVIDIA A100-SXM4-40GB") is None
    assert gpu_kind("NVIDIA B200") is None


def test_an_unknown_gpu_starts_at_the_configured_size_and_stops_a_replan(tmp_path):
    d = str(tmp_path / "ck")
    err = io.StringIO()
    with redirect_stderr(err):
        cfg, out = _quiet(load_for_world, CONFIG, _auto(d), 6, "NVIDIA B200", 0, 6)
    assert cfg.world_size == 6 and out == "" and not os.path.exists(os.path.join(d, TEMPLATES))
    assert "no profile for the GPU 'NVIDIA B200'" in err.getvalue() and err.getvalue().startswith("warning:")
    _fake_checkpoint(d)
    with pytest.raises(ConfigError, match="no profile for the GPU 'NVIDIA B200'"):
        load_for_world(CONFIG, _auto(d), 4, "NVIDIA B200", 0, 6)


def test_the_fingerprint_covers_the_gradient_reduction_precision():
    from mimo.checkpoint.replan import fingerprint
    from mimo.config import load_config

    raw = yaml.safe_load(open(CONFIG))
    raw.setdefault("training", {})["precision"] = "bf16"
    raw["training"]["grad_reduce_in_fp32"] = True
    a = fingerprint(load_config(raw))
    raw["training"]["grad_reduce_in_fp32"] = False
    assert fingerprint(load_config(raw)) != a


def _sbatch(tmp_path, nodes_gpus, ckpt, replan, trainer_error=None):
    """examples/slurm/pretrain_mimo.sbatch with stand-ins for srun and scontrol that record their calls;
    `trainer_error`: a line the stand-in srun writes where the trainer writes an error no restart fixes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    for tool, rc in (("srun", 1), ("scontrol", 0)):
        error = f"echo '{trainer_error}' > \"$MIMO_ERROR_FILE\"\n" if tool == "srun" and trainer_error else ""
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\n{error}"
                                    f"[ \"$1\" = show ] && echo node0\nexit {rc}\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": ROOT,
           "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": str(nodes_gpus), "SLURM_JOB_NODELIST": "node0",
           "SLURM_JOB_ID": "7", "CKPT_DIR": ckpt, "REPLAN": replan, "PYTHONPATH": ROOT}
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm", "pretrain_mimo.sbatch"), CONFIG],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    return r, calls.read_text() if calls.exists() else ""


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv", "bin", "activate")),
                    reason="the Slurm script activates the checkout's .venv (scripts/setup.sh)")
def test_slurm_script_checks_the_replan_before_srun_and_never_requeues_an_error(tmp_path):
    """torchrun reports every worker's exit as 1, so the script cannot tell the trainer's errors from
    a lost node after srun: the trainer's own check runs first. A start on 4 of 6 ranks with no
    checkpoint stops with the trainer's error line, exit 2, no srun and no requeue; the positive
    control (the configured 6 ranks) reaches srun, and its failure is requeued."""
    d = str(tmp_path / "ck")
    r, calls = _sbatch(tmp_path, 4, d, "auto")
    assert r.returncode == 2 and "srun" not in calls and "requeue" not in calls, (r.stdout, r.stderr, calls)
    assert "error: training.replan: auto on 4 ranks (the layout uses 6) resumes training.load, but " \
           f"{d} holds no checkpoint yet; start on 6 ranks" in r.stderr
    r, calls = _sbatch(tmp_path, 6, d, "auto")
    assert r.returncode == 1 and "ok" in r.stdout, (r.stdout, r.stderr)
    assert calls.startswith("scontrol show hostnames") and "srun --kill-on-bad-exit=1 torchrun" in calls
    assert "--set training.exit_signal_handler=true" in calls  # with CKPT_DIR: a SIGTERM saves and stops
    assert calls.rstrip().endswith("scontrol requeue 7"), calls
    # An error the trainer finds only after the start (a checkpoint of another model) is not requeued
    # either: the trainer writes its line to MIMO_ERROR_FILE, which the script reads after srun.
    os.remove(tmp_path / "calls")
    r, calls = _sbatch(tmp_path, 6, d, "auto", trainer_error="error: a checkpoint of another model")
    assert r.returncode == 2 and "srun --kill-on-bad-exit=1" in calls and "requeue" not in calls, (r.stderr, calls)
    assert "mimo: not requeued, a restart would stop again: error: a checkpoint of another model" in r.stderr


def _config_on_rank(layouts):
    """Rank r loads the config with `layouts[r]` as its 4-rank layout; the agreement's verdict."""
    import torch.distributed as dist

    from mimo.config import load_config
    from mimo.training.agreement import check_same_config

    raw = yaml.safe_load(open(CONFIG))
    raw["parallelism"] = layouts[dist.get_rank()]
    try:
        check_same_config(load_config(raw, world_size=4), torch.device("cpu"))
    except ConfigError as exc:
        return str(exc)
    return "same"


def test_ranks_that_chose_different_layouts_stop_with_one_error():
    """Each rank re-plans on its own; ranks whose choices differ (a templates file changed between
    their reads, another kind of GPU) would build different groups and hang on NCCL. The check
    right after the process group exists stops every rank with the same line; the same layout on
    every rank (the positive control) passes."""
    from mimo.runtime import run_on_ranks

    a = {"language": {"tp": 2, "dp": 2}, "images": {"dp": 4}}
    b = {"language": {"tp": 1, "dp": 4}, "images": {"dp": 4}}
    assert run_on_ranks(_config_on_rank, 4, [a] * 4, timeout_s=120) == ["same"] * 4
    got = run_on_ranks(_config_on_rank, 4, [a, a, b, a], timeout_s=120)
    assert len(set(got)) == 1 and got[0].startswith("error: config: the ranks loaded different configs"), got


# ---- end to end on CPU ranks -------------------------------------------------------------------

def _torchrun(n, sets, log, out, tmp_path):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), SCRIPT,
            "--config", CONFIG, "--device", "cpu", "--log-json", log] + [a for s in sets for a in ("--set", s)]
    with open(out, "w") as f:  # a file, not a pipe: checkpoint writer helpers may outlive the workers
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, cwd=str(tmp_path), timeout=600,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}).returncode
    return rc, open(out).read()


def _losses(log):
    return {rec["step"]: rec["loss"] for rec in map(json.loads, open(log))}


def test_six_ranks_to_four_resumes_with_the_same_losses(tmp_path):
    d = str(tmp_path / "ck")
    common = ["training.train_iters=8", "training.global_batch_size=8", "training.replan=auto"]
    # Uninterrupted 6-rank run, saving every 2 steps (its step-4 checkpoint is what a run stopped
    # after step 4 leaves; the LR is constant, so the step count after it does not matter).
    rc, out = _torchrun(6, common + [f"training.save={d}", "training.save_interval=2"],
                        str(tmp_path / "six.jsonl"), str(tmp_path / "six.out"), tmp_path)
    assert rc == 0, out[-3000:]
    assert "replan: templates for 5, 4, 3 ranks of cpu stored in" in out
    six = _losses(str(tmp_path / "six.jsonl"))

    # Without replan, 4 ranks is today's config error (one line, exit 2, before any collective).
    r = subprocess.run([sys.executable, SCRIPT, "--config", CONFIG, "--device", "cpu",
                        "--set", f"training.load={d}/iter_0000004"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "4",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, cwd=str(tmp_path))
    assert (r.returncode, r.stderr) == (2, "error: parallelism.images: needs ranks [4, 6) but the world size is 4\n")

    # Restart on 4 ranks from the step-4 checkpoint, saving to the same directory (its templates).
    rc, out = _torchrun(4, common + [f"training.save={d}", f"training.load={d}/iter_0000004"],
                        str(tmp_path / "four.jsonl"), str(tmp_path / "four.out"), tmp_path)
    assert rc == 0, out[-3000:]
    line = next(s for s in out.splitlines() if s.startswith("replanned for 4 ranks:"))
    assert "layout from the template in" in line and "resumed from" in out
    four = _losses(str(tmp_path / "four.jsonl"))
    assert sorted(four) == sorted(six)[4:] and len(four) == 4  # steps 5-8
    for s in four:
        assert abs(four[s] - six[s]) <= 1e-3 * abs(six[s]), (s, four[s], six[s])
    check = subprocess.run([sys.executable, "-m", "mimo.config", "check", os.path.join(d, "layout_4.yaml"),
                            "--world-size", "4"], capture_output=True, text=True, cwd=ROOT)
    assert (check.returncode, check.stdout) == (0, "ok\n"), check.stderr


def test_an_unwritable_save_directory_is_one_error_line(tmp_path):
    from mimo.checkpoint.replan import write_templates
    from mimo.config import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"training.replan: cannot write .*templates.json"):
        write_templates(str(blocker / "ckpt"), {})
