"""A rank's parts of the model: the stage of every module whose layout holds the rank.

Each part is initialised as `training.init` says, from its module's own seed
(so its weights do not depend on the layout or on which other modules a rank
builds), then overwritten by Hugging Face weights where the config names them.
"""

from __future__ import annotations

import zlib
from typing import Dict, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo.config import LANGUAGE, MimoConfig
from mimo.hf import load_hf_part
from mimo.model import build_encoder, build_llm
from mimo.model.encoder_stages import build_encoder_stage
from mimo.model.reference_init import expert_shard, load_shard
from mimo.model.sharded_init import init_sharded
from mimo.model.stages import build_llm_stage, stage_layer_offset
from mimo.runtime import collective_device
from mimo.topology import Topology

_ALL_GROUPS = ("tp", "cp", "pp", "dp", "ep", "tp_cp", "dp_cp", "tp_dp_cp", "mp", "embd", "pos_embd",
               "expt_tp", "tp_ep", "expt_dp")


def module_seed(seed: int, module: str) -> int:
    """Each module is initialised from its own seed, so its weights do not depend on
    which other modules a rank builds (or in which order)."""
    return (seed * 1_000_003 + zlib.crc32(module.encode())) % (2 ** 63)


def build_parts(cfg: MimoConfig, topo: Topology, hf_modules: Dict, hf_sources: Dict
                ) -> Tuple[Dict[str, torch.nn.Module], Dict[str, int]]:
    """(module -> this rank's part, module -> global index of the part's first layer), config order."""
    parts, offsets = {}, {}
    for name in list(cfg.model.encoders) + [LANGUAGE]:
        g = topo.grid(name)
        if not g.is_member:
            continue
        par, lay, stage = cfg.parallelism[name], g.layout, g.coords["pp"]
        spec = cfg.model.language if name == LANGUAGE else cfg.model.encoders[name]
        offsets[name] = stage_layer_offset(spec.num_layers, par, stage)

        def build(pgs, name=name, par=par, lay=lay, stage=stage):
            if name == LANGUAGE:
                return (build_llm(cfg, lay, pgs) if lay.pp == 1
                        else build_llm_stage(cfg, par, lay, stage, pgs, topo.self_group))
            return (build_encoder(cfg, name, lay, pgs) if lay.pp == 1
                    else build_encoder_stage(cfg, name, par, lay, stage, pgs, topo.self_group))

        parts[name] = _init(cfg, topo, name, build, g.pg_collection(), offsets[name], hf_modules.get(name),
                            hf_sources)
    return parts, offsets


def _init(cfg: MimoConfig, topo: Topology, name: str, build, pgs: ProcessGroupCollection, layer_offset: int,
          hf, hf_sources: Dict) -> torch.nn.Module:
    seed = module_seed(cfg.training.seed, name)
    torch.manual_seed(seed)
    part = build(pgs)  # under `sharded` megatron leaves the weights unset (see initialized_by_megatron)
    grid = topo.grid(name)
    if name == LANGUAGE and cfg.model.language.is_moe:
        from .optimizer import mark_expert_grads

        mark_expert_grads(part, grid.layout)  # expert gradients reduce over expert DP
    tp_rank, tp_size = grid.coords["tp"], grid.layout.tp
    experts = expert_shard(cfg.model.language, grid) if name == LANGUAGE else None  # MoE: routed experts
    if not (hf and hf.complete):  # a module wholly loaded from HF needs no initial weights
        if cfg.training.init == "sharded":
            init_sharded(part, cfg, name, layer_offset, tp_rank, tp_size, experts)
        elif cfg.training.init == "reference":
            torch.manual_seed(seed)
            full = _reference_module(cfg, topo, name)
            load_shard(part, full.state_dict(keep_vars=False), layer_offset, tp_rank, tp_size, experts)
        else:  # local: megatron drew each stage's weights on its own
            _copy_tied_embedding(part, grid)
    if hf:
        load_hf_part(part, hf, hf_sources[hf.directory], layer_offset, tp_rank, tp_size, experts)
    return part


def _copy_tied_embedding(part: torch.nn.Module, grid) -> None:
    """Under `local` init: the last pipeline stage's tied output weight starts as the first stage's
    embedding (megatron's own first-step broadcast; sharded, reference and HF initialisation draw
    or read both from the embedding's name instead). Collective over the embedding group."""
    group = grid.groups.get("embd")
    if group is None:  # not tied across stages, or a middle stage
        return
    first = dist.get_process_group_ranks(group)[0]
    w = part.shared_embedding_or_output_weight()
    # The parts are still in host memory here; NCCL moves device tensors only.
    t = w.data.to(collective_device())
    with torch.no_grad():
        dist.broadcast(t, src=first, group=group)
        if t is not w.data:
            w.data.copy_(t.cpu())


def _reference_module(cfg: MimoConfig, topo: Topology, name: str) -> torch.nn.Module:
    """The whole module, unsharded, built on this rank alone from the module's seed."""
    pgs = ProcessGroupCollection()
    for key in _ALL_GROUPS:
        setattr(pgs, key, topo.self_group)
    layout = topo.grid(name).layout.__class__()  # every size 1
    if name == LANGUAGE:
        return build_llm(cfg, layout, pgs)
    return build_encoder(cfg, name, layout, pgs)
