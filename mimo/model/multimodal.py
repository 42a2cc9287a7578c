"""The multimodal model: encoders -> projectors -> embedding assembly -> GPT LLM.

Model definition only: each part is built with the process groups it is
handed (its module's ProcessGroupCollection); which ranks hold which part is
decided by mimo.topology and the training loop, not here.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel

from mimo.attention import BitfieldMask, build_bitfield_mask
from mimo.config import LANGUAGE, MimoConfig
from mimo.data import PAD_ID
from mimo.data.items import PackedItems, is_native
from mimo.topology import Layout

from .architecture import finish_llm, gpt_model_kwargs
from .assembly import assemble_embeddings
from .encoders import AudioEncoder, VisionEncoder
from .native_vision import NativeVisionEncoder
from .norm import block_spec
from .projector import build_projector, project
from .sequence_parallel import full_sequence, llm_input_layout, tensor_masks_when_recomputing
from .specs import llm_block_layer_specs
from .transformer_config import initialized_by_megatron, transformer_config


class EncoderWithProjector(torch.nn.Module):
    """One modality path: items -> encoder -> projector -> packed LLM-width tokens."""

    def __init__(self, encoder: torch.nn.Module, projector: torch.nn.Module):
        super().__init__()
        self.encoder, self.projector = encoder, projector

    def forward(self, items) -> torch.Tensor:
        if isinstance(items, PackedItems):
            # Native resolution: the ViT runs every image of the call as one packed sequence
            # [Σ patches, hidden]; the patch merger makes it [Σ patches / merge², LLM hidden].
            return self.projector(self.encoder(items.patches, items.grids))
        return project(self.projector, self.encoder(items))


def build_encoder(cfg: MimoConfig, name: str, layout: Layout, pg_collection,
                  layers: Optional[Tuple[int, int]] = None) -> EncoderWithProjector:
    """The encoder and its projector; `layers` (offset, count): only the encoder's layers
    [offset, offset + count) (a pipeline stage, `mimo.model.encoder_stages`), numbered from 0."""
    enc = cfg.model.encoders[name]
    precision = cfg.training.precision
    initialize = initialized_by_megatron(cfg.training)
    offset, count = layers if layers is not None else (0, enc.num_layers)
    ecfg = transformer_config(enc, layout, precision, num_layers=count, par=cfg.parallelism[name],
                              initialize=initialize)
    if is_native(enc):
        encoder = NativeVisionEncoder(ecfg, enc, pg_collection, layer_offset=offset)
    elif enc.kind == "vision":
        encoder = VisionEncoder(ecfg, enc, pg_collection)
    else:
        encoder = AudioEncoder(ecfg, enc, pg_collection)
    # The projector lives with its encoder (same ranks, same TP group) but
    # speaks the LLM's width. It runs on the encoder's gathered output (no
    # sequence parallelism: its rows are packed items, not one sequence).
    lcfg = transformer_config(cfg.model.language, layout, precision, initialize=initialize)
    projector = build_projector(lcfg, enc.hidden_size, enc.projector.kind, pg_collection.tp, enc.projector.activation,
                                encoder_cfg=enc)
    module = EncoderWithProjector(encoder, projector)
    module.to(ecfg.params_dtype)
    set_frozen(module.encoder, enc.frozen)
    set_frozen(module.projector, enc.projector.frozen)
    return module


def build_llm(cfg: MimoConfig, layout: Layout, pg_collection) -> GPTModel:
    lang = cfg.model.language
    config = transformer_config(lang, layout, cfg.training.precision, par=cfg.parallelism[LANGUAGE],
                                initialize=initialized_by_megatron(cfg.training))
    spec = block_spec(llm_block_layer_specs(lang, 0, config.num_layers, config), config.num_layers)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=lang.vocab_size, max_sequence_length=lang.max_sequence_length,
                     pre_process=True, post_process=True, parallel_output=True,
                     pg_collection=pg_collection, **gpt_model_kwargs(lang))
    finish_llm(model, lang)
    set_frozen(model, lang.frozen)
    return tensor_masks_when_recomputing(model)


def set_frozen(module: torch.nn.Module, frozen: bool) -> None:
    """Frozen parameters never get gradients, so they also get no optimizer state."""
    for p in module.parameters():
        p.requires_grad_(not frozen)


def attention_mask(cfg: MimoConfig, input_ids: torch.Tensor,
                   document_ids: Optional[torch.Tensor] = None) -> Optional[BitfieldMask]:
    """The LLM's attention mask: a bitfield mask, or None (plain causal) for sdpa.

    Modality m (bit 1 << m) is the m-th encoder in config order. With
    `document_ids` (real data, possibly packed) padding is where the id is
    negative, and tokens of different documents never see each other; mock
    data marks padding with PAD_ID."""
    lang = cfg.model.language
    if lang.attention != "bitfield":
        return None
    # modality_attention causal: encoder tokens are masked as text is (plain causal attention).
    modality = {} if lang.modality_attention == "causal" else {
        cfg.placeholder_ids[n]: i + 1 for i, n in enumerate(cfg.model.encoders)}
    sees = lang.text_sees if lang.text_sees is not None else list(cfg.model.encoders)
    text_sees = {modality[cfg.placeholder_ids[n]] for n in sees if cfg.placeholder_ids[n] in modality}
    if document_ids is None:
        return BitfieldMask(build_bitfield_mask(input_ids, modality, text_sees, pad_id=PAD_ID))
    bits = build_bitfield_mask(input_ids, modality, text_sees)
    return BitfieldMask(bits.masked_fill(document_ids < 0, 0), document_ids)


def encode(path: EncoderWithProjector, items) -> torch.Tensor:
    """Packed tokens for a microbatch's items (a tensor [n, ...], or native-resolution `PackedItems`);
    an empty [0, h] tensor when it has none."""
    hidden = path.projector.config.hidden_size
    if items is None or len(items) == 0:
        # No items: skip the encoder (identically on all TP ranks of the shard,
        # since they see the same data), its parameters get no gradient this microbatch.
        return torch.zeros(0, hidden, dtype=path.projector.config.params_dtype)
    trainable = any(p.requires_grad for p in path.parameters())
    with torch.set_grad_enabled(torch.is_grad_enabled() and trainable):
        return path(items)


def llm_loss(llm: GPTModel, batch: Dict[str, torch.Tensor], tokens_by_id: Dict[int, torch.Tensor]) -> torch.Tensor:
    input_ids = batch["input_ids"]
    text = embed_text(llm, input_ids, batch["position_ids"])  # [s, b, h], whole sequence
    fused = assemble_embeddings(text.transpose(0, 1), input_ids,
                                {i: t.to(text.device) for i, t in tokens_by_id.items()},
                                batch.get("placeholder_counts"))
    return llm(input_ids=input_ids, position_ids=batch["position_ids"], attention_mask=batch.get("attention_mask"),
               decoder_input=llm_input_layout(llm, fused.transpose(0, 1).contiguous()), labels=batch["labels"])


def embed_text(llm: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The LLM's text embeddings of the whole sequence [s, b, h], on every TP rank.

    With sequence parallelism megatron's embedding returns this rank's
    sequence shard; modality tokens go to arbitrary positions, so they are
    merged into the whole sequence, which `llm_input_layout` shards again.
    """
    text = llm.embedding(input_ids=input_ids, position_ids=position_ids)
    return full_sequence(text, llm.config, llm.pg_collection.tp)
