"""Training for layouts where every module shares one layout (colocated, PP = 1).

Each rank holds a TP shard of every module for its DP shard of the batch.
Heterogeneous layouts (per-module rank ranges and shapes) need the boundary
communicators and schedules of mimo.comm / mimo.schedule and are refused
here with a clear message.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.distributed as dist

from mimo.config import LANGUAGE, MimoConfig
from mimo.data import MockMultimodalDataset, collate, move, shard_indices
from mimo.model import MultimodalModel, build_encoder, build_llm
from mimo.runtime import Runtime, synchronize
from mimo.topology import Topology, build_topology

from .grad_sync import allreduce_gradients, clip_by_global_norm, local_grad_sq_norm, trainable
from .optim import build_optimizer


def unsupported_layout(cfg: MimoConfig) -> List[str]:
    """Why this trainer cannot run the layout (empty when it can), as `path: reason` lines."""
    problems = []
    lang = cfg.parallelism[LANGUAGE]
    for name, p in cfg.parallelism.items():
        if (p.tp, p.cp, p.pp, p.dp, p.ep, p.rank_offset) != (lang.tp, lang.cp, lang.pp, lang.dp, lang.ep,
                                                             lang.rank_offset):
            problems.append(f"parallelism.{name}: per-module layouts that differ from parallelism.language "
                            "are not supported by this trainer yet (heterogeneous schedules are pending)")
    if lang.pp != 1:
        problems.append("parallelism.language.pp: pipeline parallelism is not supported by this trainer yet")
    if lang.cp != 1:
        problems.append("parallelism.language.cp: context parallelism is not supported by this trainer yet")
    return problems


def module_seed(seed: int, module: str) -> int:
    """Each module is initialised from its own seed, so its weights do not depend on
    which other modules a rank builds (or in which order)."""
    return (seed * 1_000_003 + zlib.crc32(module.encode())) % (2 ** 63)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    tokens: int          # sequence positions in the global batch
    loss_tokens: int     # positions that carry a loss
    step_time_s: float


class Trainer:
    def __init__(self, cfg: MimoConfig, runtime: Runtime):
        problems = unsupported_layout(cfg)
        if problems:
            raise ValueError("\n".join(problems))
        self.cfg, self.runtime = cfg, runtime
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.training.precision]
        self.topo: Topology = build_topology(cfg, backend=runtime.backend)
        self.grid = self.topo.grid(LANGUAGE)
        encoders = {}
        for name in cfg.model.encoders:
            torch.manual_seed(module_seed(cfg.training.seed, name))
            g = self.topo.grid(name)
            encoders[name] = build_encoder(cfg, name, g.layout, g.pg_collection())
        torch.manual_seed(module_seed(cfg.training.seed, LANGUAGE))
        llm = build_llm(cfg, self.grid.layout, self.grid.pg_collection())
        self.model = MultimodalModel(cfg, encoders, llm).to(runtime.device)
        self.parts: Dict[str, torch.nn.Module] = {**encoders, LANGUAGE: llm}
        self.params = {name: trainable(m.parameters()) for name, m in self.parts.items()}
        self.optimizers = {name: build_optimizer(p, cfg.training) for name, p in self.params.items()}
        self.dataset = MockMultimodalDataset(cfg)

    def microbatches(self, step: int):
        tr, c = self.cfg.training, self.grid.coords
        for idx in shard_indices(tr.global_batch_size, tr.micro_batch_size, c["dp"], self.grid.layout.dp):
            samples = [self.dataset.sample(step * tr.global_batch_size + i) for i in idx]
            yield move(collate(samples, self.cfg.placeholder_ids), self.runtime.device, self.dtype)

    def forward_backward(self, step: int):
        """Accumulate this rank's gradients for one global batch; returns (loss sum, loss tokens)."""
        batches = list(self.microbatches(step))
        dp_group = self.grid.groups["dp_cp"]
        n_tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
        dist.all_reduce(n_tokens, group=dp_group)
        if n_tokens.item() == 0:
            raise RuntimeError(f"step {step}: the global batch has no token that carries a loss")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        for b in batches:
            per_token = self.model(b)
            # Normalise by the global batch's token count: the DP sum of these
            # gradients is then exactly the single-rank per-token mean.
            loss = (per_token.float() * b["loss_mask"]).sum() / n_tokens.float()
            loss.backward()
            loss_sum += loss.detach().double()
        dist.all_reduce(loss_sum, group=dp_group)
        return float(loss_sum), int(n_tokens.item())

    def reduce_gradients(self) -> float:
        c = self.grid.coords
        for name, params in self.params.items():
            allreduce_gradients(params, self.topo.grid(name).groups["dp_cp"])
        local = sum(local_grad_sq_norm(p, c["tp"], c["dp"] * self.grid.layout.cp + c["cp"])
                    for p in self.params.values())
        return clip_by_global_norm(list(self.params.values()), torch.as_tensor(local), self.cfg.training.clip_grad,
                                   self.runtime.device)

    def train_step(self, step: int) -> StepResult:
        synchronize(self.runtime)
        start = time.perf_counter()
        for params in self.params.values():
            for p in params:
                p.grad = None
        loss, n_tokens = self.forward_backward(step)
        norm = self.reduce_gradients()
        for opt in self.optimizers.values():
            if opt is not None:
                opt.step()
        synchronize(self.runtime)
        tr = self.cfg.training
        return StepResult(step, loss, norm, tr.global_batch_size * self.cfg.data.seq_length, n_tokens,
                          time.perf_counter() - start)
