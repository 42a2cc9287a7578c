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


# transformers' Qwen2-VL image processor defaults (Qwen2VLImageProcessor class attributes).
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280


def qwen_processor_settings(directory: str) -> dict:
    """The Qwen2-VL image processor settings of an HF directory, as transformers resolves them.

    The file: the `image_processor` entry of processor_config.json (what transformers 5 saves),
    else preprocessor_config.json (the hub's files), in transformers' order. Its `min_pixels` /
    `max_pixels` keys over `size` {shortest_edge, longest_edge} over the class defaults. Also
    patch_size, temporal_patch_size, merge_size (None when the file does not say), image_mean /
    image_std (None: the processor's default, OpenAI CLIP's) and `file`, the file they come from
    (for messages). No file: all defaults. Raises ValueError for a malformed file."""
    import json

    pc, source = {}, "preprocessor_config.json"
    for name, entry in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        if not os.path.isfile(os.path.join(directory, name)):
            continue
        with open(os.path.join(directory, name)) as f:
            found = json.load(f)
        if entry is not None and isinstance(found, dict):
            if entry not in found:
                continue  # a processor file without the image processor's settings (older saves)
            found, name = found[entry], f"{name}: {entry}"
        if not isinstance(found, dict):
            raise ValueError(f"{os.path.join(directory, name)}: expected a JSON object")
        pc, source = found, name
        break
    path = os.path.join(directory, source)
    size = pc.get("size")
    if size is not None and not isinstance(size, dict):
        raise ValueError(f"{path}: size must be a mapping, got {size!r}")
    out = {}
    for key, edge, default in (("min_pixels", "shortest_edge", QWEN_MIN_PIXELS),
                               ("max_pixels", "longest_edge", QWEN_MAX_PIXELS)):
        value = pc.get(key)
        if value is None:
            value = default if size is None else size.get(edge)
        if value is None:
            raise ValueError(f"{path}: size has no {edge} and there is no {key} (the processor cannot resize)")
        out[key] = value
    for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
        out[key] = pc.get(key)
    out["file"] = source
    return out
