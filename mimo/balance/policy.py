"""The `data.balance` policies behind one call."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .assignment import StepAssignment, contiguous
from .entrain import entrain
from .mmscale import mmscale
from .pipeline import Pipeline

POLICIES = ("none", "mmscale", "entrain")


def assign(policy: str, enc: np.ndarray, llm: np.ndarray, dp: int, microbatches: int,
           pipeline: Optional[Pipeline] = None) -> StepAssignment:
    """One step's assignment; ``enc``/``llm``: work per sample of the step, in step order."""
    enc, llm = np.asarray(enc, dtype=np.float64), np.asarray(llm, dtype=np.float64)
    if policy == "none":
        return contiguous(len(llm), dp, microbatches)
    if policy == "mmscale":
        return mmscale(enc, llm, dp, microbatches, pipeline)
    if policy == "entrain":
        return entrain(enc, llm, dp, microbatches)
    raise ValueError(f"unknown balance policy {policy!r} (expected one of {', '.join(POLICIES)})")
