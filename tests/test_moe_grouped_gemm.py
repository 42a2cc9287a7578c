"""Routed experts as grouped GEMMs (`model.language.moe_grouped_gemm`, docs/moe.md).

* The grouped linear (forward, input and weight gradients) equals a loop of one GEMM per expert,
  with an expert that receives no token; shifting the group ends by one row fails the same check.
* FP32 training with `moe_grouped_gemm: true` equals the SequentialMLP run (losses, first-step
  gradients, weights) at 1 rank, DP2·EP2 and TP2+SP with expert TP 2 (each expert's gated fc1 cut
  over expert TP), and the experts really ran as GroupedExperts through torch's grouped GEMM.
* `auto` picks GroupedExperts only where the runtime has the kernel (not on CPU ranks) and the
  shapes fit; bad settings are one `error:` line each.
"""

import pytest
import torch

from mimo.config import ConfigError, load_config
from mimo.model.grouped_experts import _GroupedLinear
from mimo.runtime import run_on_ranks
from test_moe import STEPS, _lang, _train, assert_same_run, merged, moe


def _loop(x, counts, weights):
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), weights)])


@pytest.mark.parametrize("shift", [0, 1])
def test_grouped_linear_equals_one_gemm_per_expert(shift):
    torch.manual_seed(0)
    counts = [5, 0, 7, 4]  # expert 1 receives no token
    x = torch.randn(sum(counts), 16, dtype=torch.float64).float().requires_grad_()
    weights = [torch.randn(24, 16).requires_grad_() for _ in counts]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    ends[:-1] += shift  # the negative control: one row handed to the next expert
    dy = torch.randn(sum(counts), 24)
    got = _GroupedLinear.apply(x, ends, *weights)
    (got * dy).sum().backward()
    grads = [x.grad.clone()] + [w.grad.clone() for w in weights]
    x.grad = None
    for w in weights:
        w.grad = None
    ref = _loop(x, counts, weights)
    (ref * dy).sum().backward()
    same = torch.allclose(got, ref, rtol=1e-6, atol=1e-6) and all(
        torch.allclose(g, r, rtol=1e-6, atol=1e-6) for g, r in zip(grads, [x.grad] + [w.grad for w in weights]))
    assert same == (shift == 0)


def test_grouped_linear_on_a_rank_without_tokens():
    x = torch.zeros(0, 16, requires_grad=True)
    weights = [torch.randn(24, 16).requires_grad_() for _ in range(3)]
    ends = torch.zeros(3, dtype=torch.int32)
    y = _GroupedLinear.apply(x, ends, *weights)
    assert y.shape == (0, 24)
    grads = torch.autograd.grad(y.sum() + sum(w.sum() * 0 for w in weights), [x] + weights)
    assert grads[0].shape == (0, 16) and all(torch.equal(g, torch.zeros_like(g)) for g in grads[1:])


def _train_recording_experts(raw, steps):
    """`_train`, plus the experts' class and how many grouped GEMMs ran."""
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    torch._grouped_mm = counting
    from mimo.training import Trainer

    classes = []
    build = Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        classes.extend(sorted({type(m).__name__ for m in self.parts["language"].modules()
                               if type(m).__name__ in ("GroupedExperts", "SequentialMLP")}))

    Trainer.__init__ = init
    return dict(_train(raw, steps), classes=classes, grouped_calls=len(calls))


def _grouped(raw):
    return _lang(raw, moe_grouped_gemm=True)


@pytest.fixture(scope="module")
def sequential():
    return run_on_ranks(_train_recording_experts, 1, moe(), STEPS)[0]


@pytest.mark.parametrize("layout,world", [({}, 1), (dict(dp=2, ep=2), 2), (dict(tp=2, sp=True, etp=2), 2)],
                         ids=["1rank", "dp2ep2", "tp2sp_etp2"])
def test_grouped_experts_train_like_sequential_experts(sequential, layout, world):
    assert sequential["classes"] == ["SequentialMLP"] and sequential["grouped_calls"] == 0  # auto on CPU
    results = run_on_ranks(_train_recording_experts, world, _grouped(moe(**layout)), STEPS)
    assert_same_run(sequential, merged(results), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["classes"] == ["GroupedExperts"]
        # Two per MoE layer forward, four per backward (input and weight gradients of fc1 and fc2),
        # for each of the rank's microbatches (4 a step over the LLM's DP) over 2 steps; one MoE layer.
        assert r["grouped_calls"] == STEPS * 4 // layout.get("dp", 1) * 6, r["grouped_calls"]


def test_auto_picks_grouped_experts_only_where_the_runtime_has_the_kernel(monkeypatch):
    import mimo.model.specs as specs
    from mimo.runtime import FusionSupport

    cfg = load_config(moe())
    lang = cfg.model.language
    config = type("Config", (), dict(hidden_size=32, moe_ffn_hidden_size=16, expert_tensor_parallel_size=1,
                                     add_bias_linear=False, fp8=None, fp4=None, bf16=True))()
    assert lang.moe_grouped_gemm == "auto" and not specs.grouped_experts(lang, config)  # CPU: no kernel
    monkeypatch.setattr(specs, "active_fusions", lambda: FusionSupport(jit=True, grouped_gemm=True))
    assert specs.grouped_experts(lang, config)
    config.bf16 = False  # fp32 weights: torch's GPU kernel takes bf16 only
    assert not specs.grouped_experts(lang, config)
    config.bf16 = True
    config.moe_ffn_hidden_size = 12  # not a multiple of 8: auto falls back to one GEMM per expert
    assert not specs.grouped_experts(lang, config)
    lang.moe_grouped_gemm = False
    config.moe_ffn_hidden_size = 16
    assert not specs.grouped_experts(lang, config)


@pytest.mark.parametrize("fields,layout,needle", [
    (dict(moe_grouped_gemm="yes"), {}, "must be auto, true or false"),
    (dict(moe_grouped_gemm=True, moe_ffn_hidden_size=12), {}, "multiples of 8"),
    (dict(moe_grouped_gemm=True), dict(tp=4, sp=True, etp=4), "multiples of 8"),  # 16 / etp 4 = 4
])
def test_bad_grouped_gemm_settings_are_one_error(fields, layout, needle):
    with pytest.raises(ConfigError) as err:
        load_config(_lang(moe(**layout), **fields))
    problems = [p for p in err.value.problems if p[0] == "model.language.moe_grouped_gemm"]
    assert len(problems) == 1 and needle in problems[0][1], err.value.problems


def test_grouped_gemm_on_a_dense_llm_is_refused():
    raw = moe()
    lang = raw["model"]["language"]
    for k in [k for k in lang if k.startswith("moe_") or k == "num_moe_experts"]:
        del lang[k]
    lang["moe_grouped_gemm"] = True
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert [p for p, _ in err.value.problems] == ["model.language.moe_grouped_gemm"]
