"""Every validation rule: a config breaking exactly that rule gets an error naming the field."""

import copy
import os
import subprocess
import sys

import pytest
import yaml

from mimo.config import ConfigError, load_config
from mimo.config.load import read_yaml
from tiny import TINY, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def errors(raw, world_size=None):
    try:
        load_config(raw, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def with_(raw, path, value):
    raw = copy.deepcopy(raw)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return raw


DELETE = object()


def test_tiny_is_valid():
    assert errors(tiny(), world_size=1) == []
    assert errors(tiny(tp=2, dp=2), world_size=4) == []


@pytest.mark.parametrize("path,value,field", [
    # types
    ("model.language.num_layers", "two", "model.language.num_layers"),
    ("model.language.frozen", 1, "model.language.frozen"),
    ("parallelism.language.tp", True, "parallelism.language.tp"),
    ("training.lr", "fast", "training.lr"),
    ("model.encoders.images.projector", "mlp", "model.encoders.images.projector"),
    # positive integers
    ("model.language.hidden_size", 0, "model.language.hidden_size"),
    ("parallelism.images.dp", -1, "parallelism.images.dp"),
    ("training.micro_batch_size", 0, "training.micro_batch_size"),
    ("data.seq_length", 0, "data.seq_length"),
    ("parallelism.language.rank_offset", -2, "parallelism.language.rank_offset"),
    # sizes that would overflow where they are used (an OverflowError in the model, before)
    ("model.language.num_layers", 10**20, "model.language.num_layers"),
    ("model.language.vocab_size", 2**31, "model.language.vocab_size"),
    ("training.seed", 2**32, "training.seed"),
    # unknown keys
    ("model.language.num_layer", 2, "model.language.num_layer"),
    ("training.learning_rate", 0.1, "training.learning_rate"),
    ("parallelism.language.tensor_parallel", 2, "parallelism.language.tensor_parallel"),
    ("extra", {}, "extra"),
    # required
    ("model.language.vocab_size", DELETE, "model.language.vocab_size"),
    ("training", DELETE, "training"),
    # choices
    ("model.encoders.images.kind", "video", "model.encoders.images.kind"),
    ("model.encoders.audio.projector.kind", "conv", "model.encoders.audio.projector.kind"),
    ("model.language.attention", "flash", "model.language.attention"),
    ("training.optimizer", "lion", "training.optimizer"),
    ("training.precision", "fp8", "training.precision"),
    ("training.lr_decay_style", "step", "training.lr_decay_style"),
    # optimizer and learning-rate schedule
    ("training.use_distributed_optimizer", "yes", "training.use_distributed_optimizer"),
    ("training.grad_reduce_in_fp32", "no", "training.grad_reduce_in_fp32"),
    ("training.grad_reduce_in_fp32", False, "training.grad_reduce_in_fp32"),  # tiny() trains in fp32
    ("training.lr_warmup_iters", -1, "training.lr_warmup_iters"),
    ("training.lr_warmup_iters", 4, "training.lr_warmup_iters"),  # longer than train_iters = 3
    ("training.min_lr", 0.5, "training.min_lr"),  # above lr = 0.1
    ("training.min_lr", -0.01, "training.min_lr"),
    ("training.min_lr", 0.05, "training.min_lr"),  # lr_decay_style constant: min_lr would be ignored
    ("data.kind", "webdataset", "data.kind"),
    # shapes
    ("model.encoders.images.image_size", 10, "model.encoders.images.image_size"),
    ("model.encoders.images.patch_size", DELETE, "model.encoders.images.patch_size"),
    ("model.encoders.images.hidden_size", 15, "model.encoders.images.hidden_size"),
    ("model.language.num_query_groups", 3, "model.language.num_query_groups"),
    ("model.encoders.audio.clip_frames", 18, "model.encoders.audio.clip_frames"),
    ("model.language.max_sequence_length", 40, "data.seq_length"),
    # lr
    ("training.lr", 0.0, "training.lr"),
    ("training.adam_beta1", 1.0, "training.adam_beta1"),
    ("training.adam_beta2", -0.1, "training.adam_beta2"),
    ("training.adam_eps", 0.0, "training.adam_eps"),
    ("training.lr", -1e-3, "training.lr"),
    # model constants
    ("model.language.norm_eps", -1e-5, "model.language.norm_eps"),
    ("model.encoders.images.norm_eps", 0.0, "model.encoders.images.norm_eps"),
    ("model.language.rope_theta", 0.0, "model.language.rope_theta"),
    ("model.language.rope_scaling", {"factor": 0.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}, "model.language.rope_scaling.factor"),
    ("model.language.rope_scaling", {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32},
     "model.language.rope_scaling.high_freq_factor"),
    # modules
    ("parallelism.video", {}, "parallelism.video"),
    ("parallelism.audio", DELETE, "parallelism.audio"),
])
def test_rule_names_the_field(path, value, field):
    probs = errors(with_(tiny(), path, value))
    assert field in [p for p, _ in probs], probs


def test_tp_must_divide_the_vocabulary():
    # Megatron's vocab-parallel embedding asserts it deep in model building; the check says which field.
    raw = with_(tiny(tp=2, dp=2), "model.language.vocab_size", 129)
    assert errors(raw, world_size=4) == [("parallelism.language.tp", "must divide vocab_size (129)")]
    assert errors(with_(raw, "model.language.vocab_size", 130), world_size=4) == []


def test_bf16_gradient_reduction_needs_bf16():
    raw = with_(with_(tiny(), "training.precision", "bf16"), "training.grad_reduce_in_fp32", False)
    assert errors(raw) == []
    assert [p for p, _ in errors(with_(raw, "training.precision", "fp32"))] == ["training.grad_reduce_in_fp32"]


def test_distributed_optimizer_refuses_encoder_offload():
    raw = with_(with_(tiny(tp=2), "training.offload_encoders", True), "training.use_distributed_optimizer", True)
    raw = with_(with_(raw, "parallelism.images.tp", 1), "parallelism.images.dp", 2)  # three-phase: it offloads
    assert [p for p, _ in errors(raw)] == ["training.use_distributed_optimizer"]
    assert errors(with_(raw, "training.offload_encoders", False)) == []  # control


def test_encoder_offload_needs_a_phase_where_colocated_encoders_are_idle():
    """Before: `config check` said ok and the step plan had no offload (the flag did nothing)."""
    raw = with_(tiny(tp=2), "training.offload_encoders", True)
    assert [p for p, _ in errors(raw)] == ["training.offload_encoders"]  # every module on the LLM's layout
    three_phase = with_(with_(raw, "parallelism.images.tp", 1), "parallelism.images.dp", 2)  # images: tp1 x dp2
    assert errors(three_phase) == []
    apart = with_(with_(raw, "parallelism.images.rank_offset", 2), "parallelism.audio.rank_offset", 4)
    assert errors(apart) == [("training.offload_encoders",
                              "needs an encoder colocated with the LLM (on the LLM's ranks); here none is")]
    # Under replan: auto too, for the configured layout (a re-planned one turns the flag off where it has
    # no phase for it: tests/test_replan.py).
    assert [p for p, _ in errors(with_(with_(apart, "training.replan", "auto"), "training.save", "/tmp/ckpt"))] \
        == ["training.offload_encoders"]


def test_ranks_no_module_uses_are_an_error_without_a_world_size():
    """A gap in the layout's ranks is found from the layout alone (before: only with --world-size)."""
    raw = with_(tiny(), "parallelism.images.rank_offset", 2)
    assert errors(raw) == [("parallelism", "ranks 1 of world size 3 belong to no module")]
    assert errors(with_(raw, "parallelism.images.rank_offset", 1)) == []
    # Found from the ranges' ends, not rank by rank (a set of 30M ranks took seconds and gigabytes).
    far = with_(with_(raw, "parallelism.images.rank_offset", 30_000_000), "parallelism.audio.rank_offset", 5)
    assert errors(far) == [("parallelism", "ranks 1-4, 6-29999999 of world size 30000001 belong to no module")]
    assert errors(far, world_size=30_000_003) == [
        ("parallelism", "ranks 1-4, 6-29999999, 30000001-30000002 of world size 30000003 belong to no module")]


@pytest.mark.parametrize("layout,world,field,needle", [
    # TP divides heads (4), query groups (2), hidden (32), ffn (128)
    (dict(language=dict(tp=4), images=dict(tp=4), audio=dict(tp=4)), 4, "parallelism.language.tp", "num_query_groups"),
    (dict(language=dict(tp=3, dp=1), images=dict(tp=3), audio=dict(tp=3)), 3, "parallelism.language.tp",
     "num_attention_heads"),
    (dict(language=dict(tp=2), images=dict(tp=4, rank_offset=2), audio=dict(tp=2)), 6, "parallelism.images.tp",
     "num_attention_heads"),
    # pp <= num_layers
    (dict(language=dict(pp=3), images=dict(rank_offset=3), audio=dict(rank_offset=3)), 4, "parallelism.language.pp",
     "num_layers"),
    # partial overlap
    (dict(language=dict(dp=2), images=dict(dp=2, rank_offset=1), audio=dict(dp=2)), 3, "parallelism.language",
     "partially overlap parallelism.images"),
    # inside the world size
    (dict(language=dict(dp=2), images=dict(dp=2, rank_offset=2), audio=dict(dp=2)), 3, "parallelism.images",
     "world size"),
    # idle ranks
    (dict(language=dict(dp=2), images=dict(dp=2), audio=dict(dp=2)), 4, "parallelism", "belong to no module"),
    # encoders keep cp = 1
    (dict(language=dict(cp=2), images=dict(cp=2), audio=dict(cp=2)), 2, "parallelism.images.cp", "cp = 1"),
    # no MoE
    (dict(language=dict(ep=2), images=dict(ep=2), audio=dict(ep=2)), 2, "parallelism.language.ep", "experts"),
    # stage_layers
    (dict(language=dict(pp=2, stage_layers=[1, 2]), images=dict(rank_offset=2), audio=dict(rank_offset=2)), 3,
     "parallelism.language.stage_layers", "sum"),
    (dict(language=dict(pp=2, stage_layers=[2]), images=dict(rank_offset=2), audio=dict(rank_offset=2)), 3,
     "parallelism.language.stage_layers", "one entry per"),
])
def test_layout_rules(layout, world, field, needle):
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = layout
    probs = errors(raw, world_size=world)
    assert any(p == field and needle in r for p, r in probs), probs


def test_batch_arithmetic():
    # G = 8 not divisible by m * dL = 3 * 2
    raw = with_(tiny(dp=2), "training.micro_batch_size", 3)
    assert "training.global_batch_size" in [p for p, _ in errors(raw)]
    # Encoder DP divides items, not samples: a colocated encoder dp 8 for a step of 4 samples, and
    # non-colocated dp 3 or 4 against LLM dp 2 / microbatches of 2 samples, are all valid.
    raw = with_(tiny(dp=8), "training.global_batch_size", 4)
    raw = with_(raw, "training.micro_batch_size", 1)
    raw["parallelism"]["language"] = dict(tp=2, dp=4)
    assert errors(raw) == []
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = dict(language=dict(dp=2), images=dict(dp=3, rank_offset=2), audio=dict(dp=4, rank_offset=5))
    assert errors(raw, world_size=9) == []
    # fan-out: non-colocated encoder dp 1 feeding LLM dp 2 is fine
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = dict(language=dict(dp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3))
    assert errors(raw, world_size=4) == []


def test_all_frozen_is_an_error():
    raw = tiny()
    raw["model"]["language"]["frozen"] = True
    for enc in raw["model"]["encoders"].values():
        enc["frozen"] = True
        enc["projector"]["frozen"] = True
    assert "model" in [p for p, _ in errors(raw)]


def test_every_problem_is_reported_at_once():
    raw = with_(tiny(), "training.lr", 0.0)
    raw = with_(raw, "model.language.num_layer", 3)
    raw = with_(raw, "parallelism.language.tp", 3)
    fields = [p for p, _ in errors(raw)]
    assert {"training.lr", "model.language.num_layer", "parallelism.language.tp"} <= set(fields)


def test_defaults_applied():
    cfg = load_config(tiny())
    assert cfg.model.language.ffn_hidden_size == 4 * cfg.model.language.hidden_size
    assert cfg.model.encoders["audio"].tokens_per_item == 16 // 4
    assert cfg.parallelism["language"].cp == 1 and cfg.parallelism["language"].rank_offset == 0
    raw = tiny()
    del raw["model"]["language"]["num_query_groups"]
    assert load_config(raw).model.language.num_query_groups == 4


def test_a_bare_off_in_yaml_is_the_word():
    """YAML 1.1 reads `replan: off` as False: the documented default, written as documented, loads."""
    raw = tiny()
    raw["training"].update(yaml.safe_load("replan: off"))
    assert raw["training"]["replan"] is False
    assert load_config(raw).training.replan == "off"
    raw["training"].update(yaml.safe_load("replan: on"))  # not a mode: named, not a type error
    hint = " (YAML reads true/yes/on as 'on' and false/no/off as 'off')"
    assert errors(raw) == [("training.replan", "must be one of off, auto, got 'on'" + hint)]
    raw["training"].update(yaml.safe_load("replan: true"))  # the same word, and the message says why
    assert errors(raw) == [("training.replan", "must be one of off, auto, got 'on'" + hint)]


def _cli(tmp_path, raw, *args):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path), *args], capture_output=True,
                          text=True, cwd=ROOT)


def test_cli_ok_and_errors(tmp_path):
    ok = _cli(tmp_path, tiny(dp=2), "--world-size", "2")
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    bad = _cli(tmp_path, with_(tiny(), "training.lr", 0), "--set", "parallelism.language.tp=3")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert lines and all(l.startswith("error: ") for l in lines), bad.stderr
    assert "Traceback" not in bad.stderr
    assert any(l.startswith("error: training.lr:") for l in lines)


def test_cli_bad_yaml_and_missing_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_a_data_path_that_is_a_directory_says_so(tmp_path):
    raw = tiny()
    raw["data"] = {"kind": "llava", "path": str(tmp_path), "tokenizer": str(tmp_path)}
    with pytest.raises(ConfigError) as exc:
        load_config(raw)
    assert ("data.path", f"{tmp_path} is a directory; give the records file (a JSON list or JSONL)") in exc.value.problems


def test_a_config_file_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    from mimo.config.load import apply_overrides

    def problem(fn, *args):
        with pytest.raises(ConfigError) as exc:
            fn(*args)
        return str(exc.value)

    (tmp_path / "broken.yaml").write_text("model: {a: 1,\n  b: [2\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "dir.yaml").mkdir()
    p = {n: str(tmp_path / n) for n in ("broken.yaml", "binary.yaml", "dir.yaml", "nope.yaml")}
    assert problem(read_yaml, p["broken.yaml"]).startswith(f"error: {p['broken.yaml']}: invalid YAML: ")
    assert "at line 3, column 1" in problem(read_yaml, p["broken.yaml"])
    assert problem(read_yaml, p["binary.yaml"]) == f"error: {p['binary.yaml']}: not UTF-8 text (a YAML config is text)"
    assert problem(read_yaml, p["dir.yaml"]) == f"error: {p['dir.yaml']}: is a directory, not a YAML file"
    assert problem(read_yaml, p["nope.yaml"]) == f"error: {p['nope.yaml']}: no such file"
    # A key written twice in one mapping (plain YAML keeps the last one) names both lines; a key
    # a merge brought in may still be overridden.
    (tmp_path / "twice.yaml").write_text("training:\n  lr: 1.0e-4\n  train_iters: 3\n  lr: 2.0e-4\n")
    assert problem(read_yaml, str(tmp_path / "twice.yaml")) == (
        f"error: {tmp_path / 'twice.yaml'}: invalid YAML: key 'lr' written twice (first at line 2) at line 4, "
        "column 3")
    (tmp_path / "merge.yaml").write_text("base: &b {lr: 1, wd: 2}\ntraining:\n  <<: *b\n  lr: 3\n")
    assert read_yaml(str(tmp_path / "merge.yaml"))["training"] == {"lr": 3, "wd": 2}
    (tmp_path / "merged_twice.yaml").write_text("training:\n  <<: {lr: 1, lr: 2}\n")
    assert "key 'lr' written twice (first at line 2) at line 2" in problem(read_yaml, str(tmp_path / "merged_twice.yaml"))
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert problem(read_yaml, str(tmp_path / "deep.yaml")) == f"error: {tmp_path / 'deep.yaml'}: invalid YAML: nested too deeply"
    assert problem(apply_overrides, {}, ["training.lr=" + "[" * 5000 + "]" * 5000]) == (
        "error: training.lr: cannot parse the value as YAML (nested too deeply)")
    # A --set value YAML cannot parse names the field and the text.
    assert problem(apply_overrides, {}, ["training.train_iters=[1,2"]) == (
        "error: training.train_iters: cannot parse '[1,2' as a YAML value (expected ',' or ']', but got "
        "'<stream end>' at line 1, column 5)")
    assert problem(apply_overrides, {}, ["=3"]) == (
        "error: =3: override must look like dotted.path=value (a field name is empty)")  # before: "error: : unknown key"


def test_config_check_refuses_a_world_size_below_one(capsys):
    from mimo.config.__main__ import main

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs",
                        "cpu_demo.yaml")
    with pytest.raises(SystemExit) as exc:
        main(["check", demo, "--world-size", "-1"])
    assert exc.value.code == 2 and "--world-size: must be at least 1, got -1" in capsys.readouterr().err


def test_example_configs_are_valid_and_runnable(tmp_path):
    from mimo.training import layout_problems

    folder = os.path.join(ROOT, "examples", "configs")
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".yaml"))
    assert len(paths) > 40  # the demos, the parity set and the paper's sweeps
    tiny_hf = sample = None
    for path in paths:
        sets = []
        if read_yaml(path)["model"].get("hf"):  # HF examples: a tiny random model in their place
            if tiny_hf is None:
                sys.path.insert(0, os.path.join(ROOT, "tools"))
                from make_tiny_llava import make_llava

                tiny_hf = make_llava(str(tmp_path / "tiny_llava"))
            sets = [f"model.hf={tiny_hf}"]
        if read_yaml(path).get("data", {}).get("kind") == "llava":  # generated sample data in their place
            if sample is None:
                sys.path.insert(0, os.path.join(ROOT, "tools"))
                import make_sample_data

                sample = str(tmp_path / "sample")
                assert make_sample_data.main([sample, "--records", "8", "--image-size", "16"]) == 0
            sets = [f"data.path={sample}/train.json", f"data.image_root={sample}", f"data.tokenizer={sample}/tokenizer"]
        cfg = load_config(path, sets)
        load_config(path, sets, world_size=cfg.world_size)
        assert layout_problems(cfg) == [], path


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


def test_no_bad_value_anywhere_causes_a_traceback():
    """Every leaf replaced by every kind of bad value: ConfigError or success, nothing else."""
    bad_values = [0, -1, "x", None, [1], {"a": 1}, 1.5, True, 10 ** 6]
    base = tiny(dp=2)
    for path in _leaves(base):
        for value in bad_values:
            raw = with_(base, path, value)
            try:
                load_config(raw, world_size=2)
            except ConfigError as exc:
                assert exc.problems and all(isinstance(p, str) and r for p, r in exc.problems)


def test_memory_knobs_bad_values_are_one_line_errors(tmp_path):
    cfg = load_config(with_(with_(tiny(tp=2), "parallelism.images.sp", True), "parallelism.language.recompute", "full"))
    assert cfg.parallelism["images"].sp is True and cfg.parallelism["language"].recompute == "full"
    assert cfg.parallelism["audio"].sp is False and cfg.parallelism["audio"].recompute == "none"
    for field, value, message in [
            ("parallelism.language.recompute", "everything",
             "error: parallelism.language.recompute: must be one of none, selective, full"),
            ("parallelism.images.sp", "yes", "error: parallelism.images.sp: "),
            # 48 tokens over tp 2 x cp 1 is fine, but audio items have 4 tokens: tp 8 cannot split them.
            ("parallelism.audio.sp", True, None)]:
        raw = with_(tiny(), field, value)
        if message is None:
            raw = with_(with_(raw, "parallelism.audio.tp", 8), "model.encoders.audio.num_attention_heads", 8)
            raw["model"]["encoders"]["audio"]["hidden_size"] = 64
            message = ("error: parallelism.audio.sp: needs the encoder's tokens per item (4, class token included) "
                       "divisible by tp (8)")
        r = _cli(tmp_path, raw)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert any(line.startswith(message) for line in r.stderr.strip().splitlines()), r.stderr
    # A CLIP-style class token joins the encoder's sequence: even patch counts become odd.
    raw = with_(with_(with_(tiny(), "parallelism.images.tp", 2), "parallelism.images.sp", True),
                "model.encoders.images.class_token", True)
    r = _cli(tmp_path, raw)
    assert r.returncode == 2 and "class token included) divisible by tp (2)" in r.stderr, r.stderr


def test_a_bad_train_iters_or_lr_is_one_error_not_two():
    """A negative train_iters or lr is its own error; the warmup and min_lr checks that compare with
    them stay quiet (before: `warmup (0 steps) is longer than the run (train_iters = -3)`)."""
    from tiny import TINY

    for key, value in (("train_iters", -3), ("lr", -1.0)):
        raw = copy.deepcopy(TINY)
        raw["training"][key] = value
        with pytest.raises(ConfigError) as exc:
            load_config(raw)
        assert [p for p, _ in exc.value.problems] == [f"training.{key}"], exc.value.problems


def test_placeholder_ids_are_tokens_of_the_llm_and_each_encoders_own():
    """Before: `config check` said ok, then the run stopped mid-step (an IndexError in the embedding, or
    `8 placeholder tokens (id 5) but 4 modality tokens`)."""
    assert errors(with_(tiny(), "model.encoders.images.placeholder_id", 10**5)) == [
        ("model.encoders.images.placeholder_id", "100000 is not a token of the LLM (model.language.vocab_size 128)")]
    same = with_(with_(tiny(), "model.encoders.images.placeholder_id", 5), "model.encoders.audio.placeholder_id", 5)
    assert errors(same) == [("model.encoders.audio.placeholder_id",
                             "5 is model.encoders.images.placeholder_id too; each encoder needs its own")]
    # An explicit id that is also another encoder's default (the top of the vocabulary).
    top = with_(tiny(), "model.encoders.audio.placeholder_id", 127)
    assert [p for p, _ in errors(top)] == ["model.encoders.audio.placeholder_id"]
    assert errors(with_(tiny(), "model.language.vocab_size", 2)) == [
        ("model.language.vocab_size", "2 has no room at its top for 2 placeholder id(s)")]
    assert errors(with_(tiny(), "model.language.vocab_size", 4)) == [
        ("model.language.vocab_size", "4 leaves mock data fewer than 2 text token ids (1 .. 1, below every "
                                      "placeholder id)")]
    assert errors(with_(tiny(), "model.language.vocab_size", 5)) == []  # text ids 1 and 2: the mock data runs


@pytest.mark.parametrize("path", ["training.lr", "training.clip_grad", "training.weight_decay", "training.min_lr",
                                  "model.language.norm_eps", "training.peak_tflops"])
def test_nan_and_infinity_are_one_error_each(path):
    """YAML's .nan and .inf passed every range check (`clip_grad < 0` is false for NaN)."""
    for value in (float("nan"), float("inf"), float("-inf")):
        assert errors(with_(tiny(), path, value)) == [(path, f"must be a finite number, got {value}")]


def test_an_empty_section_means_its_defaults(tmp_path):
    """`images:` or `encoders:` with everything under it commented out is YAML's null: the section's
    defaults (before: `must be a mapping, got None`). A required field still has to be given."""
    assert errors(with_(tiny(), "parallelism.images", None)) == []
    text = yaml.safe_dump({k: v for k, v in tiny().items() if k != "parallelism"})
    text = text.replace("  encoders:\n", "  encoders:\n#    images: {}\n", 1)
    text = text[:text.index("#    images")] + text[text.index("  language:"):]  # encoders: (nothing under it)
    path = tmp_path / "text_only.yaml"
    path.write_text(text + "parallelism:\n  language:\n#    tp: 2\n")
    cfg = load_config(str(path))
    assert cfg.model.encoders == {} and cfg.parallelism["language"].tp == 1
    assert [p for p, _ in errors(with_(tiny(), "training", None))] == ["training.global_batch_size"]


def test_config_check_of_another_world_size_under_replan_auto(tmp_path, capsys):
    """Under training.replan: auto a job of another size re-plans the layout at start, which needs the
    planner and the checkpoint: `config check --world-size N` says so and names the training script's
    --check, with the same overrides; without replan the layout must fill N ranks."""
    from mimo.config.__main__ import main

    path = os.path.join(ROOT, "examples", "configs", "cpu_noncolocated.yaml")
    replan = ["--set", "training.replan=auto", "--set", f"training.save={tmp_path / 'ckpt'}"]
    assert main(["check", path, "--world-size", "4"] + replan) == 2
    assert capsys.readouterr().err == (
        "error: --world-size: the layout is for 6 ranks, not 4; under training.replan: auto a job on 4 ranks "
        "re-plans it at start, which this check cannot do: `WORLD_SIZE=4 python examples/pretrain_mimo.py --config "
        f"{path} --set training.replan=auto --set training.save={tmp_path / 'ckpt'} --check` checks that\n")
    assert main(["check", path, "--world-size", "6"] + replan) == 0 and capsys.readouterr().out == "ok\n"
    assert main(["check", path, "--world-size", "4"]) == 2
    assert "error: parallelism.images: needs ranks [4, 6) but the world size is 4" in capsys.readouterr().err
