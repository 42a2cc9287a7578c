"""Step time and peak RSS of a small 2-rank (DP2) run: `python tools/bench_optimizer.py REPO '{"precision": "bf16"}'`.

REPO: the checkout whose tests/tiny.py gives the base config (run with PYTHONPATH=REPO)."""

import json
import statistics
import sys

if __name__ == "__main__" and sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
if __name__ == "__main__" and len(sys.argv) != 3:
    sys.exit(__doc__)
sys.path.insert(0, sys.argv[1] + "/tests")
from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime, peak_memory_bytes
from mimo.training import Trainer
from tiny import tiny  # noqa: E402

def _run(raw, steps):
    rt = select_runtime("cpu")
    t = Trainer(load_config(raw), rt)
    times = [t.train_step(s).step_time_s for s in range(steps)]
    return {"step_s": statistics.median(times[2:]), "rss": peak_memory_bytes(rt)}

if __name__ == "__main__":
    extra = json.loads(sys.argv[2])
    raw = tiny(dp=2)
    raw["model"]["language"].update(hidden_size=128, num_layers=4, num_attention_heads=8, num_query_groups=4)
    raw["training"].update(optimizer="adam", lr=0.01, train_iters=8, **extra)
    res = run_on_ranks(_run, 2, raw, 8)
    print(json.dumps({"cfg": extra, "step_ms": round(1000 * max(r["step_s"] for r in res), 1),
                      "peak_rss_mib": round(max(r["rss"] for r in res) / 2**20)}))
