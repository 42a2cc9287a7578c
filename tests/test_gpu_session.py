"""tools/gpu_session.sh, the one call a lent GPU gets: without CUDA it says so and exits 0; with a
stand-in interpreter that claims a GPU, its steps run in order, inside the budget, with flags the
real tools accept, and the output files land where the docs say."""

import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_session.sh")


def _run(out, python, budget="570", timeout=120, wheels=None, focus=()):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # By default no wheels to install (a developer's checkout may hold .whl/ for the GPU machine's Python).
    env.update(PYTHON=python, CUDA_VISIBLE_DEVICES="", WHEELS=str(wheels or str(out) + ".nowheels"))
    return subprocess.run(["bash", SCRIPT, str(out), budget, *focus], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    proc = _run(tmp_path / "out", sys.executable)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "gpu_session: no CUDA device on this machine; nothing measured"
    assert os.listdir(tmp_path / "out") == ["session.log"]


def _fake_python(tmp_path, megatron=True, pip_ok=True):
    """A stand-in for python3 on a GPU machine: claims CUDA (and megatron-core unless told not to),
    fails `-m pip` when told to, records every other command line, and writes the files the real
    tools would (so later steps find their inputs)."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python3"
    out = shlex.quote(str(tmp_path / "out"))
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
    case "$2" in
        *get_device_name*) echo "device: FakeGPU | torch 0";;
        *megatron.core*) exit {0 if megatron else 1};;
    esac
    exit 0
fi
if [ "$1 $2" = "-m pip" ]; then exit {0 if pip_ok else 1}; fi
echo "$*" >> {shlex.quote(str(calls))}
prev=
for a in "$@"; do
    case "$prev" in --out|--log-json|--json-out) echo '{{}}' > "$a";; esac
    prev=$a
done
case "$*" in *tools/gpu_bench.py*) echo '{{}}' > {out}/gpu_bench.profile.json;; esac
echo ran
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return str(fake), calls


def test_with_a_gpu_every_step_runs_in_order_with_real_flags(tmp_path):
    fake, calls = _fake_python(tmp_path)
    proc = _run(tmp_path / "out", fake)
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    tools = [re.search(r"(tools/\w+\.py|examples/pretrain_mimo\.py|mimo\.planner\.profile)", x).group(1)
             for x in lines]
    assert tools == ["tools/gpu_check.py", "tools/gpu_bench.py", "mimo.planner.profile", "examples/pretrain_mimo.py",
                     "tools/plan.py", "tools/tune_attention.py"]
    steps = re.findall(r"^step (\w+): rc (\d+)", proc.stdout, re.M)
    assert steps == [(n, "0") for n in ("gpu_check", "gpu_bench", "profile_check", "llava_1gpu", "plan_evaluate",
                                        "tune_attention")]
    assert "device: FakeGPU" in proc.stdout and "gpu_session: done in" in proc.stdout
    out = tmp_path / "out"
    assert {"session.log", "gpu_check.json", "gpu_bench.jsonl", "gpu_bench.profile.json", "llava_1gpu.jsonl",
            "plan_eval.json", "tune.log", "tuned.json"} == set(os.listdir(out))
    assert "--seqlens 16384,65536" in lines[-1]  # the whole budget was left for tuning
    _flags_exist(lines, tools)


def _flags_exist(lines, tools):
    """Every flag the script passes exists in the real tool (a renamed flag fails here, not on the GPU)."""
    for line, tool in zip(lines, tools):
        flags = set(re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", line))
        if tool == "mimo.planner.profile":
            assert not flags
            continue
        helptext = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True, cwd=ROOT,
                                  timeout=120).stdout
        missing = [f for f in flags if f not in helptext]
        assert not missing, (tool, missing)


def test_the_attention_focus_runs_the_table_tuning_and_the_tuned_table(tmp_path):
    fake, calls = _fake_python(tmp_path)
    proc = _run(tmp_path / "out", fake, focus=["attention"])
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    tools = [re.search(r"tools/\w+\.py", x).group(0) for x in lines]
    assert tools == ["tools/gpu_check.py", "tools/gpu_bench.py", "tools/tune_attention.py", "tools/gpu_bench.py"]
    steps = re.findall(r"^step (\w+): rc (\d+)", proc.stdout, re.M)
    assert steps == [(n, "0") for n in ("gpu_check", "attention", "tune_attention", "attention_tuned")]
    for bench in (lines[1], lines[3]):  # bitfield attention at the acceptance lengths only, inside the budget
        assert "--skip step,profile --seqlens 65536,32768,16384" in bench
        assert int(re.search(r"--budget-s (\d+)", bench).group(1)) >= 10
    assert f"--kernel-config {tmp_path / 'out' / 'tuned.json'}" in lines[3]
    # (gpu_bench.profile.json is the stand-in's, written for every bench call.)
    assert {"session.log", "gpu_check.json", "attention.jsonl", "tune.log", "tuned.json",
            "attention_tuned.jsonl"} == set(os.listdir(tmp_path / "out")) - {"gpu_bench.profile.json"}
    _flags_exist(lines, tools)


@pytest.mark.parametrize("budget", ["120", "250", "400"])
def test_the_attention_focus_fits_a_small_budget(tmp_path, budget):
    """Steps take no time with the stand-in, so every share is its largest: the table always runs,
    within the budget and with a positive --budget-s; the check only where 200 s remain after it."""
    fake, calls = _fake_python(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tuned.json").write_text("{}")  # a file an earlier session left
    proc = _run(tmp_path / "out", fake, budget=budget, focus=["attention"])
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    assert ("step gpu_check: skipped" in proc.stdout) == (budget == "120")
    benches = [x for x in lines if "tools/gpu_bench.py" in x]
    assert benches and all(10 <= int(re.search(r"--budget-s (\d+)", x).group(1)) < int(budget) for x in benches)
    limits = [int(x) for x in re.findall(r"== step \w+ \(limit (-?\d+)s\)", (tmp_path / "out" / "session.log")
                                         .read_text())]
    assert limits and all(10 <= x <= int(budget) for x in limits), limits
    # The earlier session's tuned.json was removed: only this session's tuning writes one.
    assert any("tune_attention.py" in x for x in lines) == (tmp_path / "out" / "tuned.json").exists()


def test_an_unknown_focus_is_refused(tmp_path):
    fake, calls = _fake_python(tmp_path)
    proc = _run(tmp_path / "out", fake, focus=["kernels"])
    assert proc.returncode == 2 and proc.stdout == "" and not calls.exists()
    assert proc.stderr == "error: the third argument must be 'attention' (or 'all', the default), got 'kernels'\n"


def test_a_short_budget_skips_what_does_not_fit(tmp_path):
    fake, calls = _fake_python(tmp_path)
    proc = _run(tmp_path / "out", fake, budget="100")
    assert proc.returncode == 0, proc.stderr
    # 100 s: the check's and the bench's limits (what is left less 240 / 170 s) are negative, so
    # both are skipped; llava gets 80 s; tuning gets one length.
    assert "step gpu_check: skipped" in proc.stdout and "step gpu_bench: skipped" in proc.stdout
    lines = calls.read_text().splitlines()
    assert not any("gpu_check.py" in x or "gpu_bench.py" in x for x in lines)
    assert any("pretrain_mimo.py" in x for x in lines)
    assert "--seqlens 16384 " in lines[-1] + " " and "65536" not in lines[-1]


def test_a_wheel_that_does_not_install_stops_the_session_with_one_error_line(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-0.0-py3-none-any.whl").write_bytes(b"not a zip")
    fake, calls = _fake_python(tmp_path, pip_ok=False)
    proc = _run(tmp_path / "out", fake, wheels=wheels)
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"error: installing {wheels}/*.whl failed") and proc.stdout.count("\n") == 1
    assert not calls.exists()  # no step ran


def test_without_cuda_wheels_are_not_installed(tmp_path):
    """The wheels are for the GPU machine's Python: without CUDA the session says so and installs nothing."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-0.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = _run(tmp_path / "out", sys.executable, wheels=wheels)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip() == "gpu_session: no CUDA device on this machine; nothing measured"


@pytest.mark.parametrize("budget", ["abc", "1.5", "-5", "0", "00", "10abc", "99999999999999999999"])
def test_a_budget_that_is_not_a_number_of_seconds_is_refused(tmp_path, budget):
    fake, calls = _fake_python(tmp_path)
    proc = _run(tmp_path / "out", fake, budget=budget)
    assert proc.returncode == 2 and proc.stdout == "" and not calls.exists()
    assert proc.stderr.startswith("error: BUDGET_S must be ") and proc.stderr.count("\n") == 1, proc.stderr


def test_without_megatron_core_it_stops_before_any_step_and_says_how_to_carry_it(tmp_path):
    fake, calls = _fake_python(tmp_path, megatron=False)
    proc = _run(tmp_path / "out", fake)
    assert proc.returncode == 1
    assert proc.stdout.startswith("error: megatron-core is not importable here: run 'bash scripts/device_wheels.sh'")
    assert proc.stdout.count("\n") == 1 and not calls.exists()


def test_device_wheels_fetches_the_megatron_core_setup_py_pins_for_the_gpu_python(tmp_path):
    """scripts/device_wheels.sh with a stand-in python3 on PATH: the pip download it asks for."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    args = tmp_path / "args.txt"
    (bin_dir / "python3").write_text(f"#!/usr/bin/env bash\necho \"$*\" > {shlex.quote(str(args))}\n")
    (bin_dir / "python3").chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "megatron_core-0.0.1-py3-none-any.whl").write_text("old")  # an older fetch is replaced
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", WHEELS=str(wheels))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_wheels.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pin = re.search(r'"megatron-core==([0-9.]+)"', open(os.path.join(ROOT, "setup.py")).read()).group(1)
    got = args.read_text().split()
    assert got[:3] == ["-m", "pip", "download"] and got[-1] == f"megatron-core=={pin}"
    assert got[got.index("--python-version") + 1] == "3.12" and got[got.index("-d") + 1] == str(wheels)
    assert "--no-deps" in got and os.listdir(wheels) == []
