"""Reading an HF directory's safetensors: memory-mapped, one tensor or one slice at a time."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open

from .mapping import PREFIXES, PROBES, Entry

# safetensors header dtype -> torch dtype (what `Source.dtype` answers; export writes tensors back in it).
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class HFWeightsError(ValueError):
    """A problem with an HF directory's weights; str() is the one `error:` line."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"error: {where}: {reason}")


def weight_files(directory: str) -> Dict[str, str]:
    """HF tensor name -> safetensors file, from the shard index or the single file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as exc:
            raise HFWeightsError(index, f"unreadable shard index ({type(exc).__name__}: {exc})")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                       for k, v in weight_map.items()):
            raise HFWeightsError(index, "not a shard index: expected {\"weight_map\": {tensor name: file name}}")
        files = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise HFWeightsError(path, "missing (listed in model.safetensors.index.json)")
        return files
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise HFWeightsError(directory, "no model.safetensors or model.safetensors.index.json")
    with _open(single) as f:
        return {k: single for k in f.keys()}


def _open(path: str):
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise HFWeightsError(path, f"not a readable safetensors file ({exc})")


class Source:
    """One HF directory: tensor lookup by role-relative name, slices read through safetensors' mmap."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files = weight_files(directory)
        self._handles: Dict[str, object] = {}
        self._keys: Dict[str, set] = {}  # per file: the tensors its header holds
        self._prefix: Dict[str, str] = {}

    def _handle(self, path: str):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def prefix(self, role: str) -> str:
        if role not in self._prefix:
            found = [p for p in PREFIXES[role] if p + PROBES[role] in self.files]
            if not found:
                raise HFWeightsError(self.directory, f"no tensor {PROBES[role]!r} under any of the prefixes "
                                                     f"{', '.join(repr(p) for p in PREFIXES[role])}")
            self._prefix[role] = found[0]
        return self._prefix[role]

    def key(self, role: str, name: str) -> str:
        return self.prefix(role) + name

    def _slice(self, key: str):
        if key not in self.files:
            raise HFWeightsError(self.directory, f"missing tensor {key}")
        path = self.files[key]
        if path not in self._keys:
            self._keys[path] = set(self._handle(path).keys())
        if key not in self._keys[path]:
            raise HFWeightsError(f"{path}: {key}", "listed in model.safetensors.index.json but not in this file "
                                                   "(a stale index?)")
        return self._handle(path).get_slice(key)

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        dtype = self._slice(key).get_dtype()
        if dtype not in _DTYPES:
            raise HFWeightsError(f"{self.files[key]}: {key}", f"dtype {dtype}: only {', '.join(_DTYPES)} weights "
                                                              "are read (a quantized checkpoint?)")
        return _DTYPES[dtype]

    def read(self, key: str, rows: Optional[Tuple[int, int]] = None, dim: int = 0) -> torch.Tensor:
        """The tensor, or only rows [a, b) along `dim` (read from the mapped file, nothing else)."""
        sl = self._slice(key)
        if rows is None:
            return sl[:]
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(*rows)
        return sl[tuple(index)]

    def check(self, entry: Entry) -> None:
        for name, shape in zip(entry.hf, entry.shapes):
            if name is None:
                continue
            key = self.key(entry.role, name)
            got = self.shape(key)
            if got != shape:
                raise HFWeightsError(f"{self.files[key]}: {key}", f"shape {list(got)}, the config needs {list(shape)}")
            self.dtype(key)  # refuses a dtype it cannot read
