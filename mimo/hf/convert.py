"""Export direction: a full mimo parameter -> its HF tensors, and the directory around them."""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterable

import torch
from safetensors.torch import save_file

from .mapping import Entry
from .source import Source


def split_entry(entry: Entry, full: torch.Tensor, src: Source) -> Dict[str, torch.Tensor]:
    """HF name (with the source's prefix) -> tensor, in the source file's dtype."""
    if entry.kind == "copy":
        pieces = [full]
    elif entry.kind == "glu":
        pieces = list(full.chunk(2, dim=0))
    else:
        heads, groups, d = entry.heads
        per = heads // groups
        rest = full.shape[1:]
        g = full.reshape(groups, per + 2, d, *rest)
        pieces = [g[:, :per].reshape(heads * d, *rest), g[:, per].reshape(groups * d, *rest),
                  g[:, per + 1].reshape(groups * d, *rest)]
        if entry.kind == "packed_qkv":
            pieces = [torch.cat(pieces)]
    out = {}
    for name, piece in zip(entry.hf, pieces):
        if name is None:  # e.g. Whisper's absent k_proj bias
            continue
        key = src.key(entry.role, name)
        out[key] = piece.to(src.dtype(key)).contiguous()
    return out


def finish_directory(out_dir: str, src: Source, written: Iterable[str], skip_extra=lambda key: False) -> None:
    """Copy the source's tensors mimo does not hold (e.g. vision layers past the feature layer),
    write the shard index, and copy every non-weight file (config, tokenizer, processor)."""
    weight_map = {}
    for fname in written:
        with open(os.path.join(out_dir, fname), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        weight_map.update({k: fname for k in header if k != "__metadata__"})
    extra = sorted(k for k in src.files if k not in weight_map and not skip_extra(k))
    if extra:
        save_file({k: src.read(k).contiguous() for k in extra}, os.path.join(out_dir, "model-extra.safetensors"),
                  metadata={"format": "pt"})
        weight_map.update({k: "model-extra.safetensors" for k in extra})
    total = 0
    for fname in set(weight_map.values()):
        total += os.path.getsize(os.path.join(out_dir, fname))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    for fname in os.listdir(src.directory):
        path = os.path.join(src.directory, fname)
        if os.path.isfile(path) and not _weights_file(fname):
            shutil.copy2(path, os.path.join(out_dir, fname))


def _weights_file(fname: str) -> bool:
    """The source's weights in any format: never copied, since a PyTorch-format copy of the untrained
    weights next to the export would be what `use_safetensors=False` loads."""
    return fname.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")) \
        or fname.endswith(".index.json") and fname.startswith(("model.", "pytorch_model.", "tf_model.",
                                                                "flax_model."))
