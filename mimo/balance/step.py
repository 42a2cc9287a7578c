"""The trainer's side: one step's samples -> where its ranks run them.

`data.balance: none` keeps the trainer's slicing (LLM microbatch k of DP
rank d holds samples ``[k*D*m + d*m, k*D*m + (d+1)*m)``). `mmscale` reorders
the step into balanced microbatches of m samples; `entrain` assigns encoder
microbatches and LLM microbatches separately (deferral), with sizes that may
differ. Every rank derives the same assignment from the step's samples alone,
so every module (LLM shards, encoder item windows) agrees on it without
communication.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mimo.data.items import sample_grids

from .assignment import StepAssignment, contiguous
from .pipeline import Pipeline
from .policy import assign
from .workload import WorkloadModel

LANGUAGE = "language"


class StepBalancer:
    def __init__(self, cfg):
        tr = cfg.training
        self.policy = cfg.data.balance
        self.encoders = list(cfg.model.encoders)
        self.dp = cfg.parallelism[LANGUAGE].dp
        self.microbatches = tr.global_batch_size // (tr.micro_batch_size * self.dp)
        # Only a balancing policy needs the cost model (`none` must run any model the trainer can).
        if self.policy != "none":
            try:
                self.work = WorkloadModel.from_model(cfg.model, precision=tr.precision)
            except ValueError as exc:
                raise ValueError(f"data.balance: {self.policy} estimates work with the planner's cost model, "
                                 f"which cannot read this model ({exc})") from None
            self.pipeline = Pipeline.from_parallelism(cfg.parallelism, self.work)

    def assignment(self, samples: Sequence, pad_id: int) -> StepAssignment:
        """Where the step's samples (indices into `samples`) run: per LLM DP rank and microbatch."""
        if self.policy == "none":
            return contiguous(len(samples), self.dp, self.microbatches)
        # From the plan (no tokens made); packed documents each pay their own attention.
        llm = self.work.llm_documents([s.document_tokens(pad_id) for s in samples])
        # Fixed-size items cost their count; native-resolution ones each their own size (its grid).
        items = {n: np.array([s.count(n) for s in samples]) for n in self.encoders if n not in self.work.native}
        grids = {n: [sample_grids(s, n) for s in samples] for n in self.encoders if n in self.work.native}
        enc = np.zeros(len(samples))
        if items:
            enc = enc + self.work.encoder(items)
        if grids:
            enc = enc + self.work.encoder_grids(grids)
        return assign(self.policy, enc, llm, self.dp, self.microbatches, self.pipeline)
