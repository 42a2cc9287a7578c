"""Rank ranges -> per-module grids and process groups."""

from .grid import EXPERT_GROUP_DIMS, GROUP_DIMS, ModuleGrid, build_module_grid
from .layout import DIMS, EXPERT_DIMS, Layout
from .topology import Edge, Topology, build_topology, edges_of

__all__ = ["DIMS", "EXPERT_DIMS", "EXPERT_GROUP_DIMS", "Edge", "GROUP_DIMS", "Layout", "ModuleGrid", "Topology", "build_module_grid",
           "build_topology", "edges_of"]
