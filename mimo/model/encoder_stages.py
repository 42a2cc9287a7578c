"""Pipeline stages of an encoder + projector.

Stage s holds layers per `stage_layer_counts` of the encoder's parallelism;
only the first stage embeds (patch/frame embedding + learned positions), only
the last applies the final layernorm and the projector. Parameter names match
the whole `EncoderWithProjector` up to the layer offset, so sharded and
reference init and full-state gathering work unchanged.

Activations between stages are sequence-first [tokens, n_items, hidden]
([tokens / tp, ...] with sequence parallelism); tokens include a vision class
token, which only the last stage drops.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from mimo.config import MimoConfig, ParallelConfig

from .multimodal import build_encoder
from .projector import project
from .stages import single_stage_groups, stage_layer_counts


class EncoderStage(torch.nn.Module):
    def __init__(self, whole: torch.nn.Module, stage: int, num_stages: int):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.encoder = whole.encoder
        self.projector: Optional[torch.nn.Module] = whole.projector if self.last else None
        self.tokens = self.encoder.tokens
        self.hidden = self.encoder.config.hidden_size
        if not self.first:
            for attr in ("patch_embed", "frame_embed", "conv1", "conv2", "position_embeddings", "class_embedding",
                         "pre_norm"):
                if hasattr(self.encoder, attr):
                    delattr(self.encoder, attr)
        if not self.last:
            self.encoder.block.final_layernorm = None
            self.encoder.block.post_process = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: raw items [n, ...]; later stages: [tokens, n, hidden] from the previous stage."""
        if self.first:
            x = self.encoder.input_tokens(x).transpose(0, 1).contiguous()
        h = self.encoder.run_block(x, self.first, self.last)
        if not self.last:
            return h
        return project(self.projector, self.encoder.select(h.transpose(0, 1)))


def build_encoder_stage(cfg: MimoConfig, name: str, par: ParallelConfig, layout, stage: int, pgs,
                        self_group) -> EncoderStage:
    counts = stage_layer_counts(cfg.model.encoders[name].num_layers, par)
    stage_cfg = copy.deepcopy(cfg)
    stage_cfg.model.encoders[name].num_layers = counts[stage]
    whole = build_encoder(stage_cfg, name, dataclasses.replace(layout, pp=1), single_stage_groups(pgs, self_group))
    return EncoderStage(whole, stage, par.pp)
