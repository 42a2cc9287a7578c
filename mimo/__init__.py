"""mimo: heterogeneous-parallel multimodal LLM training on megatron-core."""

__version__ = "0.1.0"

import warnings as _warnings

# megatron-core announces on import, on every rank, each optional accelerator
# library it falls back from (Apex, Transformer Engine, absl); mimo runs
# without them by design, so those lines are noise in a multi-rank log.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|absl)", category=UserWarning)
# Emitted for defaults mimo does not use (CUDA graphs, async TP all-reduce tuning).
_warnings.filterwarnings("ignore", message=r"(full scope is deprecated|When using async grad allreduce)")
# torch 2.13 deprecates APIs megatron-core 0.16.1 calls on every rank (both pinned): its checkpoint
# loads go through `load_state_dict`, its distributed optimizer and MoE dispatch through
# `all_gather_into_tensor` / `reduce_scatter_tensor`. mimo's own code calls the new names.
_warnings.filterwarnings("ignore", message=r"`(load_state_dict|torch\.distributed\.(all_gather_into_tensor|"
                         r"reduce_scatter_tensor))` is deprecated", category=FutureWarning)
