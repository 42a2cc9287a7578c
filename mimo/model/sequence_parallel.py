"""Where mimo's own code meets megatron's sequence-parallel layout and activation recompute.

With `parallelism.<module>.sp`, megatron keeps the activations between its
transformer layers sharded along the sequence (dim 0 of [s, b, h]) across the
module's TP group. mimo's glue (patch embedding, projector, the merge of
modality tokens into the LLM sequence, the boundary communicators) works on
whole sequences, replicated over TP as without SP. These helpers convert at the
seams: `shard_sequence` going into megatron layers, `full_sequence` coming out.

Gradients: both sides of a seam are replicated over TP outside SP regions, so
`full_sequence`'s backward keeps this rank's slice of the (identical) whole
gradient, and `shard_sequence`'s backward all-gathers the slices.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

from mimo.attention import BitfieldMask
from mimo.attention.context_parallel import ContextParallelMask


def shard_sequence(x: torch.Tensor, config, tp_group) -> torch.Tensor:
    """Whole [s, ...] -> this TP rank's [s / tp, ...] when the module runs sequence parallel."""
    if not config.sequence_parallel:
        return x
    return scatter_to_sequence_parallel_region(x, group=tp_group)


def full_sequence(x: torch.Tensor, config, tp_group) -> torch.Tensor:
    """This TP rank's [s / tp, ...] -> whole [s, ...] when the module runs sequence parallel."""
    if not config.sequence_parallel:
        return x
    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=tp_group)


def shard_len(seq_len: int, config) -> int:
    """Sequence length of this rank's activations between layers (what pipeline stages exchange)."""
    return seq_len // config.tensor_model_parallel_size if config.sequence_parallel else seq_len


def llm_input_layout(llm, decoder_input: torch.Tensor) -> torch.Tensor:
    """The assembled (whole-sequence) LLM input in the layout the LLM's first layer expects."""
    return shard_sequence(decoder_input, llm.config, llm.pg_collection.tp)


def tensor_masks_when_recomputing(model: torch.nn.Module) -> torch.nn.Module:
    """Hand mask objects to a recomputing GPTModel's layers in their tensor form.

    megatron's recompute (selective and full) saves the layer inputs, the
    attention mask included, with `save_for_backward`, which takes tensors
    only; mimo's bitfield core attention reads a BitfieldMask or a
    ContextParallelMask from either form. The model-level hooks (CP RoPE) still
    see the objects: the conversion happens at the decoder's entry.
    """
    if model.config.recompute_granularity is None or getattr(model, "decoder", None) is None:
        return model

    def to_tensor(mask):
        return mask.to_tensor() if isinstance(mask, (BitfieldMask, ContextParallelMask)) else mask

    def pre_hook(module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs = {**kwargs, "attention_mask": to_tensor(kwargs["attention_mask"])}
        elif len(args) > 1:
            args = (args[0], to_tensor(args[1])) + tuple(args[2:])
        return args, kwargs

    model.decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return model
