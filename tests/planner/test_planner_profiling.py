import os
import random

import pytest

from mimo.planner import CostModel, Workload, get_gpu, proportional_allocation, read_model
from mimo.planner import stable_profiling_batch, workload_ratio
from mimo.planner.api import load_raw
from mimo.planner.costs import frozen_aware_costs

TINY = os.path.join(os.path.dirname(__file__), "tiny_mllm.yaml")


def _setup():
    spec = read_model(load_raw(TINY)["model"])
    return spec, CostModel(get_gpu("cpu"))


def _module_time(cm, spec, name, seq, items, upstream):
    module = spec.module(name)
    costs = cm.module_costs(module, 1, 1, 1, Workload(seq, {name: items}), spec.language.hidden_size)
    return sum(frozen_aware_costs(costs, upstream))


def test_workload_ratio_by_hand():
    spec, cm = _setup()
    img, aud = spec.module("images"), spec.module("audio")
    samples = [(100, 1, 0), (20, 2, 3)]
    llm = enc_i = enc_a = 0.0
    for text, images, clips in samples:
        tokens = text + images * img.tokens_per_item + clips * aud.tokens_per_item
        llm += _module_time(cm, spec, "language", tokens, 1, True)  # projectors train
        enc_i += _module_time(cm, spec, "images", img.tokens_per_item, images, False) if images else 0.0
        enc_a += _module_time(cm, spec, "audio", aud.tokens_per_item, clips, False) if clips else 0.0
    total = llm + enc_i + enc_a
    got = workload_ratio(samples, spec, cm)
    assert got["language"] == pytest.approx(llm / total)
    assert got["images"] == pytest.approx(enc_i / total)
    assert got["audio"] == pytest.approx(enc_a / total)
    assert sum(got.values()) == pytest.approx(1.0)


def test_proportional_allocation_by_hand():
    assert proportional_allocation({"a": 0.5, "b": 0.5}, 4) == (2, 2)
    # one each first, then the 5 spare by largest remainder: 3.5, 1.0, 0.5 -> 3/1/0 + one more to a
    assert proportional_allocation({"a": 0.7, "b": 0.2, "c": 0.1}, 8) == (5, 2, 1)
    assert sum(proportional_allocation({"a": 0.33, "b": 0.33, "c": 0.34}, 7)) == 7


def test_identical_samples_are_stable_at_the_first_size():
    spec, cm = _setup()
    res = stable_profiling_batch([(64, 1, 1)] * 10, spec, cm, gpus=8, initial=4)
    assert res.stable and res.batch_size == 4
    assert sum(res.allocation) == 8


def test_variable_samples_need_a_bigger_batch_and_results_are_deterministic():
    spec, cm = _setup()
    rng = random.Random(0)
    samples = [(rng.choice([8, 120]), rng.choice([0, 0, 0, 4]), rng.choice([0, 3])) for _ in range(200)]
    a = stable_profiling_batch(samples, spec, cm, gpus=16, initial=1, seed=1)
    b = stable_profiling_batch(samples, spec, cm, gpus=16, initial=1, seed=1)
    assert a == b
    assert a.batch_size > 1
    assert a.trials == 59  # ceil(ln 0.05 / ln 0.95), as in the paper's k


def test_profiling_rejects_empty_input():
    spec, cm = _setup()
    with pytest.raises(ValueError):
        workload_ratio([], spec, cm)
