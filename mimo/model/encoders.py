"""Modality encoders: an input embedding, positions, a megatron TransformerBlock.

Both return [n_items, tokens_per_item, hidden] (batch-first), replicated
across the encoder's tensor-parallel ranks. The architecture fields of the
encoder config cover mimo's own towers and the Hugging Face ones (CLIP:
class token, pre-layernorm, no patch bias; SigLIP; Whisper's convolutional
front-end). With sequence parallelism the transformer block sees each item's
tokens split across TP ranks (megatron is sequence-first: [tokens, items,
hidden]), and its output is gathered back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

from .norm import block_spec
from .sequence_parallel import full_sequence, shard_sequence
from .specs import encoder_layer_spec


class _Encoder(MegatronModule):
    def __init__(self, config, enc, tokens: int, pg_collection):
        super().__init__(config=config)
        self.tokens = tokens
        self.tp_group = pg_collection.tp
        extra = 1 if enc.class_token else 0
        if enc.class_token:
            self.class_embedding = torch.nn.Parameter(torch.randn(config.hidden_size) * config.init_method_std)
        self.position_embeddings = torch.nn.Parameter(
            torch.randn(tokens + extra, config.hidden_size) * config.init_method_std)
        if enc.pre_norm:
            self.pre_norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        layer = encoder_layer_spec(enc.attention, enc.attention_kernel)
        self.block = TransformerBlock(config=config, spec=block_spec(layer, config.num_layers),
                                      pre_process=True, post_process=True, post_layer_norm=enc.final_norm,
                                      pg_collection=pg_collection)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def input_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Raw items -> the first layer's input [n, tokens (+ class token), hidden]."""
        h = self.embed(x)
        if hasattr(self, "class_embedding"):
            h = torch.cat([self.class_embedding.expand(h.shape[0], 1, -1).to(h.dtype), h], dim=1)
        h = h + self.position_embeddings
        if hasattr(self, "pre_norm"):
            h = self.pre_norm(h)
        return h

    def select(self, h: torch.Tensor) -> torch.Tensor:
        """The output tokens of [n, t, hidden] block output: the class token's is dropped
        (LLaVA's `default` feature strategy)."""
        return h[:, 1:] if h.shape[1] == self.tokens + 1 else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_tokens(x)
        h = self.run_block(h.transpose(0, 1).contiguous(), first=True, last=True)  # megatron is sequence-first
        return self.select(h.transpose(0, 1))

    def run_block(self, h: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        """The transformer block on [tokens, n, hidden]: whole tokens in at the first stage and
        out at the last; between pipeline stages the sequence-parallel shards travel as they are."""
        if first:
            h = shard_sequence(h, self.config, self.tp_group)
        h = self.block(h, attention_mask=None)
        return full_sequence(h, self.config, self.tp_group) if last else h


class VisionEncoder(_Encoder):
    """Square images [n, C, H, W] -> (H/patch)^2 tokens each, ViT-style patch embedding."""

    def __init__(self, config, enc, pg_collection):
        super().__init__(config, enc, (enc.image_size // enc.patch_size) ** 2, pg_collection)
        self.image_size, self.num_channels = enc.image_size, enc.num_channels
        self.patch_embed = torch.nn.Conv2d(enc.num_channels, config.hidden_size, kernel_size=enc.patch_size,
                                           stride=enc.patch_size, bias=enc.patch_bias)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        expected = (self.num_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [n, {', '.join(map(str, expected))}], got {list(images.shape)}")
        return self.patch_embed(images.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)


class AudioEncoder(_Encoder):
    """Mel clips [n, clip_frames, num_mel_bins] -> clip_frames/frames_per_token tokens each.

    Front-end `linear`: each group of frames_per_token frames is one token.
    `conv` (Whisper): conv(k3) -> GELU -> conv(k3, stride 2) -> GELU.
    """

    def __init__(self, config, enc, pg_collection):
        super().__init__(config, enc, enc.clip_frames // enc.frames_per_token, pg_collection)
        self.clip_frames, self.frames_per_token, self.num_mel_bins = enc.clip_frames, enc.frames_per_token, enc.num_mel_bins
        h = config.hidden_size
        if enc.frontend == "conv":
            self.conv1 = torch.nn.Conv1d(enc.num_mel_bins, h, kernel_size=3, padding=1)
            self.conv2 = torch.nn.Conv1d(h, h, kernel_size=3, stride=2, padding=1)
        else:
            self.frame_embed = torch.nn.Linear(enc.frames_per_token * enc.num_mel_bins, h)

    def embed(self, clips: torch.Tensor) -> torch.Tensor:
        if clips.dim() != 3 or tuple(clips.shape[1:]) != (self.clip_frames, self.num_mel_bins):
            raise ValueError(f"audio must be [n, {self.clip_frames}, {self.num_mel_bins}], got {list(clips.shape)}")
        if hasattr(self, "conv1"):
            x = F.gelu(self.conv1(clips.transpose(1, 2)))
            return F.gelu(self.conv2(x)).transpose(1, 2)
        return self.frame_embed(clips.reshape(clips.shape[0], self.tokens, -1))
