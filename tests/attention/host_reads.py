"""Watching Python-level reads of tensor values (each waits for the device on a GPU) in tests."""

import contextlib
import sys

import torch

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def on_host_reads(seen):
    """While active, every read (`READS`) calls `seen(name, tensor, caller_frame)` first; what `seen`
    raises propagates, else the read goes on."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def watched(name, original):
        def read(self, *args, **kwargs):
            seen(name, self, sys._getframe(1))
            return original(self, *args, **kwargs)
        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, watched(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
