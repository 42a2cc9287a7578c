"""Per-step metrics: the end-of-step reduction, the JSONL record and its writers, the progress bar,
and the one-step timeline (Chrome trace).

Everything that needs other ranks happens in `reduce_step` (one all-reduce of a
few floats at the end of a step, which also sums the ranks' shares of the step's
work for the FLOP count) and `gather_timeline` (one gather, on the timeline step
only); the writers run on rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mimo.config import LANGUAGE, MimoConfig
from mimo.data.items import is_native
from mimo.runtime import Runtime, Span, StepTimer, peak_memory_bytes

from .flops import RankWork, StepWork, peak_tflops, step_flops

GB = 1e9

# Config field -> (package to import, pip name).
OPTIONAL_PACKAGES = {"tensorboard_dir": ("torch.utils.tensorboard", "tensorboard"),
                     "wandb_project": ("wandb", "wandb")}


def missing_packages(cfg: MimoConfig) -> List[tuple]:
    """(`training.<field>`, reason) for each configured writer whose package is not installed.

    Checked before any process group exists, so a missing package is a config error."""
    problems = []
    for key, (module, pip_name) in OPTIONAL_PACKAGES.items():
        if getattr(cfg.training, key) is None:
            continue
        top = "tensorboard" if pip_name == "tensorboard" else module
        if importlib.util.find_spec(top) is None:
            problems.append((f"training.{key}", f"needs the {pip_name} package, which is not installed "
                                                f"(pip install {pip_name}, or pip install -e '.[metrics]')"))
    return problems


@dataclass
class StepTimes:
    """Per-step figures reduced over ranks (max)."""

    module_time_s: Dict[str, float] = field(default_factory=dict)    # forward + backward compute
    boundary_time_s: Dict[str, float] = field(default_factory=dict)  # encoder -> boundary communication
    max_memory_gb: float = 0.0
    skipped_samples: int = 0
    work: Optional[StepWork] = None  # the step's work, summed over the ranks' shares (None: none reported)


# -- the step's work in the all-reduce (MAX) -------------------------------------------------------
#
# Counts add up over ranks while times take the max; one MAX all-reduce carries both by giving each
# reporting rank (one per LLM DP replica, `flops.reports_work`) its own slots: every other rank
# leaves them zero, so the max of a slot is its one reporter's count (or any of several reporters
# that agree), and the host adds the slots up. Float64 holds the counts exactly (below 2^53).

WORK_FIELDS = ("samples", "positions", "tokens", "llm_attention_pairs")


def _native(cfg: MimoConfig) -> List[str]:
    """Native-resolution encoders: their items differ in size, so their patch and attention-pair
    counts travel too (two more slots each)."""
    return [n for n, e in cfg.model.encoders.items() if is_native(e)]


def _width(cfg: MimoConfig) -> int:
    return len(WORK_FIELDS) + len(cfg.model.encoders) + 2 * len(_native(cfg))


def work_slots(cfg: MimoConfig) -> int:
    """Length of the work part of `reduce_step`'s tensor: per LLM DP replica, the four counts, one
    item count per encoder, and a native-resolution encoder's patches and attention pairs."""
    return cfg.parallelism[LANGUAGE].dp * _width(cfg)


def pack_work(cfg: MimoConfig, share: Optional[RankWork]) -> List[float]:
    """This rank's slots: its share in the block of its LLM DP replica, zeros elsewhere."""
    width = _width(cfg)
    out = [0.0] * work_slots(cfg)
    if share is not None:
        w = share.work
        row = [float(getattr(w, f)) for f in WORK_FIELDS] + [float(w.items.get(n, 0)) for n in cfg.model.encoders]
        row += [float(d.get(n, 0)) for n in _native(cfg) for d in (w.encoder_patches, w.encoder_pairs)]
        out[share.dp_rank * width:(share.dp_rank + 1) * width] = row
    return out


def unpack_work(cfg: MimoConfig, values: Sequence[float]) -> Optional[StepWork]:
    """The step's work from the reduced slots; None when no rank reported (a caller without shares).

    The shares must cover the global batch exactly once: a sample counted on two replicas, or a replica
    whose share is missing or written into another's slots, changes the sample count and stops here
    (on every rank alike: they all hold the same reduced values)."""
    width = _width(cfg)
    rows = [values[i:i + width] for i in range(0, len(values), width)]
    totals = [sum(r[j] for r in rows) for j in range(width)]
    if totals[0] == 0:
        return None
    G = cfg.training.global_batch_size
    if totals[0] != G:
        raise RuntimeError(f"the ranks' FLOP counts cover {int(totals[0])} samples, the global batch has {G}: "
                           f"an LLM DP replica's samples were counted twice or not at all")
    n, k = len(WORK_FIELDS), len(WORK_FIELDS) + len(cfg.model.encoders)
    native = _native(cfg)
    return StepWork(samples=int(totals[0]), positions=int(totals[1]), tokens=int(totals[2]),
                    items={e: int(totals[n + i]) for i, e in enumerate(cfg.model.encoders)},
                    llm_attention_pairs=int(totals[3]),
                    encoder_patches={e: int(totals[k + 2 * i]) for i, e in enumerate(native)},
                    encoder_pairs={e: int(totals[k + 2 * i + 1]) for i, e in enumerate(native)})


def reduce_step(timer: StepTimer, cfg: MimoConfig, runtime: Runtime, skipped_samples: int,
                work: Optional[RankWork] = None) -> StepTimes:
    """One all-reduce (max) over the world of this rank's per-module times, peak memory, skip count and
    share of the step's work (`flops.rank_work`; None on ranks that report none).

    A rank contributes zero for modules it does not hold, so the max is the max over that module's ranks;
    the work shares sit in per-replica slots (`pack_work`) and are added up after the reduction.
    Call after the step's device work is synchronised."""
    modules, encoders = cfg.modules, list(cfg.model.encoders)
    totals = timer.totals()
    values = [totals.get((m, "F"), 0.0) + totals.get((m, "B"), 0.0) for m in modules]
    values += [totals.get((e, "comm"), 0.0) for e in encoders]
    values += [peak_memory_bytes(runtime) / GB, float(skipped_samples)]
    base = len(values)
    values += pack_work(cfg, work)
    t = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.tolist()
    k = len(modules)
    return StepTimes(dict(zip(modules, v[:k])), dict(zip(encoders, v[k:k + len(encoders)])),
                     v[base - 2], int(v[base - 1]), unpack_work(cfg, v[base:]))


def step_record(cfg: MimoConfig, step: int, loss: float, grad_norm: float, lr: float, step_time_s: float,
                work: StepWork, times: StepTimes, world_size: int, peak: Optional[float]) -> dict:
    """The JSONL object of one step (README, "Watching a run"). `step` is 1-based."""
    tflops = step_flops(cfg, work) / step_time_s / world_size / 1e12
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": work.tokens,
        "samples": work.samples,
        "step_time_s": step_time_s,
        "tokens_per_s": work.tokens / step_time_s,
        "tflops_per_gpu": tflops,
        "mfu": None if peak is None else tflops / peak,
        "max_memory_gb": times.max_memory_gb,
        "skipped_samples": times.skipped_samples,
        "module_time_s": times.module_time_s,
        "boundary_time_s": times.boundary_time_s,
    }


def human_line(rec: dict, positions: int, world_size: int) -> str:
    """The step line, `step N | loss X | tokens/s Y | step_time Z ms` (tokens/s over every sequence position),
    then tokens/s/rank, the gradient norm, TFLOPS, MFU and memory."""
    tps = positions / rec["step_time_s"]
    mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    return (f"step {rec['step']} | loss {rec['loss']:.4f} | tokens/s {tps:.0f} | "
            f"step_time {rec['step_time_s'] * 1e3:.1f} ms | tokens/s/rank {tps / world_size:.0f} | "
            f"grad_norm {rec['grad_norm']:.3f} | TFLOPS/GPU {rec['tflops_per_gpu']:.3g} | MFU {mfu} | "
            f"mem {rec['max_memory_gb']:.2f} GB" + _moe_fields(rec))


def _moe_fields(rec: dict) -> str:
    """An MoE LLM's step-line fields (nothing for a dense one)."""
    if "expert_load_max_over_mean" not in rec:
        return ""
    aux = rec.get("moe_aux_loss")
    load = rec["expert_load_max_over_mean"]
    return (f" | moe_aux_loss {'n/a' if aux is None else f'{aux:.4f}'}"
            f" | expert_load_max/mean {'n/a' if load is None else f'{load:.2f}'}")


class Progress:
    """A tqdm bar (step, ETA, latest loss) when `stream` is an interactive terminal; plain lines otherwise."""

    def __init__(self, total: int, stream=None):
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True)

    def step(self, loss: float, line: Optional[str]) -> None:
        if self.bar is None:
            if line is not None:
                print(line, file=self.stream, flush=True)
            return
        if line is not None:
            self.bar.write(line, file=self.stream)
        self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsWriters:
    """Rank 0's sinks for step records: JSONL file, TensorBoard, Weights & Biases (each if configured)."""

    def __init__(self, cfg: MimoConfig, log_json: Optional[str] = None):
        tr = cfg.training
        self.json = None
        path = log_json or tr.log_json
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.json = open(path, "a")
        self.tb = None
        if tr.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tr.tensorboard_dir)
        self.wandb = None
        if tr.wandb_project:
            import wandb  # honours WANDB_MODE=offline

            self.wandb = wandb.init(project=tr.wandb_project, config={"training": vars(tr)})

    def write(self, rec: dict) -> None:
        if self.json is not None:
            self.json.write(json.dumps(rec) + "\n")
            self.json.flush()
        scalars = flat_scalars(rec)
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, rec["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self) -> None:
        if self.json is not None:
            self.json.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def flat_scalars(rec: dict) -> Dict[str, float]:
    """The record's numbers as `name` / `group/name` scalars (nulls left out)."""
    out = {}
    for key, value in rec.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()})
        else:
            out[key] = float(value)
    return out


# -- timeline -------------------------------------------------------------------------------------

def gather_timeline(timer: StepTimer) -> Optional[List[List[Span]]]:
    """Every rank's spans of the step, on rank 0 (None elsewhere). Collective over the world."""
    spans = timer.spans()
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(spans, out, dst=0)
    return out


def chrome_trace(spans_by_rank: Sequence[Sequence[Span]], step: int) -> dict:
    """Chrome trace format: one process per rank, complete ("X") events in microseconds."""
    events = []
    for rank, spans in enumerate(spans_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for s in spans:
            events.append({"name": f"{s.module} {s.action} {s.microbatch}", "cat": s.module, "ph": "X",
                           "pid": rank, "tid": 0, "ts": s.start_s * 1e6, "dur": s.dur_s * 1e6,
                           "args": {"module": s.module, "action": s.action, "microbatch": s.microbatch}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"step": step}}


def write_timeline(path: str, spans_by_rank, step: int) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(chrome_trace(spans_by_rank, step), fh)


def peak_of(cfg: MimoConfig, name: Optional[str]) -> Optional[float]:
    return peak_tflops(name, cfg.training.peak_tflops)


# -- the training loop's reporter -------------------------------------------------------------------

class StepReporter:
    """What the training loop calls around each step; every rank calls it (the timeline step gathers).

    Rank 0 turns each step into a record (`step_record`), writes it to the configured sinks and
    prints the step line, or advances the progress bar on an interactive terminal.
    """

    def __init__(self, cfg: MimoConfig, trainer, runtime: Runtime, log_json: Optional[str] = None, stream=None):
        from mimo.runtime import device_name

        self.cfg, self.trainer = cfg, trainer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.writers = self.progress = None
        if self.rank == 0:
            self.peak = peak_of(cfg, device_name(runtime))
            self.writers = MetricsWriters(cfg, log_json)
            self.progress = Progress(cfg.training.train_iters, stream)

    def _timeline_step(self, step: int) -> bool:
        tr = self.cfg.training
        return tr.timeline is not None and step + 1 == tr.timeline_step

    def before_step(self, step: int) -> None:
        """`step` is 0-based. The timeline step starts together on every rank, so times line up."""
        if self._timeline_step(step):
            dist.barrier()

    def after_step(self, step: int, res) -> Optional[dict]:
        """The step's record on rank 0 (None elsewhere)."""
        tr = self.cfg.training
        if self._timeline_step(step):
            spans = gather_timeline(self.trainer.timer)
            if self.rank == 0:
                write_timeline(tr.timeline, spans, step + 1)
        if self.rank != 0:
            return None
        # The step's work: the LLM replicas' shares, summed in the step's all-reduce (`reduce_step`).
        rec = step_record(self.cfg, step + 1, res.loss, res.grad_norm, res.lr, res.step_time_s, res.times.work,
                          res.times, self.world, self.peak)
        rec["packing_efficiency"] = self.trainer.dataset.metrics(step)["packing_efficiency"]
        rec["bad_media"] = res.bad_media  # media that failed to decode after a good header, replaced by zeros
        if getattr(res, "moe", None) is not None:  # an MoE LLM (mimo.training.moe_metrics); absent for dense
            rec.update(res.moe)
        self.writers.write(rec)
        show = step % tr.log_interval == 0 or step == tr.train_iters - 1
        line = human_line(rec, res.tokens, self.world) if show else None
        self.progress.step(res.loss, line)
        return rec

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writers is not None:
            self.writers.close()
