"""Mock and real (LLaVA-format) multimodal data, and its sharding over data-parallel ranks."""

from .batching import collate, loss_tokens, move, shard_indices
from .mock import PAD_ID, MockMultimodalDataset, Sample


def build_dataset(cfg):
    """The dataset `data.kind` names; every rank builds the same one (same global sample order)."""
    if cfg.data.kind == "llava":
        from .llava_dataset import LlavaDataset

        return LlavaDataset(cfg)
    if cfg.data.kind == "energon":
        from .energon import EnergonSource
        from .llava_dataset import LlavaDataset
        from .worker_start import stop_signal

        d = cfg.data
        source = EnergonSource(d.path, d.seed, d.shuffle, d.num_workers, stop_signal(cfg.training), d.on_bad_record)
        return LlavaDataset(cfg, source=source)
    return MockMultimodalDataset(cfg)


__all__ = ["MockMultimodalDataset", "PAD_ID", "Sample", "build_dataset", "collate", "loss_tokens", "move",
           "shard_indices"]
