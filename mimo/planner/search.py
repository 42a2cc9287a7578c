"""Layout search (Cornstarch Algorithm 1, Entrain Algorithm 3 in spirit).

For every way of giving the LLM some GPUs and a (TP, CP, PP, DP) layout, the
encoders are fitted around it in three families:

* ``homogeneous``: every module uses the LLM's layout on the same GPUs
  (the Megatron-style baseline);
* ``colocated``: same GPUs, but each encoder picks its own layout; a step is
  encoder forwards, LLM 1F1B, encoder backwards (three phases);
* ``non-colocated``: encoders get their own GPUs and overlap with the LLM,
  either sharing one rank range (their stages merged, Cornstarch's
  encoder-colocated modality parallelism) or each on separate ranks
  (encoder-parallel).

Stage partitions are frozen-aware. Candidates over memory are dropped, the
rest pre-ranked by the closed-form pipeline estimate (sum of stages on the
longest chain + (M - 1) x bottleneck) and the best ones simulated event by
event; the final ranking is by simulated step time. Layouts that use every
GPU are preferred; fewer are tried only when none is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from mimo.planner.cost_model import Calibration, CostModel, Workload, _allreduce_s
from mimo.planner.hardware import GIB, GpuSpec
from mimo.planner.memory import in_flight_microbatches, stage_memory, state_bytes_per_param
from mimo.planner.rules import cp_ok, divisors, dp_pair_ok, tp_ok
from mimo.planner.simulator import SimStage, chain, simulate_1f1b, simulate_colocated
from mimo.planner.spec import ModelSpec, ModuleSpec
from mimo.planner.stages import Layout, ModulePlan, plan_module


@dataclass(frozen=True)
class SearchSettings:
    gpus: int
    global_batch: int
    micro_batch: int
    workload: Workload
    precision: str = "bf16"
    optimizer: str = "adam"
    frozen_aware: bool = True
    max_simulations: int = 48
    max_cp: int = 8


@dataclass
class Candidate:
    family: str
    placement: str                     # colocated | non-colocated | single
    plans: dict[str, ModulePlan]
    num_microbatches: int
    estimate: float
    memory: dict[str, float]           # peak bytes per rank, per module (rank group)
    peak_memory: float
    gpus_used: int
    update_time: float
    pipeline_time: float = math.nan
    reasons: list[str] = field(default_factory=list)
    encoder_grouping: str = ""         # shared | parallel | "" (colocated)
    _sim: object = None                # how to simulate: filled by the planner

    @property
    def step_time(self) -> float:
        return self.pipeline_time + self.update_time

    @property
    def layouts(self) -> dict[str, Layout]:
        return {n: p.layout for n, p in self.plans.items()}

    def describe(self) -> str:
        parts = []
        for name, p in self.plans.items():
            r = p.layout.ranks
            parts.append(f"{name}[{r.start}:{r.stop}] {p.layout.short()}")
        return " | ".join(parts)


def _encoder_trainable(e: ModuleSpec) -> bool:
    return not e.frozen or (e.projector_kind is not None and not e.projector_frozen)


class Planner:
    def __init__(self, spec: ModelSpec, gpu: GpuSpec, settings: SearchSettings,
                 calibration: Calibration | None = None):
        if settings.gpus < 1:
            raise ValueError("gpus must be >= 1")
        if settings.micro_batch < 1 or settings.global_batch < settings.micro_batch:
            raise ValueError("need 1 <= micro_batch <= global_batch")
        self.spec, self.gpu, self.s = spec, gpu, settings
        self.cm = CostModel(gpu, settings.precision, calibration)
        self.bpe = self.cm.bpe
        self.llm_upstream = any(_encoder_trainable(e) for e in spec.encoders)
        self._plans: dict[tuple, ModulePlan] = {}
        self._chosen: dict[tuple, list[Layout]] = {}

    # ---- module plans -----------------------------------------------------
    def plan(self, module: ModuleSpec, layout: Layout, samples: float) -> ModulePlan:
        key = (module.name, layout.tp, layout.cp, layout.pp, layout.dp, samples)
        if key not in self._plans:
            upstream = self.llm_upstream if module.is_language else False
            self._plans[key] = plan_module(
                self.cm, module, layout.moved(0), samples, self.s.workload, upstream,
                frozen_aware=self.s.frozen_aware, projector_out=self.spec.language.hidden_size)
        plan = self._plans[key]
        if plan.layout.rank_offset == layout.rank_offset:
            return plan
        return ModulePlan(**{**plan.__dict__, "layout": layout})

    def module_layouts(self, module: ModuleSpec, n: int) -> list[Layout]:
        out = []
        seq = self.s.workload.seq_length
        for tp in divisors(n):
            if tp > self.gpu.gpus_per_node or not tp_ok(module, tp):
                continue
            for cp in divisors(n // tp):
                if cp > self.s.max_cp or not cp_ok(module, cp, seq):
                    continue
                for pp in divisors(n // (tp * cp)):
                    if pp > module.num_layers:
                        continue
                    out.append(Layout(tp, cp, pp, n // (tp * cp * pp)))
        return out

    def llm_layouts(self, n: int) -> list[Layout]:
        g, m = self.s.global_batch, self.s.micro_batch
        return [l for l in self.module_layouts(self.spec.language, n) if g % (m * l.dp) == 0]

    def _enc_tokens(self, e: ModuleSpec) -> float:
        """Tokens of one sample's items inside the encoder."""
        return self.s.workload.items(e.name) * e.tokens_per_item

    def _llm_tokens(self, e: ModuleSpec) -> float:
        """Tokens one sample's items become for the LLM (after a patch merger)."""
        return self.s.workload.items(e.name) * e.llm_tokens_per_item

    # ---- memory and update time --------------------------------------------
    def _stage_mem(self, plan: ModulePlan, i: int, in_flight: int) -> float:
        return stage_memory(plan.stage_params[i], plan.stage_trainable[i], plan.stage_activation[i],
                            in_flight, self.s.precision, self.s.optimizer)

    def _chain_memory(self, plan: ModulePlan, behind: int, m: int) -> float:
        pp = plan.layout.pp
        return max(self._stage_mem(plan, i, in_flight_microbatches(i, pp + behind, m)) for i in range(pp))

    def _update_time(self, plan: ModulePlan) -> float:
        lay = plan.layout
        trainable = plan.trainable_params_per_rank
        if trainable <= 0:
            return 0.0
        sync = _allreduce_s(4.0 * trainable, lay.dp, self.gpu.link_bandwidth(lay.tp * lay.cp * lay.dp))
        step = 2 * trainable * state_bytes_per_param(True, self.s.precision, self.s.optimizer) \
            / self.gpu.memory_bandwidth
        return sync + step

    def _p2p(self, nbytes: float, span: int) -> float:
        return nbytes / self.gpu.link_bandwidth(span)

    # ---- families -----------------------------------------------------------
    def _colocated(self, n: int) -> list[Candidate]:
        g, m = self.s.global_batch, self.s.micro_batch
        out = []
        for lay in self.llm_layouts(n):
            llm = self.plan(self.spec.language, lay, m)
            mb = g // (m * lay.dp)
            llm_mem = self._chain_memory(llm, 0, mb)
            variants: dict[str, dict[str, tuple]] = {"colocated": {}}
            if lay.cp == 1 and all(tp_ok(e, lay.tp) and lay.pp <= e.num_layers
                                   and dp_pair_ok(lay.dp, lay.dp, g, m, True) for e in self.spec.encoders):
                variants["homogeneous"] = {e.name: self._colocated_encoder(e, lay) for e in self.spec.encoders}
            ok = True
            for e in self.spec.encoders:
                opts = [self._colocated_encoder(e, el) for el in self.module_layouts(e, n)
                        if dp_pair_ok(el.dp, lay.dp, g, m, True)]
                if not opts:
                    ok = False
                    break
                variants["colocated"][e.name] = min(opts, key=lambda o: (o[1], o[2]))
            if not ok:
                variants.pop("colocated")
            if not self.spec.encoders:
                variants = {"single": {}}
            seen = set()
            for family, encs in variants.items():
                sig = tuple((k, v[0].layout) for k, v in sorted(encs.items()))
                if sig in seen:
                    continue
                seen.add(sig)
                plans = {"language": llm, **{k: v[0] for k, v in encs.items()}}
                enc_mem = sum(v[2] for v in encs.values())
                memory = {"language": llm_mem, **{k: v[2] for k, v in encs.items()}}
                est = self._chain_estimate([llm], mb) + sum(v[1] for v in encs.values())
                upd = sum(self._update_time(p) for p in plans.values())
                passes = [v[3] for v in encs.values()]
                cand = Candidate(family, "single" if not encs else "colocated", plans, mb, est + upd,
                                 memory, self.gpu.reserved_bytes + llm_mem + enc_mem, n, upd)
                cand._sim = ("colocated", passes)
                out.append(cand)
        return out

    def _colocated_encoder(self, e: ModuleSpec, lay: Layout):
        """(plan, phase-1 + phase-3 time, per-rank memory, pass spec)."""
        g, m = self.s.global_batch, self.s.micro_batch
        lay = Layout(lay.tp, 1, lay.pp, lay.dp, 0)
        per_replica = g // lay.dp
        mb_samples = m if per_replica % m == 0 else 1
        n_mb = per_replica // mb_samples
        plan = self.plan(e, lay, mb_samples)
        xfer = self._p2p(mb_samples * self._enc_tokens(e) * e.hidden_size * self.bpe,
                         2 * lay.tp * lay.dp)
        f, b = plan.stage_forward, plan.stage_backward
        fill_f = sum(f) + (lay.pp - 1) * xfer
        t = fill_f + (n_mb - 1) * max(f)
        if any(x > 0 for x in b):
            t += sum(b) + (lay.pp - 1) * xfer + (n_mb - 1) * max(b)
        # Phase 1 keeps every microbatch's activations until phase 3, and the
        # projected tokens wait for the LLM (with their gradients, if any).
        keep = 2 if plan.output_requires_grad else 1
        outputs = per_replica * self._llm_tokens(e) * self.spec.language.hidden_size * self.bpe * keep
        mem = max(self._stage_mem(plan, i, n_mb) for i in range(lay.pp)) + outputs
        return plan, t, mem, (f, b, n_mb, xfer)

    def _best_noncolocated_encoder(self, e: ModuleSpec, n: int, dl: int, pp: int | None) -> list[Layout]:
        key = (e.name, n, dl, pp)
        if key not in self._chosen:
            g, m = self.s.global_batch, self.s.micro_batch
            opts = []
            for el in self.module_layouts(e, n):
                if (pp is not None and el.pp != pp) or not dp_pair_ok(el.dp, dl, g, m, False):
                    continue
                p = self.plan(e, el, m * dl / el.dp)
                opts.append((p.bottleneck + sum(p.stage_total) / max(1, g // (m * dl)), el))
            opts.sort(key=lambda x: x[0])
            self._chosen[key] = [el for _, el in opts[:2]]
        return self._chosen[key]

    def _noncolocated(self, n: int) -> list[Candidate]:
        g, m = self.s.global_batch, self.s.micro_batch
        encs = self.spec.encoders
        out = []
        if not encs:
            return out
        for n_l in range(1, n):
            n_e = n - n_l
            for lay in self.llm_layouts(n_l):
                llm = self.plan(self.spec.language, lay, m)
                mb = g // (m * lay.dp)
                groupings = []
                # encoders sharing one rank range: stages merged, same pp
                for pp in range(1, min(e.num_layers for e in encs) + 1):
                    choice = [self._best_noncolocated_encoder(e, n_e, lay.dp, pp) for e in encs]
                    if all(choice):
                        groupings.append(("shared", [[(e, c[0], n_l)] for e, c in zip(encs, choice)]))
                if len(encs) > 1:
                    for split in _compositions(n_e, len(encs)):
                        offs, choice = n_l, []
                        for e, k in zip(encs, split):
                            best = self._best_noncolocated_encoder(e, k, lay.dp, None)
                            if not best:
                                break
                            choice.append([(e, best[0], offs)])
                            offs += k
                        else:
                            groupings.append(("parallel", choice))
                for grouping, choice in groupings:
                    cand = self._noncolocated_candidate(n, lay, llm, mb, grouping,
                                                        [c[0] for c in choice])
                    if cand is not None:
                        out.append(cand)
        return out

    def _noncolocated_candidate(self, n, lay, llm, mb, grouping, choice) -> Candidate | None:
        m = self.s.micro_batch
        plans = {"language": llm}
        memory = {"language": self._chain_memory(llm, 0, mb)}
        enc_plans = []
        for e, el, off in choice:
            p = self.plan(e, el.moved(off), m * lay.dp / el.dp)
            plans[e.name] = p
            enc_plans.append(p)
            memory[e.name] = self._chain_memory(p, lay.pp, mb)
        if grouping == "shared":
            shared = sum(memory[p.module.name] for p in enc_plans)
            for p in enc_plans:
                memory[p.module.name] = shared
        peak = self.gpu.reserved_bytes + max(memory.values())
        # estimate: longest chain fill + bottleneck pacing
        if grouping == "shared":
            pp = enc_plans[0].layout.pp
            merged = [sum(p.stage_total[i] for p in enc_plans) for i in range(pp)]
            enc_fill, enc_bn = sum(merged), max(merged)
        else:
            enc_fill = max(sum(p.stage_total) for p in enc_plans)
            enc_bn = max(p.bottleneck for p in enc_plans)
        est = enc_fill + sum(llm.stage_total) + (mb - 1) * max(enc_bn, llm.bottleneck)
        upd = max(self._update_time(p) for p in plans.values())
        cand = Candidate("non-colocated", "non-colocated", plans, mb, est + upd, memory, peak, n, upd,
                         encoder_grouping=grouping)
        cand._sim = ("graph", grouping)
        return cand

    def _chain_estimate(self, plans: Sequence[ModulePlan], mb: int) -> float:
        return sum(sum(p.stage_total) for p in plans) + (mb - 1) * max(p.bottleneck for p in plans)

    # ---- simulation -----------------------------------------------------------
    def llm_stages(self, llm: ModulePlan, inputs: dict[str, float]) -> list[SimStage]:
        lay = llm.layout
        xfer = self._p2p(self.s.micro_batch * self.s.workload.seq_length / lay.cp
                         * self.spec.language.hidden_size * self.bpe, 2 * lay.tp * lay.cp * lay.dp)
        return chain("language.", llm.stage_forward, llm.stage_backward, xfer, inputs)

    def stage_graph(self, cand: Candidate) -> list[SimStage]:
        llm = cand.plans["language"]
        m, n = self.s.micro_batch, cand.gpus_used
        stages: list[SimStage] = []
        inputs: dict[str, float] = {}
        encs = [cand.plans[e.name] for e in self.spec.encoders]
        boundary = lambda p: self._p2p(m * self._llm_tokens(p.module) * self.spec.language.hidden_size
                                       * self.bpe, n)
        internal = lambda p: self._p2p(p.samples_per_microbatch * self._enc_tokens(p.module)
                                       * p.module.hidden_size * self.bpe, 2 * p.layout.tp * p.layout.dp)
        if cand.encoder_grouping == "shared":
            pp = encs[0].layout.pp
            f = [sum(p.stage_forward[i] for p in encs) for i in range(pp)]
            b = [sum(p.stage_backward[i] for p in encs) for i in range(pp)]
            stages += chain("encoders.", f, b, sum(internal(p) for p in encs))
            inputs[f"encoders.{pp - 1}"] = sum(boundary(p) for p in encs)
        else:
            for p in encs:
                name = p.module.name
                stages += chain(f"{name}.", p.stage_forward, p.stage_backward, internal(p))
                inputs[f"{name}.{p.layout.pp - 1}"] = boundary(p)
        return stages + self.llm_stages(llm, inputs)

    def simulate(self, cand: Candidate) -> float:
        kind, extra = cand._sim
        llm = cand.plans["language"]
        if kind == "colocated":
            t = simulate_colocated(self.llm_stages(llm, {}), cand.num_microbatches, extra)
        else:
            t = simulate_1f1b(self.stage_graph(cand), cand.num_microbatches).iteration_time
        cand.pipeline_time = t
        return t

    # ---- driver -----------------------------------------------------------------
    def enumerate(self, n: int, fits_only: bool = True) -> list[Candidate]:
        cands = self._colocated(n) + self._noncolocated(n)
        if fits_only:
            cands = [c for c in cands if c.peak_memory <= self.gpu.memory_bytes]
        return cands

    def search(self) -> list[Candidate]:
        smallest = math.inf
        for n in range(self.s.gpus, 0, -1):
            everything = self.enumerate(n, fits_only=False)
            cands = [c for c in everything if c.peak_memory <= self.gpu.memory_bytes]
            if cands:
                break
            smallest = min([smallest] + [c.peak_memory for c in everything])
        else:
            need = f"the leanest layout needs {smallest / GIB:.1f} GiB per GPU" if smallest < math.inf \
                else "no layout satisfies the divisibility rules"
            raise ValueError(f"no layout fits on {self.s.gpus} x {self.gpu.name} "
                             f"({self.gpu.memory_bytes / GIB:.0f} GiB each): {need}")
        cands.sort(key=lambda c: c.estimate)
        chosen, per_family = [], {}
        for c in cands:
            fam = (c.family, c.encoder_grouping)
            if len(chosen) < self.s.max_simulations or per_family.get(fam, 0) < 2:
                chosen.append(c)
                per_family[fam] = per_family.get(fam, 0) + 1
        for c in chosen:
            self.simulate(c)
            c.reasons = explain(self, c)
        chosen.sort(key=lambda c: (c.step_time, c.peak_memory))
        return chosen


def _compositions(total: int, parts: int):
    if parts == 1:
        if total >= 1:
            yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def explain(planner: Planner, cand: Candidate) -> list[str]:
    """Short human reasons for why this layout behaves as predicted."""
    spec = planner.spec
    out = []
    frozen_enc = [e.name for e in spec.encoders if e.frozen]
    if frozen_enc:
        trainable_proj = [e for e in spec.encoders if e.frozen and e.projector_kind and not e.projector_frozen]
        if trainable_proj:
            out.append(f"frozen {'/'.join(frozen_enc)}: backward only through the projector")
        else:
            out.append(f"frozen {'/'.join(frozen_enc)}: backward skipped")
    if spec.language.frozen:
        out.append("frozen LLM: no weight grads, input grads only"
                   if planner.llm_upstream else "frozen LLM: backward skipped")
    if cand.family == "homogeneous":
        out.append("one layout for every module (Megatron-style)")
    elif cand.placement == "colocated":
        out.append("colocated: encoders time-share all GPUs in 3 phases, none idle")
    elif cand.placement == "non-colocated":
        encs = [cand.plans[e.name] for e in spec.encoders]
        if cand.encoder_grouping == "parallel" and len(encs) > 1:
            out.append("encoders in parallel on separate ranks")
        for p in encs:
            out.append(f"non-colocated lets {p.module.name} run at DP {p.layout.dp} "
                       f"in parallel with the LLM")
            break
    llm = cand.plans["language"]
    if llm.layout.pp > 1 and len(set(llm.stage_layers)) > 1:
        out.append(f"uneven LLM stages {llm.stage_layers}")
    if llm.layout.cp > 1:
        out.append(f"CP {llm.layout.cp} splits the {planner.s.workload.seq_length}-token sequence")
    return out
