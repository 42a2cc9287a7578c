"""Per-module process groups over each module's own rank range.

Every rank builds every module's grid, in config order, with the same group
enumeration, because creating a process group is a collective over the whole
world: a rank that skipped a module it does not belong to would deadlock the
others. Groups are created with megatron-core's HyperCommGrid.

An MoE LLM (`build_module_grid(..., experts=True)`) gets a second
HyperCommGrid over the same ranks, `etp-ep-edp-pp` (`Layout.expert_groups`),
for megatron-core's expert groups: `ep`, `expt_tp`, `tp_ep`, `expt_dp` and
`tp_ep_pp`. Other modules keep them degenerate (the dense groups, and a
size-1 `ep`), creating no extra groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from .layout import EXPERT_DIMS, Layout

# The groups megatron-core's modules read from a ProcessGroupCollection,
# keyed by the collection's attribute name.
GROUP_DIMS = {
    "tp": ["tp"],
    "cp": ["cp"],
    "dp": ["dp"],
    "pp": ["pp"],
    "tp_cp": ["tp", "cp"],
    "dp_cp": ["cp", "dp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
    "mp": ["tp", "pp"],
}
# An MoE LLM's expert groups, over the expert decomposition (`Layout.expert_groups`), keyed by the
# ProcessGroupCollection attribute megatron-core's MoE layers, DDP and optimizer read.
EXPERT_GROUP_DIMS = {
    "ep": ["ep"],
    "expt_tp": ["etp"],
    "tp_ep": ["etp", "ep"],
    "expt_dp": ["edp"],
    "tp_ep_pp": ["etp", "ep", "pp"],
}
# The dense HyperCommGrid keeps megatron-core's "tp-cp-ep-dp-pp" order with an ep dim of size 1:
# a module without experts takes its size-1 groups as megatron's (unused) `ep` group.
_DENSE_GRID_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclass
class ModuleGrid:
    """One module's grid; `groups` holds this rank's groups (empty if not a member)."""

    name: str
    layout: Layout
    rank: int
    groups: Dict[str, dist.ProcessGroup] = field(default_factory=dict)
    hyper_grid: Optional[HyperCommGrid] = None

    @property
    def is_member(self) -> bool:
        return self.layout.contains(self.rank)

    @property
    def coords(self) -> Dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    def pg_collection(self) -> ProcessGroupCollection:
        """The groups megatron-core modules of this module are built with."""
        if not self.is_member:
            raise RuntimeError(f"rank {self.rank} holds no part of module {self.name!r}")
        pgs = ProcessGroupCollection()
        for key, group in self.groups.items():
            setattr(pgs, key, group)
        # megatron-core's embedding group: the first and last pipeline stage ranks of one TP/CP/DP
        # coordinate, over which finalize_model_grads sums the gradients of a tied embedding and its
        # last-stage copy. Built only for an LLM with tied embeddings and pp > 1 (`build_module_grid`);
        # otherwise, and on middle stages, nothing is tied across stages. mimo has no learned
        # position embeddings (RoPE), so the position-embedding group spans this stage alone.
        pgs.embd = self.groups.get("embd", self.groups["pp"] if self.layout.pp == 1 else None)
        pgs.pos_embd = self.groups["pp"] if self.layout.pp == 1 else None
        if "expt_dp" not in self.groups:
            # No mixture-of-experts: expert groups degenerate to the dense ones.
            pgs.expt_tp = self.groups["tp"]
            pgs.tp_ep = self.groups["tp"]
            pgs.expt_dp = self.groups["dp"]
            pgs.tp_ep_pp = self.groups["mp"]
        return pgs

    @property
    def expert_coords(self) -> Dict[str, int]:
        """This rank's (etp, ep, edp, pp) coordinates (`Layout.expert_coords`)."""
        return self.layout.expert_coords(self.rank)


def embedding_groups(layout: Layout) -> List[List[int]]:
    """megatron-core's embedding groups of a pipelined module: for each TP/CP/EP/DP coordinate, the
    [first stage, last stage] ranks of its pipeline group."""
    if layout.pp == 1:
        raise ValueError("a module in one pipeline stage has no embedding group across stages")
    return [[g[0], g[-1]] for g in layout.groups(["pp"])]


def _create_groups(grid: ModuleGrid, hyper: HyperCommGrid, group_dims: Dict[str, List[str]], enumerate_groups,
                   name: str) -> None:
    for key, dims in group_dims.items():
        expected = sorted(sorted(g) for g in enumerate_groups(dims))
        got = sorted(sorted(g) for g in hyper.get_rank_enum(dims))
        if expected != got:  # our coordinate math and megatron's grid must agree
            raise RuntimeError(f"{name}: group enumeration for {dims} differs from HyperCommGrid's")
        pg = hyper.create_pg(dims)
        if pg is not None and grid.is_member:
            grid.groups[key] = pg


def build_module_grid(name: str, layout: Layout, backend: Optional[str] = None,
                      tied_embeddings: bool = False, experts: bool = False) -> ModuleGrid:
    """Collective: every rank must call this for every module, in the same order (and with the same
    `tied_embeddings`: with pp > 1 it adds the embedding groups, `embedding_groups`; and the same
    `experts`: an MoE module's expert groups, `EXPERT_GROUP_DIMS`)."""
    shape = [layout.tp, layout.cp, 1, layout.dp, layout.pp]
    hyper = HyperCommGrid(shape, list(_DENSE_GRID_DIMS), rank_offset=layout.rank_offset, backend=backend)
    grid = ModuleGrid(name=name, layout=layout, rank=dist.get_rank(), hyper_grid=hyper)
    _create_groups(grid, hyper, GROUP_DIMS, layout.groups, name)
    if not experts:
        if layout.ep != 1 or layout.etp != 1:
            raise ValueError(f"{name}: ep = {layout.ep}, etp = {layout.etp} but the module has no experts")
        pg = hyper.create_pg(["ep"])  # size-1 groups
        if pg is not None and grid.is_member:
            grid.groups["ep"] = pg
    else:
        expert = HyperCommGrid(layout.expert_shape, list(EXPERT_DIMS), rank_offset=layout.rank_offset,
                               backend=backend)
        _create_groups(grid, expert, EXPERT_GROUP_DIMS, layout.expert_groups, name)
    if tied_embeddings and layout.pp > 1:
        pg, _ = dist.new_subgroups_by_enumeration(embedding_groups(layout), backend=backend)
        if pg is not None and grid.is_member:  # None on middle stages and outside the module
            grid.groups["embd"] = pg
    return grid
