"""Choose how attention runs for a given device, and load the Triton kernels.

``@triton.jit`` picks compiled or interpreted code when the decorator runs
(``triton.knobs.runtime.interpret``, i.e. ``TRITON_INTERPRET``). To make the
choice robust to import order, ``triton_kernels.py`` is executed here as a
private module, once per mode, with the knob forced for the duration of the
import. The environment variable is read at call time:

* TRITON_INTERPRET=1 (CPU or CUDA tensors) -> the kernels in Triton's interpreter
* CUDA tensors otherwise    -> compiled kernels
* CPU tensors otherwise     -> the dense PyTorch reference (same semantics)

CUDA tensors follow the variable as Triton's own kernels do, and for a second reason: a process
that imported Triton with TRITON_INTERPRET on has its library functions (reductions, ``cdiv``)
built for the interpreter, so it cannot compile GPU kernels at all.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from types import ModuleType

import torch

_lock = threading.Lock()
_loaded: dict[bool, ModuleType] = {}
_SENTINEL = object()


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def backend_for(device: torch.device) -> str:
    """'triton', 'interpret' or 'reference'."""
    if device.type in ("cpu", "cuda") and interpreter_requested():
        return "interpret"
    if device.type == "cuda":
        return "triton"
    return "reference"


def kernels(interpret: bool) -> ModuleType:
    with _lock:
        if interpret not in _loaded:
            _loaded[interpret] = _load(interpret)
        return _loaded[interpret]


def _load(interpret: bool) -> ModuleType:
    import triton.knobs as knobs

    runtime = knobs.runtime
    previous_knob = runtime.__dict__.get("interpret", _SENTINEL)
    previous_env = os.environ.get("TRITON_INTERPRET")
    runtime.interpret = interpret
    try:
        spec = importlib.util.find_spec("mimo.attention.triton_kernels")
        name = f"mimo.attention._triton_kernels_{'interpret' if interpret else 'compiled'}"
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, spec.origin))
        module.__spec__.loader.exec_module(module)
    finally:
        if previous_knob is _SENTINEL:
            runtime.__dict__.pop("interpret", None)
        else:
            runtime.__dict__["interpret"] = previous_knob
        if previous_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous_env
    return module
