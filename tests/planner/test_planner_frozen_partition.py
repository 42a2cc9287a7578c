"""Direction of Cornstarch Table 2: with frozen encoders and a frozen LLM
(only projectors train), frozen-aware partitioning predicts a faster step
than partitioning as if every layer were trainable."""

import pytest

from mimo.planner import CostModel, Workload, allocate_stages, get_gpu, read_model
from mimo.planner.costs import backward_costs, frozen_unaware_costs, llm_upstream_requires_grad
from mimo.planner.simulator import chain, simulate_1f1b
from mimo.planner.stages import _fold

# Cornstarch Table 1: (layers, hidden) of Llama-3 and Qwen2-Vision sizes.
LLM = {"S": (16, 2048), "M": (32, 4096), "L": (64, 5120)}
VISION = {"S": (32, 1280), "M": (48, 2560), "L": (64, 3840)}
MICROBATCHES = 12  # the paper pipelines 12 microbatches


def _model(v, l):
    nl, h = LLM[l]
    vl, vh = VISION[v]
    return read_model({
        "language": {"num_layers": nl, "hidden_size": h, "num_attention_heads": h // 128,
                     "vocab_size": 128256, "frozen": True},
        "encoders": {"vision": {"kind": "vision", "num_layers": vl, "hidden_size": vh,
                                "num_attention_heads": vh // 128,
                                # ~1280x720 worth of 14-px patches
                                "image_size": 952, "patch_size": 14, "frozen": True,
                                "projector": {"kind": "mlp", "frozen": False}}},
    })


def _sums(values, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(sum(values[i:i + s]))
        i += s
    return out


def _predicted_step(v, l, total_stages):
    spec = _model(v, l)
    cm = CostModel(get_gpu("h100"))
    wl = Workload(4096)
    enc = cm.module_costs(spec.encoders[0], 1, 1, 1, wl, spec.language.hidden_size)
    llm = cm.module_costs(spec.language, 1, 1, 1, wl)
    up = llm_upstream_requires_grad([enc])
    truth = {
        "enc": (_fold([c.forward for c in enc], 1, 1), _fold(backward_costs(enc), 1, 1)),
        "llm": (_fold([c.forward for c in llm], 1, 1), _fold(backward_costs(llm, up), 1, 1)),
    }
    aware = [[f + b for f, b in zip(*truth[k])] for k in ("enc", "llm")]
    unaware = [_fold(frozen_unaware_costs(enc), 1, 1), _fold(frozen_unaware_costs(llm), 1, 1)]
    times = {}
    for name, basis in (("aware", aware), ("unaware", unaware)):
        es, ls = allocate_stages(basis, total_stages)
        stages = chain("e", _sums(truth["enc"][0], es), _sums(truth["enc"][1], es))
        stages += chain("l", _sums(truth["llm"][0], ls), _sums(truth["llm"][1], ls),
                        inputs={f"e{len(es) - 1}": 0.0})
        times[name] = simulate_1f1b(stages, MICROBATCHES).iteration_time
    return times


def test_frozen_aware_partition_is_never_slower():
    strictly_better = []
    for v, l in (("S", "S"), ("M", "S"), ("L", "S"), ("M", "M"), ("L", "M"), ("L", "L")):
        for total in (4, 8):
            t = _predicted_step(v, l, total)
            assert t["aware"] <= t["unaware"] * (1 + 1e-9)
            strictly_better.append(t["aware"] < t["unaware"] * (1 - 1e-3))
    assert any(strictly_better)


@pytest.mark.parametrize("v,l", [("M", "M"), ("L", "M"), ("L", "L")])
def test_frozen_aware_strictly_faster_when_modules_are_comparable(v, l):
    # MLLM-MMM, -LLM, -LLL: the cases where the paper reports the largest gains
    t = _predicted_step(v, l, 4)
    assert 0 < t["aware"] < t["unaware"]
