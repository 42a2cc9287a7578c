"""Rank ranges -> per-module grids and process groups."""

from .grid import GROUP_DIMS, ModuleGrid, build_module_grid
from .layout import DIMS, Layout
from .topology import Edge, Topology, build_topology, edges_of

__all__ = ["DIMS", "Edge", "GROUP_DIMS", "Layout", "ModuleGrid", "Topology", "build_module_grid",
           "build_topology", "edges_of"]
