"""Pipeline stages of a module: which layers each stage holds, and building one stage.

mimo runs its own pipeline schedules, so megatron-core sees each stage as a
whole model of `n` layers (pipeline size 1, its own singleton pipeline
group); only the first stage embeds and only the last produces the loss.
Per-stage layer counts come from `parallelism.<module>.stage_layers` when
given (e.g. a planner's frozen-aware partition), else an even split.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo.config import MimoConfig, ParallelConfig

from .norm import block_spec
from .architecture import finish_llm, gpt_model_kwargs
from .specs import llm_block_layer_specs
from .transformer_config import initialized_by_megatron, transformer_config


def stage_layer_counts(num_layers: int, par: ParallelConfig) -> List[int]:
    """Layers per pipeline stage; an even split puts the remainder on the earliest stages."""
    if par.stage_layers is not None:
        return list(par.stage_layers)
    base, extra = divmod(num_layers, par.pp)
    return [base + (1 if i < extra else 0) for i in range(par.pp)]


def stage_layer_offset(num_layers: int, par: ParallelConfig, stage: int) -> int:
    return sum(stage_layer_counts(num_layers, par)[:stage])


def single_stage_groups(pgs: ProcessGroupCollection, self_group) -> ProcessGroupCollection:
    """The module's groups with the pipeline group replaced by this rank alone."""
    out = ProcessGroupCollection()
    for f in dataclasses.fields(ProcessGroupCollection):
        if hasattr(pgs, f.name):
            setattr(out, f.name, getattr(pgs, f.name))
    out.pp = self_group
    out.embd = self_group
    out.pos_embd = self_group
    out.mp = pgs.tp
    return out


def build_llm_stage(cfg: MimoConfig, par: ParallelConfig, layout, stage: int, pgs: ProcessGroupCollection,
                    self_group, num_layers_total: Optional[int] = None) -> GPTModel:
    """The LLM layers of one pipeline stage as a megatron GPTModel."""
    from .multimodal import set_frozen
    from .sequence_parallel import tensor_masks_when_recomputing

    lang = cfg.model.language
    counts = stage_layer_counts(lang.num_layers, par)
    stage_layout = dataclasses.replace(layout, pp=1)
    config = transformer_config(lang, stage_layout, cfg.training.precision, num_layers=counts[stage], par=par,
                                initialize=initialized_by_megatron(cfg.training))
    spec = block_spec(llm_block_layer_specs(lang, sum(counts[:stage]), counts[stage], config), config.num_layers)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=lang.vocab_size, max_sequence_length=lang.max_sequence_length,
                     pre_process=stage == 0, post_process=stage == par.pp - 1, parallel_output=True,
                     pg_collection=single_stage_groups(pgs, self_group), **gpt_model_kwargs(lang))
    finish_llm(model, lang)
    if lang.tie_embeddings:
        mark_tied_embedding(model, stage, par.pp)
    set_frozen(model, lang.frozen)
    return tensor_masks_when_recomputing(model)


def mark_tied_embedding(model: GPTModel, stage: int, pp: int) -> None:
    """Tag a pipelined LLM's tied embedding weights as megatron-core's own pipeline does (its
    `setup_embeddings_and_output_layer`, which sees one stage here): the first stage's word embedding
    and the last stage's output weight (a copy of it: `tied_copy`) are `shared_embedding` (with the
    distributed optimizer each gets a bucket of its own, so both stages shard it alike before the
    embedding group sums their gradients), and the copy is `shared` (the gradient norm skips it).
    Both start from the same values (`mimo.model.reference_init.source_name`) and step on the same
    summed gradient (`ModelOptimizer.finish_grads`), so they stay equal."""
    if pp == 1:
        return
    if stage == 0:
        model.embedding.word_embeddings.weight.shared_embedding = True
    if stage == pp - 1:
        w = model.output_layer.weight
        w.shared = w.shared_embedding = w.tied_copy = True
