"""`attention_kernel` in a model's YAML: the bitfield kernels' KernelConfig fields (what
tools/tune_attention.py prints), checked by the config check and bound to every bitfield core
attention of the module (LLM, fixed-size encoders, native-resolution ViTs)."""

import os

import pytest
import yaml

from mimo.attention import KernelConfig
from mimo.attention.core_attention import BitfieldCoreAttention
from mimo.config import ConfigError, load_config
from mimo.model.native_vision import NativeBitfieldAttention, native_layer_spec
from mimo.model.specs import encoder_layer_spec, llm_block_layer_specs

from test_attn_megatron import _model, model_parallel  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TUNED = {"block_m": 32, "block_n": 16, "num_warps": 2, "bwd_block_m": 16, "dq_block_n": 32, "dq_num_stages": 3}


def _raw(language=None, images=None):
    with open(os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"]["language"].update(language or {})
    raw["model"]["encoders"]["images"].update(images or {})
    return raw


def _problems(raw):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    return str(err.value).splitlines()


def test_a_tuned_setting_is_accepted_for_the_llm_and_an_encoder():
    cfg = load_config(_raw(dict(attention="bitfield", attention_kernel=TUNED),
                           dict(attention="bitfield", attention_kernel={"block_n": 32})))
    assert cfg.model.language.attention_kernel == TUNED
    assert cfg.model.encoders["images"].attention_kernel == {"block_n": 32}
    # The same from the command line (--set): one field at a time.
    cfg = load_config(_raw(dict(attention="bitfield")), overrides=["model.language.attention_kernel.block_m=32"])
    assert cfg.model.language.attention_kernel == {"block_m": 32}
    # The one-launch backward: a true/false field among the integers.
    cfg = load_config(_raw(dict(attention="bitfield")),
                      overrides=["model.language.attention_kernel.fused_backward=true"])
    assert cfg.model.language.attention_kernel == {"fused_backward": True}
    assert KernelConfig(**cfg.model.language.attention_kernel).resolve(128).fused_backward is True
    assert KernelConfig().resolve(128).fused_backward is False  # two launches unless asked
    assert KernelConfig().resolve(128).heads_fastest is False    # each head's rows in turn unless asked
    with pytest.raises(ValueError, match="KernelConfig.fused_backward must be true or false, got 'false'"):
        KernelConfig(fused_backward="false").resolve(128)  # from Python, a string is not read as a flag
    cfg = load_config(_raw(dict(attention="bitfield", attention_kernel={"heads_fastest": True})))
    assert KernelConfig(**cfg.model.language.attention_kernel).resolve(64).heads_fastest is True


@pytest.mark.parametrize("kernel, expected", [
    ({"warps": 4}, ["error: model.language.attention_kernel.warps: unknown field (KernelConfig has block_m, "]),
    ({"block_m": 48}, ["error: model.language.attention_kernel.block_m: must be a power of two >= 16, got 48"]),
    ({"num_warps": 3}, ["error: model.language.attention_kernel.num_warps: must be a power of two from 1 to 32, "
                        "got 3"]),
    ({"dq_num_stages": 0, "split_tiles": 0},
     ["error: model.language.attention_kernel.dq_num_stages: must be a positive integer, got 0"]),
    ({"block_m": "64"}, ["error: model.language.attention_kernel.block_m: must be an integer, got '64'"]),
    ([64], ["error: model.language.attention_kernel: must be a mapping, got [64]"]),
    ({"fused_backward": 1}, ["error: model.language.attention_kernel.fused_backward: must be true or false, got 1"]),
    ({"heads_fastest": "yes"},
     ["error: model.language.attention_kernel.heads_fastest: must be true or false, got 'yes'"]),
    ({"fused_backward": True, "dq_num_warps": 8},
     ["error: model.language.attention_kernel.fused_backward: needs the dK/dV and dQ kernels' warps and stages to "
      "agree (one launch), got bwd_num_warps 4, bwd_num_stages 2, dq_num_warps 8, dq_num_stages 2"]),
])
def test_a_bad_setting_is_one_line_naming_the_field(kernel, expected):
    got = _problems(_raw(dict(attention="bitfield", attention_kernel=kernel)))
    assert len(got) == len(expected) and all(g.startswith(e) for g, e in zip(got, expected)), got


def test_a_setting_without_bitfield_attention_is_refused():
    assert _problems(_raw(images=dict(attention_kernel={"block_m": 32}))) == [
        "error: model.encoders.images.attention_kernel: only takes effect with attention: bitfield"]


def _core(spec):
    return spec.submodules.self_attention.submodules.core_attention


def test_the_specs_bind_the_setting_to_the_core_attention():
    cfg = load_config(_raw(dict(attention="bitfield", attention_kernel=TUNED)))
    for spec in llm_block_layer_specs(cfg.model.language, 0, 2, None):
        core = _core(spec)
        assert core.func is BitfieldCoreAttention and core.keywords == {"kernel_config": KernelConfig(**TUNED)}
    assert _core(llm_block_layer_specs(load_config(_raw(dict(attention="bitfield"))).model.language, 0, 1,
                                       None)[0]) is BitfieldCoreAttention  # none set: the defaults
    core = _core(encoder_layer_spec("bitfield", {"block_n": 32}))
    assert core.func is BitfieldCoreAttention and core.keywords["kernel_config"] == KernelConfig(block_n=32)
    core = _core(native_layer_spec("bitfield", [1], 0, {"block_n": 32}))
    assert core.func is NativeBitfieldAttention and core.keywords["kernel_config"] == KernelConfig(block_n=32)
    assert "kernel_config" not in _core(native_layer_spec("sdpa", [1], 0, None)).keywords


def test_a_built_model_runs_its_attention_with_the_setting(model_parallel):  # noqa: F811
    cfg = load_config(_raw(dict(attention="bitfield", attention_kernel=TUNED)))
    model = _model(llm_block_layer_specs(cfg.model.language, 0, 1, None)[0])
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert len(cores) == 2 and all(c.kernel_config == KernelConfig(**TUNED) for c in cores)
