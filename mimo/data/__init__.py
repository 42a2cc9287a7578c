"""Mock multimodal data and its sharding over data-parallel ranks."""

from .batching import collate, move, shard_indices
from .mock import PAD_ID, MockMultimodalDataset, Sample

__all__ = ["MockMultimodalDataset", "PAD_ID", "Sample", "collate", "move", "shard_indices"]
