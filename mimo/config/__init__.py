"""Config contract: dataclasses, YAML loading and validation (no torch.distributed here)."""

from .hf_arch import resolve_hf
from .load import ConfigError, apply_overrides, build_config, read_yaml, without_data
from .schema import (
    LANGUAGE,
    DataConfig,
    EncoderConfig,
    LanguageConfig,
    MimoConfig,
    ModelConfig,
    ParallelConfig,
    ProjectorConfig,
    TrainingConfig,
)
from .validate import is_homogeneous, placement, validate


def load_config(source, overrides=(), world_size=None) -> MimoConfig:
    """Load a YAML path (or a raw dict), apply `a.b=value` overrides, validate.

    Raises ConfigError listing every problem; `world_size` (if given) is also
    checked against the rank ranges.
    """
    raw = read_yaml(source) if isinstance(source, str) else dict(source)
    raw = apply_overrides(raw, list(overrides))
    # Architecture from Hugging Face config.json files (model.hf and friends) before building.
    hf_problems = resolve_hf(raw)
    if hf_problems:
        raise ConfigError(hf_problems)
    cfg, problems = build_config(raw)
    problems += validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    return cfg


__all__ = [
    "ConfigError", "DataConfig", "EncoderConfig", "LANGUAGE", "LanguageConfig", "MimoConfig",
    "ModelConfig", "ParallelConfig", "ProjectorConfig", "TrainingConfig", "load_config",
    "is_homogeneous", "placement", "validate", "without_data",
]
