"""megatron-core fusions per runtime (issue #40 item 2) and SDPA's native GQA.

The capability -> TransformerConfig mapping is a pure function (`mimo.runtime.fusion_flags`), tested
here for a fake CUDA runtime with and without Transformer Engine; CPU ranks keep every fusion off.
SDPA with `enable_gqa=True` must equal the repeat_interleave expansion, outputs and gradients."""

import types

import pytest
import torch
import torch.nn.functional as F

from mimo.config import load_config
from mimo.model import sdpa_attention
from mimo.model.architecture import gelu_tanh
from mimo.model.transformer_config import module_fusion_flags, transformer_config
from mimo.runtime import FusionSupport, Runtime, fusion_flags, fusion_support, select_runtime
from mimo.runtime import fusions
from mimo.topology import Layout
from tests.tiny import tiny

FIELDS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
          "persist_layer_norm", "gradient_accumulation_fusion")
CUDA_NO_TE = FusionSupport(jit=True)
CUDA_TE = FusionSupport(jit=True, rope=True, grad_accum=True, masked_softmax=True)


def test_cpu_runtime_keeps_every_fusion_off():
    cpu = select_runtime("cpu")
    assert fusion_support(cpu) == FusionSupport()
    flags = fusion_flags(fusion_support(cpu), activation_func=F.silu, gated=True)
    assert set(flags) == set(FIELDS) and not any(flags.values())


def test_fake_cuda_runtime_turns_on_the_jit_fusions():
    fake = Runtime(torch.device("cuda", 0), "nccl")  # never touches a GPU: only is_cuda is read
    support = fusion_support(fake)
    assert support.jit
    assert support.rope == fusions._te_rope_available()
    assert support.fused_adam  # torch's fused Adam step on every CUDA runtime


def test_cuda_without_te():
    swiglu = fusion_flags(CUDA_NO_TE, activation_func=F.silu, gated=True, add_bias_linear=False)
    assert swiglu == dict(masked_softmax_fusion=False, bias_activation_fusion=True, bias_dropout_fusion=True,
                          apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    assert fusion_flags(CUDA_NO_TE, activation_func=F.gelu, add_bias_linear=True)["bias_activation_fusion"]
    # megatron has no fused path for these: the flag must stay off (it would raise or fail at run time)
    for act, gated, bias in ((F.gelu, False, False), (F.silu, False, True), (gelu_tanh, False, True),
                             (F.relu, False, True)):
        assert not fusion_flags(CUDA_NO_TE, activation_func=act, gated=gated,
                                add_bias_linear=bias)["bias_activation_fusion"], act
    assert not fusion_flags(CUDA_NO_TE, activation_func=F.silu, gated=True, moe=True)["bias_activation_fusion"]


def test_cuda_with_te():
    flags = fusion_flags(CUDA_TE, activation_func=F.silu, gated=True)
    assert flags["apply_rope_fusion"] and flags["gradient_accumulation_fusion"] and flags["masked_softmax_fusion"]
    assert not fusion_flags(CUDA_TE, mrope=True)["apply_rope_fusion"]


def _lang_cfg(**over):
    raw = tiny()
    raw["model"]["language"].update(over)
    return load_config(raw).model.language


def test_transformer_config_follows_the_active_runtime():
    lang = _lang_cfg(activation="swiglu", add_bias_linear=False)
    fusions.activate(None)
    off = transformer_config(lang, Layout(), "fp32")
    assert not any(getattr(off, f) for f in FIELDS)
    fusions.activate(Runtime(torch.device("cuda", 0), "nccl"))
    try:
        on = transformer_config(lang, Layout(), "fp32")  # megatron validates the combination
    finally:
        fusions.activate(None)
    assert on.bias_activation_fusion and on.bias_dropout_fusion
    assert module_fusion_flags(lang, CUDA_NO_TE)["bias_activation_fusion"]
    assert not module_fusion_flags(lang)["bias_activation_fusion"]  # back to CPU: off


def _sdpa(config_heads, groups, mask_type, mask=None):
    cfg = types.SimpleNamespace(context_parallel_size=1, attention_dropout=0.0)
    mod = sdpa_attention.SDPACoreAttention.__new__(sdpa_attention.SDPACoreAttention)
    torch.nn.Module.__init__(mod)
    mod.config, mod.attn_mask_type, mod.softmax_scale, mod.dropout = cfg, mask_type, None, 0.0
    return mod


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_native_gqa_equals_repeat_interleave(monkeypatch, causal):
    """bf16 without a mask (what flash runs): native GQA, equal to the expansion. With a mask: expanded
    (on CUDA `enable_gqa` with a mask would take SDPA's math kernel)."""
    from megatron.core.transformer.enums import AttnMaskType

    assert sdpa_attention.NATIVE_GQA  # torch >= 2.5
    s, b, heads, groups, d = 12, 2, 8, 2, 16
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, b, n, d, generator=gen).to(torch.bfloat16) for n in (heads, groups, groups)]
    grad = torch.randn(s, b, heads * d, generator=gen).to(torch.bfloat16)
    mask = None if causal else torch.rand(b, 1, s, s, generator=gen) < 0.3  # True = disallowed
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    sdpa, calls = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa_attention.F, "scaled_dot_product_attention", spy)

    def run(native):
        monkeypatch.setattr(sdpa_attention, "NATIVE_GQA", native)
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out = _sdpa(heads, groups, kind)(q, k, v, mask)
        out.float().backward(grad.float())
        return out.detach(), q.grad, k.grad, v.grad

    native, expanded = run(True), run(False)
    assert calls == [causal, False]
    for a, e in zip(native, expanded):  # two kernels' bf16 roundings
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
    # negative control: a wrong group assignment (repeat instead of repeat_interleave) differs far more
    q, k, v = (t.permute(1, 2, 0, 3) for t in base)
    wrong = sdpa(q, k.repeat(1, heads // groups, 1, 1), v.repeat(1, heads // groups, 1, 1), is_causal=True)
    right = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert (wrong - right).abs().max() > 0.2


def test_fused_activation_numerics():
    """What the CUDA fusions compute (run eagerly here): bias-SwiGLU is SwiGLU; bias-GELU is the tanh
    approximation, within 4.7e-4 of the exact GELU (docs/training.md, "Fused kernels on CUDA")."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 16, generator=gen, dtype=torch.float64) * 3
    bias = torch.randn(16, generator=gen, dtype=torch.float64)
    with torch.compiler.set_stance("force_eager"):
        swiglu = bias_swiglu_impl(x, None)
        gelu = bias_gelu_impl(x, bias)
    a, b = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(swiglu, F.silu(a) * b)
    torch.testing.assert_close(gelu, F.gelu(x + bias, approximate="tanh"))
    diff = (gelu - F.gelu(x + bias)).abs().max().item()
    assert 0 < diff <= 4.8e-4
