"""Projectors from an encoder's hidden size to the LLM's, tensor parallel over the encoder's TP group."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule

from .architecture import ACTIVATION_FUNCS
from .native_vision import PatchMerger
from .specs import mlp_spec


class LinearProjector(MegatronModule):
    """One column-parallel linear layer whose output is gathered across TP.

    (megatron's `affine` MultimodalProjector adds the TP-local bias to the
    gathered output, which breaks for TP > 1; adding the bias before the
    gather avoids that.)
    """

    def __init__(self, config, input_size: int, tp_group):
        super().__init__(config=config)
        self.linear = ColumnParallelLinear(input_size, config.hidden_size, config=config,
                                           init_method=config.init_method, bias=True, gather_output=True,
                                           skip_bias_add=False, tp_group=tp_group)

    def forward(self, hidden_states):
        out, _ = self.linear(hidden_states)
        return out


def build_projector(llm_config, encoder_hidden: int, kind: str, tp_group, activation: str = "gelu",
                    encoder_cfg=None) -> MegatronModule:
    """A projector that outputs the LLM hidden size.

    megatron's MLP takes its output width from config.hidden_size, so the
    projector gets the LLM's config (ffn width = LLM hidden, as in LLaVA's
    2-layer MLP) with the encoder's width as input size. `patch_merger`
    (native-resolution vision) also reads spatial_merge_size and
    normalization from `encoder_cfg`.
    """
    act, _ = ACTIVATION_FUNCS[activation]
    # Biased, ungated linears whatever the LLM's own MLP looks like (LLaVA's projector).
    cfg = dataclasses.replace(llm_config, ffn_hidden_size=llm_config.hidden_size, num_layers=1,
                              add_bias_linear=True, gated_linear_unit=False, activation_func=act)
    if kind == "mlp":
        return MultimodalProjector(cfg, mlp_spec().submodules, "mlp", encoder_hidden, tp_group=tp_group)
    if kind == "linear":
        return LinearProjector(cfg, encoder_hidden, tp_group)
    if kind == "patch_merger":
        if encoder_cfg is None:
            raise ValueError("projector kind patch_merger needs the encoder's config (spatial_merge_size, normalization)")
        return PatchMerger(cfg, encoder_hidden, encoder_cfg.spatial_merge_size, encoder_cfg.normalization, tp_group,
                           activation)
    raise ValueError(f"projector kind must be mlp, linear or patch_merger, got {kind!r}")


def project(projector: MegatronModule, tokens: torch.Tensor) -> torch.Tensor:
    """[n, t, h_enc] -> packed [n * t, h_llm] in item order."""
    n, t, h = tokens.shape
    out = projector(tokens.reshape(n * t, 1, h))  # megatron linear layers want [s, b, h]
    return out.reshape(n * t, -1)
