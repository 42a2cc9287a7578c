"""The data of one training step on one rank, as the step's actions consume it.

Two ways to load a step, one per plan family:

* `shard` (homogeneous plans: every module on the language's layout): a rank
  loads only its LLM DP shard's microbatches, with the items of every encoder
  (it runs them all); the loss-token count is summed over the DP group by
  the plan's `loss tokens` collective.
* `whole` (heterogeneous plans): every rank reads the whole step, so the
  boundary windows and the loss-token count need no communication; a rank
  collates (so decodes) only the items of the encoders it holds, and builds
  LLM microbatches only if it holds the LLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from mimo.attention import BitfieldMask, plan_context_parallel
from mimo.attention.context_parallel import check_slots
from mimo.config import LANGUAGE, MimoConfig
from mimo.data import PAD_ID, collate, move, shard_indices
from mimo.model import attention_mask

from .windows import StepWindows


@dataclass
class StepData:
    n_tokens: torch.Tensor                                 # loss-carrying positions (float64; see the family)
    llm_batches: List[Dict]                                # this rank's LLM microbatches (`llm_microbatch`)
    step_batch: Dict[str, torch.Tensor] = field(default_factory=dict)  # whole step: encoder items held here
    windows: Optional[StepWindows] = None                  # whole step: boundary windows


def llm_microbatch(cfg: MimoConfig, host: Dict[str, torch.Tensor], device, dtype) -> Dict:
    """An LLM microbatch on the device, with what its forward needs derived on the host first, so
    the step never waits for the device to learn it: the attention mask, under CP the balanced
    slots (checked here), and the number of placeholder tokens of each modality."""
    mask = attention_mask(cfg, host["input_ids"], host.get("document_ids"))
    batch = move(host, device, dtype)
    batch["placeholder_counts"] = {i: int((host["input_ids"] == i).sum()) for i in cfg.placeholder_ids.values()}
    batch["attention_mask"] = None if mask is None else BitfieldMask(
        mask.bits.to(device), None if mask.document_ids is None else mask.document_ids.to(device))
    lang, cp = cfg.model.language, cfg.parallelism[LANGUAGE].cp
    if cp > 1:
        slots = plan_context_parallel(mask.bits, cp, lang.cp_block_size, lang.cp_policy, mask.document_ids)
        check_slots(slots, mask.bits.shape[1])
        batch["cp_slots"] = slots.to(device)
    return batch


def shard_step(cfg: MimoConfig, dataset, balancer, step: int, dp_rank: int, device, dtype) -> StepData:
    """A homogeneous-plan rank's microbatches (every encoder's items included)."""
    tr = cfg.training
    G = tr.global_batch_size
    if balancer.policy == "none":  # only this shard's samples are read
        shard = shard_indices(G, tr.micro_batch_size, dp_rank, cfg.parallelism[LANGUAGE].dp)
    else:
        shard = balancer.assignment([dataset.sample(step * G + i) for i in range(G)], PAD_ID).llm[dp_rank]
    batches = []
    for idx in shard:
        samples = [dataset.sample(step * G + i) for i in idx]
        batches.append(llm_microbatch(cfg, collate(samples, cfg.placeholder_ids), device, dtype))
    local = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
    return StepData(local, batches)


def whole_step(cfg: MimoConfig, dataset, balancer, step: int, comms: Dict, colocated: List[str],
               held: List[str], llm_dp_rank: Optional[int], device, dtype) -> StepData:
    """A heterogeneous-plan rank's view of the whole step; `llm_dp_rank` None: the rank holds no LLM stage."""
    G = cfg.training.global_batch_size
    samples = [dataset.sample(step * G + i) for i in range(G)]
    assignment = balancer.assignment(samples, PAD_ID)
    host = collate(samples, cfg.placeholder_ids, held)
    # Item counts per sample, on the host: every rank plans the step's boundary windows from them.
    counts = {n: host[f"{n}_counts"].tolist() for n in cfg.model.encoders}
    windows = StepWindows(cfg, comms, counts, colocated, assignment)
    n_tokens = host["loss_mask"].sum().to(torch.float64)
    if float(n_tokens) == 0:
        raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")
    llm_batches = []
    if llm_dp_rank is not None:
        for idx in windows.llm_indices(llm_dp_rank):
            llm_batches.append(llm_microbatch(cfg, collate([samples[i] for i in idx], cfg.placeholder_ids, False),
                                              device, dtype))
    return StepData(n_tokens.to(device), llm_batches, move(host, device, dtype), windows)
