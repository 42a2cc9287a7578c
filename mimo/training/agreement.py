"""The ranks check that they planned the same step before its data moves.

Every rank plans each step from the records alone (which records, packed how, which are bad, how
many tokens each item makes) and the boundary communicators trust that every rank's plan is the
same: no plan travels. Ranks that read different files (a record or image rewritten while the run
reads it, nodes that mount another copy of the data) or tokenize differently (nodes with another
tokenizer or transformers version) would plan different steps and post sends and receives that do
not match; NCCL checks neither sizes nor order, so the job would hang or mix up data. Here each
rank reduces a 56-bit digest of its plan over all ranks on gloo, through each node's leader
(mimo.runtime.fan_in: 24 bytes, on the background thread that loads the step, before anything of
the step is sent), and a disagreement stops every rank with the same `error:` line.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from mimo.config import ConfigError, MimoConfig
from mimo.data.llava import DataError
from mimo.runtime.fan_in import FanIn


def _slots(digest: int, failed: bool, device: torch.device) -> torch.Tensor:
    """What the ranks reduce (MAX): [digest, -digest, failed]."""
    return torch.tensor([digest, -digest, int(failed)], dtype=torch.int64, device=device)


def _verdict(slots: torch.Tensor) -> tuple[bool, bool]:
    """After the MAX reduction: whether every rank holds the same digest (the largest equals the
    smallest) and whether any rank flagged a failure."""
    high, neg_low, any_failed = slots.tolist()
    return high == -neg_low, bool(any_failed)


def check_same_config(cfg: MimoConfig, device: torch.device) -> None:
    """Every rank, once, right after the process group exists and before anything is built on it:
    the ranks loaded the same config. Each rank reads its YAML, applies its overrides and, under
    `training.replan: auto`, chooses its layout on its own; nodes that read different files (a
    config edited while the job starts, another checkout, a templates file changed between the
    ranks' reads) or see different GPUs would build different process groups and communicators,
    which on NCCL hangs. One all-reduce of a 56-bit digest (its max and the max of its negation)
    finds any difference, and every rank stops with the same line."""
    digest = int.from_bytes(hashlib.sha256(repr(cfg).encode()).digest()[:7], "big")
    slots = _slots(digest, False, device)
    dist.all_reduce(slots, op=dist.ReduceOp.MAX)
    if not _verdict(slots)[0]:
        raise ConfigError([("config", "the ranks loaded different configs (the YAML file, its --set overrides, or "
                                      "under training.replan: auto the layout each chose): every rank must read "
                                      "the same files and see the same kind of GPU")])


class PlanAgreement:
    """Collective at construction (every rank, the same point of start-up): the groups it checks over."""

    def __init__(self, dataset, timeout_minutes: float):
        self.group: Optional[FanIn] = None
        # Mock data is a function of the seed and the sample index alone: nothing read can differ.
        if hasattr(dataset, "plan_digest") and dist.get_world_size() > 1:
            # Gloo groups of its own: the check runs on the loading thread while the step's
            # collectives run on the others.
            self.group = FanIn(timeout_minutes)

    def checks(self, dataset) -> bool:
        """Whether steps of `dataset` are checked: the trainer's dataset, or one put in its place on every
        rank (as the HF logits tool does; without `plan_digest` it is not checked)."""
        return self.group is not None and hasattr(dataset, "plan_digest")

    def check(self, step: int, digest: int, failure: Optional[BaseException]) -> None:
        """Every rank, in step order, before the step's data is used: `digest` of this rank's plan of
        `step` (`plan_digest`), or the `failure` that stopped this rank planning it. Planning can fail on
        one rank only (a read error; a record that tokenises otherwise there than in the record index):
        that rank still takes its part in the reduction, with its failure flagged, so that the others
        do not wait for it; every rank then raises, the failed one its own error."""
        slots = _slots(digest, failure is not None, torch.device("cpu"))
        self.group.all_reduce(slots, op=dist.ReduceOp.MAX)
        same, failed = _verdict(slots)
        if failure is not None:
            raise failure
        if failed:
            raise DataError(f"error: data: another rank failed to plan step {step} (its own error line names the "
                            "cause)")
        if not same:
            raise DataError(f"error: data: the ranks planned different samples for step {step}: every rank must "
                            "read the same records and media (data.path, data.image_root) and tokenize them alike; "
                            "a file changed while the ranks read it, or nodes see different copies of the data or "
                            "different tokenizer or transformers versions")
