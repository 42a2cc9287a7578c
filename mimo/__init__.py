"""mimo: heterogeneous-parallel multimodal LLM training on megatron-core."""

__version__ = "0.1.0"

import warnings as _warnings

# megatron-core announces on import, on every rank, each optional accelerator
# library it falls back from (Apex, Transformer Engine, absl); mimo runs
# without them by design, so those lines are noise in a multi-rank log.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|absl)", category=UserWarning)
# Emitted for defaults mimo does not use (CUDA graphs, async TP all-reduce tuning).
_warnings.filterwarnings("ignore", message=r"(full scope is deprecated|When using async grad allreduce)")
