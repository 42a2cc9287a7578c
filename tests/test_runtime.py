"""Runtime: backend selection, megatron CPU adaptations, and the multi-rank harness's failure handling."""

import time

import pytest
import torch

from mimo.runtime import RankFailed, run_on_ranks, select_runtime


def test_select_runtime_cpu():
    rt = select_runtime("cpu")
    assert rt.device.type == "cpu" and rt.backend == "gloo"
    with pytest.raises(ValueError):
        select_runtime("tpu")
    if not torch.cuda.is_available():
        assert select_runtime("auto").backend == "gloo"
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            select_runtime("cuda")


def _rng_tracker_forks_cpu_state():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.manual_seed(5)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    after = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    from mimo.runtime import megatron_scope, select_runtime

    outside = torch.cuda.current_device
    with megatron_scope(select_runtime("cpu")):
        device = torch.cuda.current_device()
    assert torch.cuda.current_device is outside  # the adaptation is scoped: nothing changed outside it
    return torch.equal(before, after), torch.equal(a, b), device


def test_megatron_rng_tracker_on_cpu():
    untouched, same, device = run_on_ranks(_rng_tracker_forks_cpu_state, 1)[0]
    assert untouched          # the fork restores the default generator
    assert not same           # the tracked state advances between forks
    assert str(device) == "cpu"


def _cross_entropy_compiled_frames():
    """megatron-core's fused cross entropy on a CPU rank, then again with torch.compile's default
    stance restored: the loss both ways and how many frames dynamo compiled for each."""
    import torch.distributed as dist
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    logits, target = torch.randn(5, 2, 11), torch.randint(0, 11, (5, 2))
    group = dist.new_group([0])
    out = []
    for stance in ("as set up", "default"):
        if stance == "default":
            torch.compiler.set_stance("default")  # negative control: megatron's jit_fuser compiles again
        before = counters["frames"]["total"]
        loss = fused_vocab_parallel_cross_entropy(logits.clone(), target, group)
        out.append((loss, counters["frames"]["total"] - before))
    return out


def test_cpu_ranks_run_megatron_fusions_eagerly():
    """Adaptation 7 of megatron_cpu: no dynamo compile per rank process; the same loss as compiled."""
    (eager, eager_frames), (compiled, compiled_frames) = run_on_ranks(_cross_entropy_compiled_frames, 1)[0]
    assert eager_frames == 0
    assert compiled_frames > 0  # the counter sees a compile when there is one
    torch.testing.assert_close(eager, compiled, rtol=1e-6, atol=1e-6)


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the harness
    return "unreachable"


def test_a_failing_rank_fails_the_run_instead_of_hanging():
    start = time.time()
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError: boom on purpose"):
        run_on_ranks(_fail_on_rank_one, 2, timeout_s=120)
    assert time.time() - start < 100


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the check runs for real (minutes)")
def test_gpu_check_says_there_is_nothing_to_check_without_cuda():
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "gpu_check.py")], capture_output=True,
                          text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cuda"] is False and "nothing to check" in report["message"]


def test_gpu_check_reports_each_check_and_survives_one_that_raises(monkeypatch, capsys):
    """The report's control flow, with CUDA faked and the checks stood in for: every check runs even
    when one raises, each is printed on stderr as it ends (a run cut short by a time limit keeps
    them), --quick leaves flex_attention out of the kernel check, and the report says which failed."""
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools"))
    import gpu_check

    seen = {}

    def kernels(seqlens, heads, head_dim, iters, compare):
        seen["kernels"] = (seqlens, compare)
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check, "check_kernels", kernels)
    monkeypatch.setattr(gpu_check, "check_training_step", lambda steps: {"ok": True, "steps": steps})
    monkeypatch.setattr(gpu_check, "check_offload", lambda numel: {"ok": True})
    capsys.readouterr()
    assert gpu_check.main(["--quick"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["ok"] is False and report["device"] == "NVIDIA H100 80GB HBM3"
    assert report["kernels"] == {"ok": False, "error": "RuntimeError: out of resource: shared memory"}
    assert report["training_step"] == {"ok": True, "steps": 3} and report["offload"] == {"ok": True}
    assert seen["kernels"] == ([4096, 8192], ("bitfield",))
    lines = [ln for ln in err.splitlines() if ln.startswith("gpu_check: ")]
    assert [ln.split(" ")[1] for ln in lines] == ["kernels", "training_step", "offload"]


def _env_value():
    import os

    return os.environ.get("MIMO_TEST_ENV")


def test_ranks_see_the_callers_environment_of_each_call(monkeypatch):
    # Ranks fork from a long-lived fork server; they must still see changes made since it started.
    monkeypatch.setenv("MIMO_TEST_ENV", "first")
    assert run_on_ranks(_env_value, 1) == ["first"]
    monkeypatch.setenv("MIMO_TEST_ENV", "second")
    assert run_on_ranks(_env_value, 1) == ["second"]


def test_next_step_loads_in_the_background_and_raises_at_its_step():
    """`NextStep`: the started step is loaded on another thread and handed over by `take`; a load that
    failed raises at the step it belongs to; a `take` of another step loads that step now."""
    import threading

    from mimo.runtime import NextStep, select_runtime

    threads = {}

    def load(step):
        threads[step] = threading.current_thread().name
        if step == 3:
            raise ValueError("bad data in step 3")
        return step * 10

    ahead = NextStep(select_runtime("cpu"), load)
    assert ahead.take(0) == 0 and threads[0] == threading.current_thread().name  # nothing pending: here
    ahead.start(1)
    ahead.settle()
    assert ahead.take(1) == 10 and threads[1].startswith("mimo-next-step")
    ahead.start(2)
    assert ahead.take(5) == 50  # not the step loaded ahead: waited for, discarded, loaded here
    ahead.start(3)
    ahead.settle()  # the error stays with its step
    with pytest.raises(ValueError, match="bad data in step 3"):
        ahead.take(3)
    # close: waits for a load still running, then its thread ends (the run is over)
    release = threading.Event()
    ahead = NextStep(select_runtime("cpu"), lambda step: release.wait(5) and step)
    ahead.start(7)
    threading.Timer(0.2, release.set).start()
    ahead.close()
    assert release.is_set() and ahead.pending is None
    assert not any(t.name.startswith("mimo-next-step") and t.is_alive() for t in ahead.pool._threads)
    with pytest.raises(RuntimeError, match="shutdown"):
        ahead.start(8)


def test_rendezvous_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """Rank 0's store port is not one the kernel may give an outgoing connection meanwhile (the
    EADDRINUSE race of a bind(0) port), is free, and a taken port is passed over."""
    import random
    import socket

    from mimo.runtime import launch

    low = launch._ephemeral_low()
    if low <= launch._FIRST_PORT + 1000:
        pytest.skip(f"ephemeral range starts at {low}: nothing below it to choose from")
    ports = [launch.free_port() for _ in range(20)]
    assert all(launch._FIRST_PORT <= p < low for p in ports), ports
    assert len(set(ports)) > 10  # chosen at random, not one fixed port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        other = next(p for p in ports if p != ports[0])
        picks = iter([ports[0], other])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert launch.free_port() == other
