"""Attention tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` decorator runs in
interpreted mode; mimo.attention reads it at call time and loads its kernels
in the matching mode itself (kernel_loader.py), so import order in the shared
pytest process does not matter. setdefault keeps an explicit choice.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def tiny_config():
    from mimo.attention import KernelConfig

    # 16x16 tiles and 2-tile work items so that the block skipping and the
    # split/merge path are exercised at the tiny sizes the interpreter affords.
    return KernelConfig(block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=16, split_tiles=2)
