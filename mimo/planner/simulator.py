"""Event-driven 1F1B over a stage graph (encoder chains join the LLM chain).

Each stage is one set of GPUs running its ops in a fixed 1F1B order: ``w``
warm-up forwards, then alternating forward/backward, then ``w`` cool-down
backwards, where ``w`` is the number of stages after it on its longest path to
the loss (Cornstarch's multi-pipeline view: an encoder stage counts the LLM
stages behind it). A stage's forward and backward times are one number for
every microbatch, or one per microbatch (data-aware microbatching gives
microbatches different work). A forward waits for the same microbatch's forward on every
input stage plus that edge's transfer; a backward waits for the backward of
every consumer, plus the transfer back. Stages through which no gradient
flows (frozen, nothing trainable before them) run forwards only and never
wait for the backward pass.

Given fixed op orders, an op starts at max(its stage is free, its inputs are
ready); repeatedly advancing any stage whose next op is ready yields that
schedule exactly, independent of the order in which stages are visited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class SimStage:
    name: str
    forward: float | Sequence[float]   # seconds, for every microbatch or per microbatch
    backward: float | Sequence[float]
    inputs: Mapping[str, float] = field(default_factory=dict)  # producer -> transfer seconds


@dataclass
class SimResult:
    iteration_time: float
    busy: dict[str, float]
    events: list[tuple[str, str, int, float, float]]  # stage, F|B, microbatch, start, end

    @property
    def bubble_fraction(self) -> float:
        if not self.busy or self.iteration_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.iteration_time)


def _per_microbatch(value: float | Sequence[float], m: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * m
    out = [float(v) for v in value]
    if len(out) != m:
        raise ValueError(f"{what}: {len(out)} microbatch times for {m} microbatches")
    return out


def _topology(stages: Sequence[SimStage]):
    by_name = {s.name: s for s in stages}
    if len(by_name) != len(stages):
        raise ValueError("stage names must be unique")
    succ: dict[str, list[str]] = {s.name: [] for s in stages}
    for s in stages:
        for p in s.inputs:
            if p not in by_name:
                raise ValueError(f"stage {s.name!r} consumes unknown stage {p!r}")
            succ[p].append(s.name)
    order, state = [], {}

    def visit(n: str) -> None:
        if state.get(n) == 1:
            raise ValueError("stage graph has a cycle")
        if state.get(n) == 2:
            return
        state[n] = 1
        for p in by_name[n].inputs:
            visit(p)
        state[n] = 2
        order.append(n)

    for s in stages:
        visit(s.name)
    sinks = [n for n, q in succ.items() if not q]
    if len(sinks) != 1:
        raise ValueError(f"stage graph needs exactly one final stage, found {sinks}")
    return by_name, succ, order, sinks[0]


def simulate_1f1b(stages: Sequence[SimStage], num_microbatches: int, record: bool = False) -> SimResult:
    if num_microbatches < 1:
        raise ValueError("num_microbatches must be >= 1")
    if not stages:
        return SimResult(0.0, {}, [])
    by_name, succ, order, sink = _topology(stages)
    m = num_microbatches

    depth: dict[str, int] = {}
    for n in reversed(order):
        depth[n] = 0 if not succ[n] else 1 + max(depth[q] for q in succ[n])
    fwd = {n: _per_microbatch(by_name[n].forward, m, f"stage {n} forward") for n in order}
    bwd = {n: _per_microbatch(by_name[n].backward, m, f"stage {n} backward") for n in order}
    has_b: dict[str, bool] = {}
    for n in order:
        has_b[n] = any(b > 0 for b in bwd[n]) or any(has_b[p] for p in by_name[n].inputs)

    ops: dict[str, list[tuple[str, int]]] = {}
    for n in order:
        if not has_b[n]:
            ops[n] = [("F", k) for k in range(m)]
            continue
        w = min(depth[n], m)
        seq = [("F", k) for k in range(w)]
        for k in range(m - w):
            seq += [("F", w + k), ("B", k)]
        seq += [("B", k) for k in range(m - w, m)]
        ops[n] = seq

    end: dict[tuple[str, str, int], float] = {}
    free = {n: 0.0 for n in order}
    busy = {n: 0.0 for n in order}
    pos = {n: 0 for n in order}
    events = []
    remaining = sum(len(v) for v in ops.values())

    def ready(n: str, kind: str, k: int) -> float | None:
        t = 0.0
        if kind == "F":
            for p, xfer in by_name[n].inputs.items():
                e = end.get((p, "F", k))
                if e is None:
                    return None
                t = max(t, e + xfer)
        else:
            for q in succ[n]:
                e = end.get((q, "B", k))
                if e is None:
                    return None
                t = max(t, e + by_name[q].inputs[n])
        return t

    while remaining:
        progressed = False
        for n in order:
            while pos[n] < len(ops[n]):
                kind, k = ops[n][pos[n]]
                t = ready(n, kind, k)
                if t is None:
                    break
                dur = fwd[n][k] if kind == "F" else bwd[n][k]
                start = max(free[n], t)
                free[n] = start + dur
                end[(n, kind, k)] = free[n]
                busy[n] += dur
                if record:
                    events.append((n, kind, k, start, free[n]))
                pos[n] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked; stage graph is inconsistent")
    return SimResult(max(free.values()), busy, events)


def chain(prefix: str, forward: Sequence[float], backward: Sequence[float],
          transfer: float = 0.0, inputs: Mapping[str, float] | None = None) -> list[SimStage]:
    """Stages of one module's pipeline; ``inputs`` feed its first stage."""
    out = []
    for i, (f, b) in enumerate(zip(forward, backward)):
        ins = dict(inputs or {}) if i == 0 else {f"{prefix}{i - 1}": transfer}
        out.append(SimStage(f"{prefix}{i}", f, b, ins))
    return out


def pipeline_pass_time(times: Sequence[float], num_microbatches: int, transfer: float = 0.0) -> float:
    """One direction only (all forwards, or all backwards) through a chain:
    fill once, then the slowest stage paces the rest."""
    if not times or num_microbatches < 1:
        return 0.0
    stages = chain("s", list(times), [0.0] * len(times), transfer)
    return simulate_1f1b(stages, num_microbatches).iteration_time


def simulate_colocated(llm: Sequence[SimStage], llm_microbatches: int,
                       encoder_passes: Sequence[tuple[Sequence[float], Sequence[float], int, float]]) -> float:
    """Three-phase colocated step: every encoder's forward over the whole step,
    then the LLM's 1F1B, then every encoder's backward. Each encoder pass is
    (stage forwards, stage backwards, encoder microbatches, stage transfer)."""
    phase1 = sum(pipeline_pass_time(f, n, x) for f, _, n, x in encoder_passes)
    phase2 = simulate_1f1b(llm, llm_microbatches).iteration_time
    phase3 = sum(pipeline_pass_time(list(reversed(b)), n, x)
                 for _, b, n, x in encoder_passes if any(v > 0 for v in b))
    return phase1 + phase2 + phase3
