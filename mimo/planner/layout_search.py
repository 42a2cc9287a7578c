"""Search and evaluation of whole layouts with the Megatron-faithful step model.

``evaluate`` costs the layout written in a config (``--evaluate``);
``search`` enumerates layouts for a GPU budget (``tools/plan.py``):

* homogeneous: the LLM's (TP, CP, PP, DP), encoders inside its first stage;
* colocated: the same LLM layouts, each encoder with its own TP and DP
  (CP 1, PP 1) on the same GPUs;
* non-colocated: an encoder island of 1, 2, 4 or a power-of-two number of
  nodes (at most half the budget), the LLM on the rest.

For every layout the search also picks SP (on whenever TP > 1: same
communication volume, less memory and elementwise work) and recompute per
module (the fastest setting whose memory fits). Costs are closed-form and
cached per module layout, so a 1024-GPU search takes about half a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mimo.config.validate import grouped_gemm_problem
from mimo.planner.hardware import GpuSpec
from mimo.planner.megatron import RECOMPUTE, Estimate, Par, StepModel, Work
from mimo.planner.rules import divisors_up_to, sp_ok, tp_ok
from mimo.planner.spec import ModelSpec

GB = 1e9


@dataclass
class Planned:
    estimate: Estimate
    pars: dict[str, Par]

    @property
    def llm_split(self) -> tuple[int, ...]:
        """The LLM's pipeline split where it was moved off the balanced one to
        fit memory: a config must name it to be costed (and run) the same."""
        e = self.estimate
        return e.llm_stage_layers if e.llm_split_moved else ()

    def as_dict(self, order: Sequence[str]) -> dict[str, Any]:
        e = self.estimate
        par = {n: self.pars[n].as_dict() for n in order}
        if self.llm_split:
            par["language"]["stage_layers"] = list(self.llm_split)
        return {"placement": e.placement, "step_time_s": round(e.step_time, 6),
                "peak_memory_gb": round(e.peak_memory / GB, 3),
                "tokens_per_s": round(e.tokens_per_s, 1),
                "parallelism": par}


def placement_of(spec: ModelSpec, pars: Mapping[str, Par]) -> str:
    llm = pars["language"].ranks
    if all(pars[e.name].ranks == llm for e in spec.encoders):
        return "colocated"
    return "non-colocated"


def layout_rule_errors(spec: ModelSpec, pars: Mapping[str, Par], global_batch: int, micro_batch: int,
                       seq_length: int, homogeneous: bool = False) -> list[str]:
    """Broken rules as ``parallelism.<module>...: reason`` strings. Encoder DP
    divides items, not samples (README, "Encoder data parallelism over items"),
    so only the LLM's batch rule ties DP to the batch."""
    errs = []
    names = [m.name for m in spec.modules]
    for m in spec.modules:
        p = pars.get(m.name)
        path = f"parallelism.{m.name}"
        if p is None:
            errs.append(f"{path}: missing")
            continue
        if p.recompute not in RECOMPUTE:
            errs.append(f"{path}.recompute: expected one of {', '.join(RECOMPUTE)}, got {p.recompute!r}")
        if homogeneous and not m.is_language:
            lp = pars.get("language")
            if lp is not None and not tp_ok(m, lp.tp):
                errs.append(f"{path}: inherits tp {lp.tp}, which does not divide its heads/hidden/ffn")
            elif lp is not None and p.sp and lp.tp > 1 and not sp_ok(m, lp.tp, 1, seq_length):
                errs.append(f"{path}.sp: inherits tp {lp.tp}, which does not divide its tokens per item")
            continue
        if min(p.tp, p.cp, p.pp, p.dp) < 1 or p.rank_offset < 0:
            errs.append(f"{path}: degrees must be >= 1 and rank_offset >= 0")
            continue
        if not tp_ok(m, p.tp):
            errs.append(f"{path}.tp: {p.tp} does not divide heads/groups/hidden/ffn")
        if m.is_language and p.cp > 1 and seq_length % (2 * p.cp):
            errs.append(f"{path}.cp: sequence {seq_length} not divisible by 2 * cp")
        if not m.is_language and p.cp != 1:
            errs.append(f"{path}.cp: encoders run with cp 1")
        if p.pp > m.num_layers:
            errs.append(f"{path}.pp: {p.pp} > num_layers {m.num_layers}")
        if p.ep != 1 or p.etp != 1:
            if not m.is_language or not m.is_moe:
                errs.append(f"{path}.ep: expert parallelism needs an MoE LLM (ep = etp = 1 here)")
            elif m.num_experts % p.ep:
                errs.append(f"{path}.ep: must divide num_moe_experts ({m.num_experts})")
            elif (p.tp * p.cp * p.dp) % (p.ep * p.etp):
                errs.append(f"{path}.ep: etp * ep must divide tp * cp * dp")
            elif m.moe_ffn % p.etp:
                errs.append(f"{path}.etp: must divide the experts' FFN width ({m.moe_ffn})")
            elif p.etp > 1 and m.moe_bias:
                errs.append(f"{path}.etp: must be 1 with add_bias_linear: true")
        if m.is_language and m.is_moe and p.tp > 1 and not p.sp:
            errs.append(f"{path}.sp: an MoE LLM with tp > 1 needs sp")
        if p.sp and p.tp > 1 and not sp_ok(m, p.tp, p.cp, seq_length):
            what = (f"the sequence ({seq_length}) divisible by tp * cp" if m.is_language
                    else f"tokens per item ({m.tokens_per_item + m.class_token}, class token included) divisible by tp")
            errs.append(f"{path}.sp: needs {what}")
    if errs or homogeneous:
        lp = pars.get("language")
        if lp is not None and not errs and global_batch % (micro_batch * lp.dp):
            errs.append("parallelism.language.dp: global_batch_size not divisible by micro_batch_size * dp")
        return errs
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = pars[a].ranks, pars[b].ranks
            if ra != rb and not (ra.stop <= rb.start or rb.stop <= ra.start):
                errs.append(f"parallelism.{b}.rank_offset: ranks partially overlap {a}'s")
    if global_batch % (micro_batch * pars["language"].dp):
        errs.append("parallelism.language.dp: global_batch_size not divisible by micro_batch_size * dp")
    if errs:
        return errs
    # Ranks no module holds, from the sorted rank ranges (the degrees can be huge).
    gaps, end = [], 0
    for start, stop in sorted({(pars[n].ranks.start, pars[n].ranks.stop) for n in names}):
        if start > end:
            gaps.append(f"{end}-{start - 1}" if start - 1 > end else f"{end}")
        end = max(end, stop)
    if gaps:
        errs.append(f"parallelism: ranks {', '.join(gaps)} belong to no module")
    return errs


class LayoutSearch:
    def __init__(self, spec: ModelSpec, gpu: GpuSpec, work: Work, global_batch: int, micro_batch: int,
                 precision: str = "bf16", distributed_optimizer: bool = True, max_cp: int = 32,
                 grad_reduce_in_fp32: bool = True):
        self.spec, self.gpu, self.work = spec, gpu, work
        self.g, self.m = global_batch, micro_batch
        self.precision, self.distributed_optimizer = precision, distributed_optimizer
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.model = StepModel(spec, gpu, work, global_batch, micro_batch, precision, distributed_optimizer,
                               grad_reduce_in_fp32)
        self.limit = gpu.memory_bytes
        self.max_cp = max_cp

    # ---- evaluate ----------------------------------------------------------------
    def evaluate(self, pars: Mapping[str, Par], homogeneous: bool = False, fit_memory: bool = False) -> Estimate:
        """Cost a given layout. Its pipeline split is ``stage_layers``, or
        else the balanced one, which the trainer does not change when it
        runs out of memory; ``fit_memory`` costs the fastest split that fits
        instead (what the search would write). The homogeneous baseline is
        always split as a tuned Megatron run splits it."""
        errs = layout_rule_errors(self.spec, pars, self.g, self.m, self.work.seq_length, homogeneous)
        if errs:
            raise ValueError(errs[0])
        if homogeneous:
            return self.model.homogeneous(pars)
        return self.model.evaluate(placement_of(self.spec, pars), pars, fit_memory)

    # ---- search --------------------------------------------------------------------
    def llm_layouts(self, n: int) -> list[tuple[int, int, int, int]]:
        lang, seq = self.spec.language, self.work.seq_length
        out = []
        # Each degree is bounded (TP by a node, CP by max_cp, PP by the
        # layers), so only divisors up to that bound are tried.
        for tp in divisors_up_to(n, self.gpu.gpus_per_node):
            if not tp_ok(lang, tp):
                continue
            for cp in divisors_up_to(n // tp, self.max_cp):
                if cp > 1 and seq % (2 * cp):
                    continue
                for pp in divisors_up_to(n // (tp * cp), lang.num_layers):
                    dp = n // (tp * cp * pp)
                    if self.g % (self.m * dp) == 0:
                        out.append((tp, cp, pp, dp))
        return out

    def _with_ep(self, layouts):
        """Each LLM layout with every expert split it allows (ep = etp = 1 only for a dense LLM).
        EP and expert TP re-divide the tp * cp * dp ranks (etp * ep must divide them); ep divides
        the number of experts; etp, like TP, stays within a node, divides each expert's FFN and
        keeps the experts runnable as grouped GEMMs (the config check's rule: no biases, which
        megatron-core's experts only take at etp 1, and widths a multiple of 8). An MoE LLM with TP needs SP (megatron-core routes each TP rank's
        shard)."""
        lang = self.spec.language
        for tp, cp, pp, dp in layouts:
            if not lang.is_moe:
                yield tp, cp, pp, dp, 1, 1
                continue
            if tp > 1 and not self._sp(lang, tp, cp):
                continue
            ranks = tp * cp * dp
            for ep in divisors_up_to(ranks, lang.num_experts):
                if lang.num_experts % ep:
                    continue
                for etp in divisors_up_to(ranks // ep, self.gpu.gpus_per_node):
                    if etp == 1 or (lang.moe_ffn % etp == 0 and grouped_gemm_problem(
                            lang.hidden_size, lang.moe_ffn, etp, lang.moe_bias) is None):
                        yield tp, cp, pp, dp, ep, etp

    def _sp(self, module, tp: int, cp: int) -> bool:
        """SP wherever TP > 1 and the sequence splits evenly (the config check's rule)."""
        return tp > 1 and sp_ok(module, tp, cp, self.work.seq_length)

    def encoder_layouts(self, e, n: int) -> list[tuple[int, int]]:
        return [(tp, n // tp) for tp in divisors_up_to(n, self.gpu.gpus_per_node) if tp_ok(e, tp)]

    def _best(self, options, placement) -> Planned | None:
        """Fastest option that fits (options: iterables of pars dicts)."""
        best = None
        for pars in options:
            est = self.model.evaluate(placement, pars)
            if est.peak_memory <= self.limit and (best is None or est.step_time < best.estimate.step_time):
                best = Planned(est, dict(pars))
        return best

    def _with_encoders(self, lp: Par, encoders: dict[str, list[Par]]):
        """Every encoder's options combined greedily: one encoder varies while
        the others keep their first (fastest-first) option."""
        names = list(encoders)
        base = {n: opts[0] for n, opts in encoders.items()}
        yield {"language": lp, **base}
        for n in names:
            for opt in encoders[n][1:]:
                yield {"language": lp, **base, n: opt}

    def search(self, gpus: int) -> list[Planned]:
        spec = self.spec
        encs = spec.encoders
        found: list[Planned] = []
        # With fused attention ``selective`` saves no memory, so the search
        # tries the LLM without recompute and, for each placement where
        # nothing fits that way, with ``full``.
        for tp, cp, pp, dp, ep, etp in self._with_ep(self.llm_layouts(gpus)):
            sp = self._sp(spec.language, tp, cp)
            fitted: dict[str, Planned] = {}
            for rec in ("none", "full"):
                lp = Par(tp, cp, pp, dp, sp, rec, 0, ep=ep, etp=etp)
                if self.model.chain_memory(self.model.llm_chain(lp), 0, self.g // (self.m * dp),
                                           dp * cp) > self.limit:
                    continue    # not even the LLM alone fits
                if not encs:
                    # the LLM alone fits (checked above): one candidate, the
                    # first recompute setting that fits
                    if "language" not in fitted:
                        fitted["language"] = Planned(self.model.heterogeneous({"language": lp}), {"language": lp})
                    continue
                if "homogeneous" not in fitted and all(tp_ok(e, tp) for e in encs):
                    # Homogeneous: every encoder inherits the LLM's TP, so each must split at it.
                    enc_recs = {e.name: [Par(tp, cp, 1, dp, self._sp(e, tp, 1), r, 0) for r in ("none", "full")]
                                for e in encs}
                    h = self._best(self._with_encoders(lp, enc_recs), "homogeneous")
                    if h:
                        fitted["homogeneous"] = h
                if "colocated" not in fitted:
                    opts = {e.name: [Par(e_tp, 1, 1, e_dp, self._sp(e, e_tp, 1), r, 0)
                                     for e_tp, e_dp in self.encoder_layouts(e, gpus) for r in ("none", "full")]
                            for e in encs}
                    c = self._best(self._with_encoders(lp, opts), "colocated")
                    if c:
                        fitted["colocated"] = c
            found += fitted.values()
        if encs and gpus > 1:
            found += self._search_non_colocated(gpus)
        if not found:
            llm_sizes = [gpus] + ([gpus - k for k in self._islands(gpus)] if encs and gpus > 1 else [])
            if not any(self.llm_layouts(n) for n in llm_sizes):
                lang = spec.language
                raise ValueError(
                    f"no layout splits {gpus} GPUs for this model and batch: the LLM's TP x CP x PP x DP "
                    f"must fill them (or all but an encoder island), with TP <= {self.gpu.gpus_per_node} "
                    f"dividing its heads, PP <= its {lang.num_layers} layers and DP dividing "
                    f"global_batch_size / micro_batch_size = {self.g // self.m}")
            raise ValueError(f"no layout fits on {gpus} x {self.gpu.name} "
                             f"({self.limit / GB:.0f} GB each)")
        found.sort(key=lambda p: (p.estimate.step_time, p.estimate.peak_memory))
        return found

    def _islands(self, gpus: int) -> list[int]:
        node = self.gpu.gpus_per_node
        sizes = {s for s in (1, 2, 4) if s < node}
        k = node
        while k <= gpus // 2:
            sizes.add(k)
            k *= 2
        return sorted(s for s in sizes if s <= gpus // 2)

    def _search_non_colocated(self, gpus: int) -> list[Planned]:
        found = []
        encs = self.spec.encoders
        for n_e in self._islands(gpus):
            n_l = gpus - n_e
            for tp, cp, pp, dp, ep, etp in self._with_ep(self.llm_layouts(n_l)):
                # The LLM's memory does not depend on the encoders here:
                # its fastest fitting recompute setting is chosen alone.
                lp = None
                for rec in ("none", "full"):
                    cand = Par(tp, cp, pp, dp, self._sp(self.spec.language, tp, cp), rec, 0, ep=ep, etp=etp)
                    ch = self.model.llm_chain(cand)
                    if self.model.chain_memory(ch, 0, self.g // (self.m * dp), dp * cp) <= self.limit:
                        lp = cand
                        break
                if lp is None:
                    continue
                opts = {e.name: [Par(e_tp, 1, 1, e_dp, self._sp(e, e_tp, 1), r, n_l)
                                 for e_tp, e_dp in self.encoder_layouts(e, n_e) for r in ("none", "full")]
                        for e in encs}
                best = self._best(self._with_encoders(lp, opts), "non-colocated")
                if best:
                    found.append(best)
        return found
