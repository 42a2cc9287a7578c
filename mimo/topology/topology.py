"""The whole job's topology: each module's grid, this rank's roles, each edge's placement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.distributed as dist

from mimo.config import LANGUAGE, MimoConfig, placement

from .grid import ModuleGrid, build_module_grid
from .layout import Layout


@dataclass(frozen=True)
class Edge:
    """An encoder -> LLM edge of the module graph."""

    src: str
    dst: str
    placement: str  # "colocated" | "non-colocated"


@dataclass
class Topology:
    rank: int
    world_size: int
    grids: Dict[str, ModuleGrid]
    edges: List[Edge]
    # This rank alone: the "group" of a module part megatron must see as unsharded.
    self_group: Optional[dist.ProcessGroup] = None

    @property
    def roles(self) -> List[str]:
        """Modules this rank computes part of (several when colocated)."""
        return [n for n, g in self.grids.items() if g.is_member]

    def grid(self, module: str) -> ModuleGrid:
        return self.grids[module]


def edges_of(cfg: MimoConfig) -> List[Edge]:
    pl = cfg.parallelism[LANGUAGE]
    return [Edge(name, LANGUAGE, placement(cfg.parallelism[name], pl)) for name in cfg.model.encoders]


def build_topology(cfg: MimoConfig, backend: Optional[str] = None) -> Topology:
    """Collective over the world: build every module's groups in config order."""
    world = dist.get_world_size()
    if cfg.world_size != world:
        raise RuntimeError(f"the config's layout needs {cfg.world_size} ranks but {world} were launched "
                           f"(torchrun --nproc-per-node {cfg.world_size} ...)")
    grids = {}
    for name in cfg.modules:
        # The LLM's tied input/output embeddings span its first and last pipeline stages.
        tied = name == LANGUAGE and cfg.model.language.tie_embeddings
        experts = name == LANGUAGE and cfg.model.language.is_moe  # an MoE LLM's expert groups
        grids[name] = build_module_grid(name, Layout.from_config(cfg.parallelism[name]), backend, tied, experts)
    # This rank alone (a single-stage part's pipeline and embedding group): each rank makes only its
    # own, not one per rank of the world on every rank.
    self_group = dist.new_group([dist.get_rank()], backend=backend, use_local_synchronization=True)
    return Topology(rank=dist.get_rank(), world_size=world, grids=grids, edges=edges_of(cfg), self_group=self_group)
