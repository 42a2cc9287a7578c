"""A step's pipeline timeline under an assignment, from the planner's 1F1B simulator.

One DP replica is simulated at a time: the encoder's stages (non-colocated)
feed the LLM's stages, every microbatch with its own forward and backward
times. Encoder forward k encodes ``encoder[k]``; encoder backward k runs the
samples whose gradients LLM microbatch k returns, i.e. ``llm[k]`` (split
backward: deferred samples' encoder backward follows their LLM work). A
colocated encoder runs the three-phase schedule instead: all encoder
forwards, the LLM's 1F1B, all encoder backwards. The step time is the
slowest replica's. Stage time is module work over the GPUs that share it
(TP x CP x PP, and the encoder's DP over the LLM's, since encoder DP divides
items over every replica's microbatch); communication is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Sequence

import numpy as np

from mimo.planner.simulator import SimResult, SimStage, chain, simulate_1f1b

from .assignment import StepAssignment
from .workload import WorkloadModel


@dataclass(frozen=True)
class Pipeline:
    llm_stages: int = 1
    llm_gpus: float = 1.0            # GPUs one LLM replica's work is spread over (tp * cp * pp)
    encoder_stages: int = 1
    encoder_gpus: float = 1.0        # GPUs per LLM replica for the encoder (tp * pp * dE / dL)
    colocated: bool = False
    llm_forward_share: float = 1 / 3
    encoder_forward_share: float = 1 / 3

    @property
    def depth(self) -> int:
        """Stages a microbatch crosses in the forward pass."""
        return self.llm_stages + (0 if self.colocated else self.encoder_stages)

    @classmethod
    def from_parallelism(cls, parallelism: Mapping[str, Any], workload: WorkloadModel) -> "Pipeline":
        """From a config's `parallelism` section (dicts or mimo.config dataclasses)."""
        def get(p, key, default=1):
            v = p.get(key, default) if isinstance(p, Mapping) else getattr(p, key, default)
            return default if v is None else v

        lang = parallelism["language"]
        enc_name = workload.vision or next((e.name for e in workload.spec.encoders), None)
        share = dict(llm_forward_share=workload.llm_forward_share,
                     encoder_forward_share=workload.encoder_forward_share)
        llm_gpus = get(lang, "tp") * get(lang, "cp") * get(lang, "pp")
        if enc_name is None or enc_name not in parallelism:
            return cls(get(lang, "pp"), llm_gpus, 1, 1.0, True, **share)
        enc = parallelism[enc_name]
        size = lambda p: get(p, "tp") * get(p, "cp") * get(p, "pp") * get(p, "dp")  # noqa: E731
        colocated = (get(enc, "rank_offset", 0), size(enc)) == (get(lang, "rank_offset", 0), size(lang))
        enc_gpus = get(enc, "tp") * get(enc, "pp") * get(enc, "dp") / get(lang, "dp")
        return cls(get(lang, "pp"), llm_gpus, get(enc, "pp"), enc_gpus, colocated, **share)

    def replica_time(self, enc: np.ndarray, llm: np.ndarray, encoder: Sequence[Sequence[int]],
                     llm_lists: Sequence[Sequence[int]], record: bool = False) -> SimResult:
        """Simulated time of one replica's microbatches (lists of sample indices)."""
        m = len(encoder)
        e_work = np.array([enc[list(mb)].sum() for mb in encoder]) / self.encoder_gpus
        e_back = np.array([enc[list(mb)].sum() for mb in llm_lists]) / self.encoder_gpus
        l_work = np.array([llm[list(mb)].sum() for mb in llm_lists]) / self.llm_gpus
        lf, ef = self.llm_forward_share, self.encoder_forward_share
        ls, es = self.llm_stages, self.encoder_stages
        if self.colocated:
            stages = chain("llm", [list(l_work * lf)] * ls, [list(l_work * (1 - lf))] * ls)
            res = simulate_1f1b(stages, m, record)
            extra = float(e_work.sum() * ef + e_back.sum() * (1 - ef))  # phases 1 and 3
            return SimResult(res.iteration_time + extra, res.busy, res.events)
        enc_stages = chain("enc", [list(e_work * ef)] * es, [list(e_back * (1 - ef))] * es)
        stages = enc_stages + chain("llm", [list(l_work * lf)] * ls, [list(l_work * (1 - lf))] * ls,
                                    inputs={f"enc{es - 1}": 0.0})
        return simulate_1f1b(stages, m, record)

    def step_time(self, enc: np.ndarray, llm: np.ndarray, a: StepAssignment) -> float:
        return max(self.replica_time(enc, llm, a.encoder[d], a.llm[d]).iteration_time for d in range(a.dp))


def microbatch_loads(work: np.ndarray, lists: Sequence[Sequence[Sequence[int]]]) -> List[float]:
    """Work of every microbatch of every DP rank, rank-major."""
    return [float(work[list(mb)].sum()) for rank in lists for mb in rank]


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (std / mean); 0 for no work."""
    v = np.asarray(values, dtype=np.float64)
    mean = v.mean() if v.size else 0.0
    return float(v.std() / mean) if mean > 0 else 0.0
