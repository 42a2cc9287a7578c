"""Pipeline stages of an encoder + projector.

Stage s holds layers per `stage_layer_counts` of the encoder's parallelism;
only the first stage embeds (patch/frame embedding + learned positions), only
the last applies the final layernorm and the projector. Parameter names match
the whole `EncoderWithProjector` up to the layer offset, so sharded and
reference init, Hugging Face import and full-state gathering work unchanged.

Activations between stages are sequence-first [tokens, n_items, hidden]
([tokens / tp, ...] with sequence parallelism); tokens include a vision class
token, which only the last stage drops. A native-resolution ViT's items are
one packed sequence of every image's patches: [Σ patches (/ tp), 1, hidden];
each of its stages is handed the items' grids (host metadata every rank
holds), from which it makes the masks and rotary table of its own layers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from mimo.config import MimoConfig, ParallelConfig
from mimo.data.items import PackedItems

from .multimodal import build_encoder
from .native_vision import NativeVisionEncoder, check_grids
from .projector import project
from .stages import single_stage_groups, stage_layer_counts


class EncoderStage(torch.nn.Module):
    def __init__(self, whole: torch.nn.Module, stage: int, num_stages: int):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.encoder = whole.encoder
        self.projector: Optional[torch.nn.Module] = whole.projector if self.last else None
        self.native = isinstance(self.encoder, NativeVisionEncoder)
        self.tokens = None if self.native else self.encoder.tokens
        self.hidden = self.encoder.config.hidden_size
        if not self.first:
            for attr in ("patch_embed", "frame_embed", "conv1", "conv2", "position_embeddings", "class_embedding",
                         "pre_norm"):
                if hasattr(self.encoder, attr):
                    delattr(self.encoder, attr)
        if not self.last:
            self.encoder.block.final_layernorm = None
            self.encoder.block.post_process = False

    def forward(self, x, grids: Optional[Sequence] = None) -> torch.Tensor:
        """First stage: raw items [n, ...] (native: `PackedItems`); later stages: [tokens, n, hidden]
        from the previous stage (native: [Σ patches, 1, hidden] and the items' `grids`)."""
        if self.native:
            return self._native(x, grids)
        if self.first:
            x = self.encoder.input_tokens(x).transpose(0, 1).contiguous()
        h = self.encoder.run_block(x, self.first, self.last)
        if not self.last:
            return h
        return project(self.projector, self.encoder.select(h.transpose(0, 1)))

    def _native(self, x, grids: Optional[Sequence]) -> torch.Tensor:
        if self.first:
            if not isinstance(x, PackedItems):
                raise TypeError(f"the first stage of a native-resolution encoder takes PackedItems, got "
                                f"{type(x).__name__}")
            grids = check_grids(x.grids, self.encoder.merge)
            x = self.encoder.embed(x.patches, grids)
        else:
            if grids is None:
                raise ValueError("a later stage of a native-resolution encoder needs its items' grids")
            grids = check_grids(grids, self.encoder.merge)
        h = self.encoder.run_block(x, grids, self.first, self.last)
        # The patch merger takes [Σ patches, hidden] -> [Σ patches / merge², LLM hidden].
        return self.projector(h[:, 0]) if self.last else h


def build_encoder_stage(cfg: MimoConfig, name: str, par: ParallelConfig, layout, stage: int, pgs,
                        self_group) -> EncoderStage:
    counts = stage_layer_counts(cfg.model.encoders[name].num_layers, par)
    layers = (sum(counts[:stage]), counts[stage])  # the stage's global layer offset and count
    whole = build_encoder(cfg, name, dataclasses.replace(layout, pp=1), single_stage_groups(pgs, self_group),
                          layers=layers)
    return EncoderStage(whole, stage, par.pp)
