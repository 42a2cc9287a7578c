"""What a balancing policy decides for one step, and the rules every policy keeps.

Samples are named by their index in the step (0 .. D*M*m - 1, the one global
order). ``encoder[d][k]`` are the samples whose items DP rank d encodes in
microbatch k, ``llm[d][k]`` those whose tokens its LLM runs in microbatch k,
each in execution order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

Lists = List[List[List[int]]]  # [dp rank][microbatch] -> sample indices


@dataclass
class StepAssignment:
    encoder: Lists
    llm: Lists

    @property
    def dp(self) -> int:
        return len(self.encoder)

    @property
    def microbatches(self) -> int:
        return len(self.encoder[0]) if self.encoder else 0


def contiguous(num_samples: int, dp: int, microbatches: int) -> StepAssignment:
    """Policy `none`: the trainer's slicing. Microbatch k of DP rank d is the d-th slice of
    the k-th window of D*m consecutive samples, so it is a contiguous run of the step."""
    m = _micro_batch_size(num_samples, dp, microbatches)
    lists = [[list(range(k * dp * m + d * m, k * dp * m + (d + 1) * m)) for k in range(microbatches)]
             for d in range(dp)]
    return StepAssignment(lists, [[list(mb) for mb in rank] for rank in lists])


def _micro_batch_size(num_samples: int, dp: int, microbatches: int) -> int:
    if dp < 1 or microbatches < 1:
        raise ValueError(f"dp and microbatches must be positive (got {dp}, {microbatches})")
    if num_samples % (dp * microbatches):
        raise ValueError(f"{num_samples} samples do not split into {dp} x {microbatches} microbatches")
    return num_samples // (dp * microbatches)


def violations(a: StepAssignment, num_samples: int) -> List[str]:
    """Broken rules, as sentences (empty when the assignment is valid)."""
    out = []
    seen: dict = {}
    if len(a.llm) != len(a.encoder):
        return ["encoder and llm list different DP ranks"]
    for d, (enc, llm) in enumerate(zip(a.encoder, a.llm)):
        if len(enc) != len(llm):
            out.append(f"dp {d}: encoder and llm hold different numbers of microbatches")
            continue
        flat_e = [i for mb in enc for i in mb]
        flat_l = [i for mb in llm for i in mb]
        if sorted(flat_e) != sorted(flat_l) or len(set(flat_e)) != len(flat_e):
            out.append(f"dp {d}: encoder and llm do not hold the same samples once each")
        for i in flat_e:
            if i in seen:
                out.append(f"sample {i} is on dp {seen[i]} and dp {d}")
            seen[i] = d
        encoded = set()
        for k, (e, l) in enumerate(zip(enc, llm)):
            if not l:  # the LLM stages would run a microbatch of no sequence
                out.append(f"dp {d} microbatch {k}: the LLM runs no sample")
            encoded.update(e)
            early = [i for i in l if i not in encoded]
            if early:
                out.append(f"dp {d} microbatch {k}: LLM work of {early} comes before its encoder work")
    missing = sorted(set(range(num_samples)) - set(seen))
    if missing:
        out.append(f"samples {missing[:8]} are on no DP rank")
    return out
