"""Layer norms that run under megatron-core's sequence parallelism without apex or Transformer Engine.

megatron's CPU-capable norm (`WrappedTorchNorm`) refuses sequence parallelism
because nothing would sum its weight gradients across the TP group: each TP
rank normalises only its sequence shard, so each holds a partial gradient.
megatron's fused norms mark such weights `sequence_parallel`, and
megatron-core's `finalize_model_grads` (which mimo's gradient sync calls) sums
every weight so marked over the TP group, so a plain torch norm with that mark
is all that is missing.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class TorchNorm:
    """torch LayerNorm / RMSNorm per `config.normalization`, megatron's norm constructor signature."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization must be one of {', '.join(kinds)}, got {config.normalization!r}")
        # In the model's parameter dtype like every megatron layer beside it: CUDA's layer norm
        # refuses bf16 activations with fp32 weights (the CPU kernel accepts the mix).
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def block_spec(layer_spec, num_layers: int) -> TransformerBlockSubmodules:
    """A TransformerBlock of `num_layers` layers whose final norm is `TorchNorm`; `layer_spec` may
    also be a list of one spec per layer."""
    specs = list(layer_spec) if isinstance(layer_spec, list) else [layer_spec] * num_layers
    if len(specs) != num_layers:
        raise ValueError(f"{len(specs)} layer specs for {num_layers} layers")
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchNorm)
