"""Modality encoders: an input embedding, learned positions, a megatron TransformerBlock.

Both return [n_items, tokens_per_item, hidden] (batch-first), replicated
across the encoder's tensor-parallel ranks. With sequence parallelism the
transformer block sees each item's tokens split across TP ranks (megatron is
sequence-first: [tokens, items, hidden]), and its output is gathered back.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

from .norm import block_spec
from .sequence_parallel import full_sequence, shard_sequence
from .specs import encoder_layer_spec


class _Encoder(MegatronModule):
    def __init__(self, config, tokens: int, attention: str, pg_collection):
        super().__init__(config=config)
        self.tokens = tokens
        self.tp_group = pg_collection.tp
        self.position_embeddings = torch.nn.Parameter(torch.randn(tokens, config.hidden_size) * config.init_method_std)
        self.block = TransformerBlock(config=config, spec=block_spec(encoder_layer_spec(attention), config.num_layers),
                                      pre_process=True, post_process=True, pg_collection=pg_collection)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position_embeddings  # [n, tokens, hidden]
        h = self.run_block(h.transpose(0, 1).contiguous(), first=True, last=True)  # megatron is sequence-first
        return h.transpose(0, 1)

    def run_block(self, h: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        """The transformer block on [tokens, n, hidden]: whole tokens in at the first stage and
        out at the last; between pipeline stages the sequence-parallel shards travel as they are."""
        if first:
            h = shard_sequence(h, self.config, self.tp_group)
        h = self.block(h, attention_mask=None)
        return full_sequence(h, self.config, self.tp_group) if last else h


class VisionEncoder(_Encoder):
    """Square images [n, C, H, W] -> (H/patch)^2 tokens each, ViT-style patch embedding."""

    def __init__(self, config, image_size: int, patch_size: int, num_channels: int, attention: str, pg_collection):
        super().__init__(config, (image_size // patch_size) ** 2, attention, pg_collection)
        self.image_size, self.num_channels = image_size, num_channels
        self.patch_embed = torch.nn.Conv2d(num_channels, config.hidden_size, kernel_size=patch_size,
                                           stride=patch_size)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        expected = (self.num_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [n, {', '.join(map(str, expected))}], got {list(images.shape)}")
        return self.patch_embed(images).flatten(2).transpose(1, 2)


class AudioEncoder(_Encoder):
    """Mel clips [n, clip_frames, num_mel_bins] -> clip_frames/frames_per_token tokens each."""

    def __init__(self, config, clip_frames: int, frames_per_token: int, num_mel_bins: int, attention: str,
                 pg_collection):
        super().__init__(config, clip_frames // frames_per_token, attention, pg_collection)
        self.clip_frames, self.frames_per_token, self.num_mel_bins = clip_frames, frames_per_token, num_mel_bins
        self.frame_embed = torch.nn.Linear(frames_per_token * num_mel_bins, config.hidden_size)

    def embed(self, clips: torch.Tensor) -> torch.Tensor:
        if clips.dim() != 3 or tuple(clips.shape[1:]) != (self.clip_frames, self.num_mel_bins):
            raise ValueError(f"audio must be [n, {self.clip_frames}, {self.num_mel_bins}], got {list(clips.shape)}")
        return self.frame_embed(clips.reshape(clips.shape[0], self.tokens, -1))
