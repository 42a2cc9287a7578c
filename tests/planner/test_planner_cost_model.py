import pytest

from mimo.planner import CostModel, Measurement, Workload, calibrate, fit_scale, get_gpu, read_model
from mimo.planner.memory import in_flight_microbatches, stage_memory, state_bytes_per_param
from mimo.planner.stages import Layout, plan_module

MODEL = {
    "language": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 2,
                 "vocab_size": 1000, "frozen": False},
    "encoders": {"img": {"kind": "vision", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                         "image_size": 64, "patch_size": 8, "frozen": True,
                         "projector": {"kind": "linear", "frozen": False}}},
}


def _transformer(cm, module, tp=1, cp=1, samples=1, seq=512):
    works = cm.module_work(module, tp, cp, samples, Workload(seq), 256)
    return next(w for w in works if w.kind == "transformer")


def test_transformer_flops_by_hand():
    spec = read_model(MODEL)
    lm = spec.language
    cm = CostModel(get_gpu("cpu"))
    seq, h, f = 512, lm.hidden_size, lm.ffn_hidden_size
    kv = lm.num_query_groups * (h // lm.num_attention_heads)
    w = _transformer(cm, lm, seq=seq)
    linear = 2 * seq * (h * (h + 2 * kv) + h * h + 2 * h * f)
    attention = 4 * seq * seq * h * 0.5  # causal half
    assert f == 4 * h  # default ffn
    assert w.fwd_flops == pytest.approx(linear + attention)
    assert w.bwd_weight_flops == pytest.approx(linear)


def test_tp_and_cp_split_the_compute():
    spec = read_model(MODEL)
    cm = CostModel(get_gpu("h100"))
    base = _transformer(cm, spec.language)
    assert _transformer(cm, spec.language, tp=2).fwd_flops == pytest.approx(base.fwd_flops / 2)
    assert _transformer(cm, spec.language, cp=2).fwd_flops == pytest.approx(base.fwd_flops / 2)
    assert base.fwd_comm_s == 0.0
    assert _transformer(cm, spec.language, tp=2).fwd_comm_s > 0.0
    assert _transformer(cm, spec.language, cp=2).fwd_comm_s > 0.0


def test_gqa_shrinks_kv_work():
    spec = read_model(MODEL)
    mha = read_model({**MODEL, "language": {**MODEL["language"], "num_query_groups": 8}})
    cm = CostModel(get_gpu("h100"))
    assert _transformer(cm, spec.language).params < _transformer(cm, mha.language).params


def test_calibration_recovers_a_known_scale():
    spec = read_model(MODEL)
    cm = CostModel(get_gpu("a100"))
    wl = Workload(512)
    true_scale = 1.7
    meas = []
    for tp in (1, 2, 4):
        work = cm.module_work(spec.language, tp, 1, 1, wl)
        pred = cm.layer_cost(next(w for w in work if w.kind == "transformer")).full
        meas.append(Measurement("language", "transformer", tp, 1, 1, true_scale * pred))
    cal = calibrate(cm, {m.name: m for m in spec.modules}, wl, meas)
    assert cal.scale("transformer") == pytest.approx(true_scale)
    assert cal.scale("head") == 1.0
    assert fit_scale([(1.0, 2.0), (2.0, 4.0)]) == pytest.approx(2.0)


def test_frozen_modules_hold_no_optimizer_state():
    assert state_bytes_per_param(False, "bf16") == 2
    assert state_bytes_per_param(True, "bf16") == 2 + 4 + 4 + 8  # weight, fp32 grad, master, 2 moments
    assert state_bytes_per_param(True, "fp32") == 4 + 4 + 8
    assert stage_memory(100, 0, 10, 3) == 100 * 2 + 10 * 3


def test_in_flight_microbatches_of_1f1b():
    assert [in_flight_microbatches(i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, 4, 2) == 2  # never more than exist


def test_frozen_encoder_keeps_only_projector_activations():
    spec = read_model(MODEL)
    cm = CostModel(get_gpu("h100"))
    enc = spec.encoders[0]
    plan = plan_module(cm, enc, Layout(pp=2), 1, Workload(512), projector_out=256)
    work = cm.module_work(enc, 1, 1, 1, Workload(512), 256)
    projector = next(w for w in work if w.kind == "projector")
    # stage 0 is frozen with nothing trainable before it: nothing saved
    assert plan.stage_activation == [0.0, projector.activation_bytes]
    assert plan.stage_trainable == [0.0, projector.params]
