"""mimo: heterogeneous-parallel multimodal LLM training on megatron-core."""

__version__ = "0.1.0"
