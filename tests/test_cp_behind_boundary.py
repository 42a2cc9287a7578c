"""LLM context parallelism behind the boundary communicators (encoders keep CP = 1)."""

import os

import pytest

from mimo.runtime import run_on_ranks
from test_heterogeneous_parity import _merge, _train, layout
from test_training_parity import assert_same_run

STEPS = 2


def bitfield(raw):
    raw["model"]["language"].update(attention="bitfield", cp_block_size=16)
    return raw


@pytest.fixture(scope="module")
def dense_attention():
    """The dense attention backend on CPU (same semantics as the kernels, much faster than the interpreter)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    yield
    if saved is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="module")
def reference(dense_attention):
    return run_on_ranks(_train, 1, bitfield(layout()), STEPS)[0]


def test_noncolocated_encoders_feed_a_cp2_llm(reference):
    # LLM cp2 on ranks 0-1; images dp2 (fan-in into the single LLM DP shard) on ranks 2-3; audio on rank 4.
    raw = bitfield(layout(language=dict(cp=2), images=dict(dp=2, rank_offset=2), audio=dict(rank_offset=4)))
    results = run_on_ranks(_train, 5, raw, STEPS)
    assert results[0]["type"] == "Trainer"
    assert_same_run(reference, _merge(results))


@pytest.mark.slow
def test_colocated_encoders_feed_a_cp2_dp2_llm(reference):
    raw = bitfield(layout(language=dict(cp=2, dp=2), images=dict(dp=4), audio=dict(dp=4)))
    assert_same_run(reference, _merge(run_on_ranks(_train, 4, raw, STEPS)))
