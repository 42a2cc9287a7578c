"""Encoders, projectors, embedding assembly and the GPT LLM, from megatron-core parts."""

from .assembly import assemble_embeddings
from .multimodal import (
    EncoderWithProjector,
    attention_mask,
    build_encoder,
    build_llm,
    encode,
    llm_loss,
    set_frozen,
)

__all__ = ["EncoderWithProjector", "assemble_embeddings", "attention_mask", "build_encoder", "build_llm",
           "encode", "llm_loss", "set_frozen"]
