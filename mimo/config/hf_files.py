"""Where the data pipeline finds the non-weight files of HF directories: the tokenizer and the
image processor (the config check loads them too, so this sits with the config)."""

from __future__ import annotations

import os
from typing import Optional

from .schema import MimoConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def tokenizer_dir(cfg: MimoConfig) -> Optional[str]:
    """The HF directory whose tokenizer the data pipeline uses when `data.tokenizer` is unset:
    model.hf, else model.language.hf, if it holds tokenizer files."""
    for d in (cfg.model.hf, cfg.model.language.hf):
        if d and any(os.path.isfile(os.path.join(d, f)) for f in TOKENIZER_FILES):
            return d
    return None


def processor_dir(cfg: MimoConfig, encoder: str = "images") -> Optional[str]:
    """The HF directory holding the image (or audio feature) processor of `encoder`: its own `hf`,
    else model.hf, if it holds processor files."""
    enc = cfg.model.encoders.get(encoder)
    for d in ((enc.hf if enc else None), cfg.model.hf):
        if d and any(os.path.isfile(os.path.join(d, f)) for f in PROCESSOR_FILES):
            return d
    return None
