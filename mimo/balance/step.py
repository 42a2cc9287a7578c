"""The trainer's side: one step's samples -> the order its ranks take them in.

`data.balance: none` keeps the global order. `mmscale` permutes the step so
that the trainer's fixed slicing (LLM microbatch k of DP rank d holds
positions ``[k*D*m + d*m, k*D*m + (d+1)*m)``) yields the balanced, reordered
microbatches. Every rank derives the same permutation from the step's samples
alone, so every module (LLM shards, encoder item windows) agrees on it without
communication.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

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

    def order(self, samples: Sequence, pad_id: int) -> Optional[List[int]]:
        """Step sample index of each trainer position; None where the order stays as it is."""
        if self.policy == "none":
            return None
        tokens = np.array([int((s.document_ids >= 0).sum()) if s.document_ids is not None
                           else int((s.input_ids != pad_id).sum()) for s in samples])
        items = {n: np.array([s.count(n) for s in samples]) for n in self.encoders}
        enc = self.work.encoder(items) if items else np.zeros(len(samples))
        return assign(self.policy, enc, self.work.llm(tokens), self.dp, self.microbatches,
                      self.pipeline).order()
