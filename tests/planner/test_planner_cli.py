import json
import os
import re

from mimo.planner.api import load_raw
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = os.path.join(ROOT, "tests", "planner", "tiny_mllm.yaml")
LLAVA = os.path.join(ROOT, "examples", "planner", "llava_like.yaml")


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _yaml_tail(stdout):
    return yaml.safe_load(stdout.split("# best config", 1)[1].split("\n", 1)[1])


def test_plan_end_to_end_tiny(tmp_path):
    out = tmp_path / "planned.yaml"
    r = _plan("--config", TINY, "--gpus", "4", "--gpu", "cpu", "--top", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "placement" in r.stdout and "step s" in r.stdout
    written = yaml.safe_load(out.read_text())
    assert written == _yaml_tail(r.stdout)
    assert set(written["parallelism"]) == {"language", "images", "audio"}
    for entry in written["parallelism"].values():
        assert entry["rank_offset"] + entry["tp"] * entry["cp"] * entry["pp"] * entry["dp"] <= 4
        assert ("stage_layers" in entry) == (entry["pp"] > 1)


def test_plan_llava_example_8_gpus_emits_full_config():
    r = _plan("--config", LLAVA, "--gpus", "8")
    assert r.returncode == 0, r.stderr
    cfg = _yaml_tail(r.stdout)
    assert {"model", "parallelism", "data", "training"} <= set(cfg)
    assert cfg["training"]["global_batch_size"] % (cfg["training"]["micro_batch_size"]
                                                    * cfg["parallelism"]["language"]["dp"]) == 0


def test_plan_with_profiled_samples(tmp_path):
    # --samples sets the encoder workload: more images per sample, slower best step
    light, heavy = tmp_path / "light.json", tmp_path / "heavy.json"
    light.write_text(json.dumps([[100, 0, 0], [60, 1, 0]] * 5))
    heavy.write_text(json.dumps([[20, 2, 1], [60, 1, 2]] * 5))
    times = []
    for path in (light, heavy):
        r = _plan("--config", TINY, "--gpus", "4", "--gpu", "cpu", "--samples", str(path), "--json")
        assert r.returncode == 0, r.stderr
        times.append(json.loads(r.stdout)["candidates"][0]["step_time_s"])
    assert times[0] < times[1]


@pytest.mark.parametrize("args", [
    ["--config", "/nonexistent.yaml", "--gpus", "4"],
    ["--config", TINY, "--gpus", "0"],
    ["--config", TINY, "--gpus", "4", "--gpu", "tpu"],
    ["--config", TINY],
    ["--config", TINY, "--gpus", "four"],
])
def test_bad_input_is_one_line_error(args):
    r = _plan(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr


def test_bad_model_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  language: {num_layers: 2, hidden_size: 10, num_attention_heads: 3, vocab_size: 8}\n")
    r = _plan("--config", str(bad), "--gpus", "2", "--gpu", "cpu")
    assert r.returncode == 2
    assert r.stderr.startswith("error: model.language")


@pytest.mark.parametrize("config,gpus,gpu", [(TINY, 4, "cpu"), (LLAVA, 16, "h100")])
def test_emitted_config_passes_mimo_config_check(tmp_path, config, gpus, gpu):
    out = tmp_path / "planned.yaml"
    r = _plan("--config", config, "--gpus", str(gpus), "--gpu", gpu, "--out", str(out))
    assert r.returncode == 0, r.stderr
    chk = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(out), "--world-size", str(gpus)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert chk.returncode == 0, chk.stderr
    assert chk.stdout.strip() == "ok"


def test_every_ranked_candidate_emits_a_valid_config_cp_ones_with_bitfield_attention():
    from mimo.config import load_config
    from mimo.planner import make_plan
    from mimo.planner.emit import build_config

    plan = make_plan(LLAVA, 8, "h100")
    order = [m.name for m in plan.spec.modules]
    s = plan.settings
    seen_cp = False
    for cand in plan.candidates[:10]:
        cfg = build_config(load_raw(LLAVA), cand, order, s.workload.seq_length, s.global_batch, s.micro_batch,
                           s.precision)
        load_config(cfg, world_size=8)  # raises ConfigError naming the field if the emitted layout is invalid
        if cfg["parallelism"]["language"]["cp"] > 1:
            seen_cp = True
            assert cfg["model"]["language"]["attention"] == "bitfield"
    assert seen_cp, "the 8-GPU LLaVA plan ranks a CP candidate in its top 10 (see docs/planner.md)"


sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan as plan_cli  # noqa: E402


def _tiny():
    with open(TINY) as fh:
        return yaml.safe_load(fh)


def _eval_tiny(**language):
    raw = _tiny()
    raw["parallelism"] = {"language": {"tp": 2, "dp": 2, **language}, "images": {"tp": 2, "dp": 2},
                          "audio": {"dp": 4}}
    return raw


def _set(path, value, base=None):
    raw = base or _tiny()
    node = raw
    *head, last = path.split(".")
    for k in head:
        node = node[k]
    node[last] = value
    return raw


# (config, extra args, the start of the one error line); found by fuzzing plan.py
MALFORMED = {
    "data_list": (lambda: _set("data", [1, 2]), [], "error: data: expected a mapping"),
    "training_str": (lambda: _set("training", "fast"), [], "error: training: expected a mapping"),
    "seq_over_max": (lambda: _set("data.seq_length", 100000), [],
                     "error: data.seq_length: 100000 exceeds model.language.max_sequence_length"),
    "projector_str": (lambda: _set("model.encoders.audio.projector", "linear"), [],
                      "error: model.encoders.audio.projector: expected a mapping"),
    "layers_huge": (lambda: _set("model.language.num_layers", 10 ** 9), [], "error: model.language.num_layers"),
    "hidden_overflow": (lambda: _set("model.language.hidden_size", 10 ** 400), [],
                        "error: model.language.hidden_size"),
    "data_kind": (lambda: _set("data.kind", "bogus"), [], "error: data.kind"),
    "unknown_module": (lambda: _set("parallelism.video", {"tp": 1}, _eval_tiny()), ["--evaluate"],
                       "error: parallelism.video: not a module"),
    "unknown_key": (lambda: _eval_tiny(tensor_parallel=2), ["--evaluate"],
                    "error: parallelism.language.tensor_parallel: unknown key"),
    "ep": (lambda: _eval_tiny(ep=2), ["--evaluate"], "error: parallelism.language.ep: expert parallelism needs an MoE LLM"),
    "stage_layers_sum": (lambda: _eval_tiny(pp=2, dp=1, stage_layers=[1, 1]), ["--evaluate"],
                         "error: parallelism.language.stage_layers: must sum to num_layers"),
    "stage_layers_type": (lambda: _eval_tiny(pp=2, dp=1, stage_layers="x"), ["--evaluate"],
                          "error: parallelism.language.stage_layers: expected a list"),
    # --evaluate costs the config as it is: no file to write, no other GPU count
    "evaluate_out": (_eval_tiny, ["--evaluate", "--out", "never.yaml"], "error: --out: only with a search"),
    "evaluate_gpus": (_eval_tiny, ["--evaluate", "--gpus", "8"],
                      "error: parallelism: the layout uses 4 GPUs, not --gpus 8"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_config_is_one_error_line(tmp_path, capsys, case):
    make, extra, start = MALFORMED[case]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(make()))
    args = ["--config", str(path), "--gpu", "cpu"] + (extra if extra else ["--gpus", "4"])
    assert plan_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(start), err


def test_a_key_written_twice_is_named_with_its_lines(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  language: {num_layers: 2}\n  language: {num_layers: 3}\n")
    assert plan_cli.main(["--config", str(path), "--gpu", "cpu", "--gpus", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}: invalid YAML (key 'language' written twice (first at line 2) at line 3, column 3)"]


def test_bad_samples_file_is_one_error_line(tmp_path, capsys):
    samples = tmp_path / "s.json"
    samples.write_text("[" * 100000)
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--samples", str(samples)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {samples}: unreadable as JSON"), err
    samples.write_text('{"id": "a", "text_tokens": 3, "image_tokens": 1}\n{"id": "b", "text_tokens": 5, "image_tokens": 0}\n')
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--samples", str(samples)]) == 2
    assert capsys.readouterr().err == (f"error: {samples}: invalid JSON (Extra data); expected one JSON list of "
                                       "[text_tokens, images, audio_clips]\n")  # balance.py's records, not these


def test_samples_longer_than_the_sequence_warn(tmp_path, capsys):
    samples = tmp_path / "s.json"
    samples.write_text("[[1000, 1, 1], [10, 1, 1]]")
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--samples", str(samples),
                          "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["candidates"]
    assert out.err.startswith("warning: --samples: 1 of 2 samples (first: 0) hold more")

    # On average too many items for the sequence: one error, no warning before it.
    samples.write_text("[[100, 5, 0]]")
    assert plan_cli.main(["--config", LLAVA, "--gpus", "8", "--samples", str(samples)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --samples: on average 5 items of images (576 tokens each) do not fit in data.seq_length 2048"]


def test_out_must_name_a_file(capsys):
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--out", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: --out: empty path"


def test_huge_gpu_budget_ends_quickly(capsys):
    # divisors bounded by TP <= node, CP <= max_cp, PP <= layers: 10^12 GPUs is an answer
    # (no layout fits the batch), not a hang
    assert plan_cli.main(["--config", TINY, "--gpus", str(10 ** 12), "--gpu", "cpu"]) == 2
    assert capsys.readouterr().err.startswith(f"error: no layout splits {10 ** 12} GPUs for this model and batch")


def test_no_layout_fitting_memory_is_told_apart_from_no_layout_at_all(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(_set("model.language.hidden_size", 65536)))
    assert plan_cli.main(["--config", str(path), "--gpus", "2", "--gpu", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: no layout fits on 2 x cpu")


def test_stage_layers_are_costed_as_given(tmp_path, capsys):
    def step(stage_layers):
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump(_eval_tiny(pp=2, dp=1, **({"stage_layers": stage_layers}
                                                                  if stage_layers else {}))))
        assert plan_cli.main(["--config", str(path), "--gpu", "cpu", "--evaluate", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["step_time_s"]
    balanced, skewed = step(None), step([3, 1])
    assert step([2, 2]) == balanced and skewed > balanced


def test_evaluate_warns_when_the_layout_does_not_fit(tmp_path, capsys):
    raw = _set("model.language.hidden_size", 65536, _eval_tiny())
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert plan_cli.main(["--config", str(path), "--gpu", "cpu", "--evaluate", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["peak_memory_gb"] > 64
    assert out.err.startswith("warning: predicted peak")


@pytest.mark.parametrize("images,audio,message", [
    ({"tp": 2, "dp": 2}, {"dp": 4, "rank_offset": 100}, "ranks 4-99 belong to no module"),
    ({"dp": 1, "rank_offset": 5}, {"dp": 1, "rank_offset": 7}, "ranks 4, 6 belong to no module"),
    # huge degrees and offsets are answered at once, not by listing ranks
    ({"dp": 2, "rank_offset": 10 ** 10}, {"dp": 4}, "ranks 4-9999999999 belong to no module"),
])
def test_ranks_left_to_no_module_are_an_error(tmp_path, capsys, images, audio, message):
    raw = _eval_tiny()
    raw["parallelism"]["images"], raw["parallelism"]["audio"] = images, audio
    path = tmp_path / "gap.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert plan_cli.main(["--config", str(path), "--gpu", "cpu", "--evaluate"]) == 2
    assert capsys.readouterr().err.strip() == f"error: parallelism: {message}"


def test_table_says_when_the_batch_caps_llm_dp(capsys):
    # global batch 8, micro batch 1: LLM DP <= 8, so 16 GPUs force TP x CP x PP >= 2
    assert plan_cli.main(["--config", TINY, "--gpus", "16", "--gpu", "cpu", "--top", "50"]) == 0
    out = capsys.readouterr().out
    assert "# the batch allows LLM DP <= 8: an LLM on all 16 GPUs has TP x CP x PP >= 2" in out
    found = re.findall(r"language\[(\d+):(\d+)\] tp(\d+) cp(\d+) pp(\d+)(?: \[[\d,]+\])? dp(\d+)", out)
    rows = [(int(b) - int(a), *map(int, rest)) for a, b, *rest in found]
    assert len(rows) == 50 and all(d <= 8 for *_, d in rows)
    whole = [r for r in rows if r[0] == 16]
    assert whole and all(t * c * p >= 2 for _, t, c, p, _ in whole)
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu"]) == 0
    assert "the batch allows" not in capsys.readouterr().out


def test_table_says_how_many_layouts_tie_with_the_best(capsys):
    # The count covers every costed layout, not only the listed ones: check it
    # against the step times the JSON output gives for all of them.
    args = ["--config", LLAVA, "--gpus", "256"]
    assert plan_cli.main([*args, "--json", "--top", "100000"]) == 0
    steps = [c["step_time_s"] for c in json.loads(capsys.readouterr().out)["candidates"]]
    ties = sum(s <= steps[0] * (1 + plan_cli.TIE) for s in steps[1:])
    assert ties > 1 and steps[ties + 1] > steps[0] * (1 + plan_cli.TIE)
    assert plan_cli.main([*args, "--top", "1"]) == 0
    assert (f"# {ties} other layouts within 5% of the best step time: too close for the model to rank; "
            "measure before choosing") in capsys.readouterr().out
    # 16 tiny CPU ranks: the best is more than 5% ahead of the next.
    assert plan_cli.main(["--config", TINY, "--gpus", "16", "--gpu", "cpu"]) == 0
    assert "within 5%" not in capsys.readouterr().out


def _candidates(capsys, args):
    assert plan_cli.main([*args, "--json", "--top", "100000"]) == 0
    return json.loads(capsys.readouterr().out)["candidates"]


def _evaluate(tmp_path, capsys, raw, cand):
    path = tmp_path / "cand.yaml"
    path.write_text(yaml.safe_dump({**raw, "parallelism": cand["parallelism"]}))
    homogeneous = ["--homogeneous"] if cand["placement"] == "homogeneous" else []
    assert plan_cli.main(["--config", str(path), "--evaluate", "--json", *homogeneous]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_candidate_costs_the_same_when_evaluated_as_written(tmp_path, capsys):
    # A 12B frozen encoder + 70B LLM at 16K on 64 GPUs: many candidates only
    # fit with layers moved to later pipeline stages, so a candidate must name
    # its split (stage_layers) to be reproducible by --evaluate.
    import paper_check
    raw = {"model": paper_check.model_config("12B", "70B", frozen=True), "data": {"seq_length": 16384},
           "training": {"global_batch_size": 256}}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(raw))
    cands = _candidates(capsys, ["--config", str(path), "--gpus", "64"])
    uneven = [c for c in cands if len(set(c["parallelism"]["language"].get("stage_layers", [0]))) > 1]
    assert len(cands) > 50 and len(uneven) > 10
    for cand in cands[::3] + uneven[:10]:
        got = _evaluate(tmp_path, capsys, raw, cand)
        assert (got["placement"], got["step_time_s"], got["peak_memory_gb"]) == \
            (cand["placement"], cand["step_time_s"], cand["peak_memory_gb"]), cand


def test_out_writes_the_best_layout_a_config_can_express(tmp_path, capsys):
    # 256 GPUs: Megatron's homogeneous baseline ranks first; mimo cannot run
    # it, so --out writes the next candidate, exactly as it was costed.
    args = ["--config", LLAVA, "--gpus", "256"]
    cands = _candidates(capsys, args)
    assert cands[0]["placement"] == "homogeneous" and cands[1]["placement"] != "homogeneous"
    out = tmp_path / "planned.yaml"
    assert plan_cli.main([*args, "--out", str(out)]) == 0
    assert "# best config: candidate #2, the best a mimo config can express" in capsys.readouterr().out
    written = yaml.safe_load(out.read_text())
    for name, entry in cands[1]["parallelism"].items():
        assert {k: written["parallelism"][name][k] for k in entry} == entry
    got = _evaluate(tmp_path, capsys, load_raw(LLAVA), {"placement": "colocated",
                                                         "parallelism": written["parallelism"]})
    assert (got["step_time_s"], got["peak_memory_gb"]) == (cands[1]["step_time_s"], cands[1]["peak_memory_gb"])


@pytest.mark.parametrize("gpus", [256, 1024])
def test_homogeneous_candidates_split_every_encoder_at_the_llm_tp(capsys, tmp_path, gpus):
    # A 20-head ViT cannot run at TP 8: the homogeneous baseline (which gives
    # the encoder the LLM's TP) must skip such layouts, not emit them.
    raw = load_raw(LLAVA)
    raw["model"]["encoders"]["images"].update(hidden_size=1280, num_attention_heads=20, ffn_hidden_size=5120)
    path = tmp_path / "vit20.yaml"
    path.write_text(yaml.safe_dump(raw))
    cands = _candidates(capsys, ["--config", str(path), "--gpus", str(gpus)])
    homogeneous = [c["parallelism"]["images"]["tp"] for c in cands if c["placement"] == "homogeneous"]
    assert homogeneous and all(20 % tp == 0 for tp in homogeneous)
    assert plan_cli.main(["--config", str(path), "--gpus", str(gpus), "--out", str(tmp_path / "o.yaml")]) == 0


def test_the_llm_tp_divides_its_vocabulary(capsys, tmp_path):
    # 32,002 words split over TP 1 or 2 only: the search must not offer TP 4 or 8
    # (the emitted config would fail `mimo.config check`).
    raw = load_raw(LLAVA)
    raw["model"]["language"]["vocab_size"] = 32002
    path = tmp_path / "vocab.yaml"
    path.write_text(yaml.safe_dump(raw))
    cands = _candidates(capsys, ["--config", str(path), "--gpus", "64"])
    assert {c["parallelism"]["language"]["tp"] for c in cands} == {1, 2}


def test_set_overrides_a_field_as_the_trainer_does(tmp_path, capsys):
    """--set PATH=VALUE is applied before the search: the same as editing the YAML."""
    edited = load_raw(TINY)
    edited["training"]["global_batch_size"] *= 2
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(edited, sort_keys=False))  # the encoders' order is the model's
    n = edited["training"]["global_batch_size"]
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--json",
                          "--set", f"training.global_batch_size={n}"]) == 0
    with_set = json.loads(capsys.readouterr().out)
    assert plan_cli.main(["--config", str(path), "--gpus", "4", "--gpu", "cpu", "--json"]) == 0
    with_file = json.loads(capsys.readouterr().out)
    assert with_set["candidates"] == with_file["candidates"]
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--set", "nonsense"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: nonsense: override must look like dotted.path=value"]


def test_samples_with_media_the_model_has_no_encoder_for_warn(tmp_path, capsys):
    """Audio clips in --samples for a vision-only model: the trainer would skip those records; the plan
    says their clips are not costed (before: nothing said)."""
    samples = tmp_path / "s.json"
    samples.write_text("[[100, 2, 3], [100, 1, 0]]")
    assert plan_cli.main(["--config", LLAVA, "--gpus", "8", "--samples", str(samples), "--json"]) == 0
    err = capsys.readouterr().err
    assert ("warning: --samples: 1 of 2 samples (first: 0) hold audio clips, but the model has no audio encoder; "
            "their audio clips are not costed") in err, err


def test_an_out_path_that_cannot_be_written_is_refused_before_the_search(tmp_path, capsys):
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --out: {tmp_path} is a directory; name the file to write\n"
    out = tmp_path / "not" / "made" / "best.yaml"  # a directory not made yet is made
    assert plan_cli.main(["--config", TINY, "--gpus", "4", "--gpu", "cpu", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["parallelism"]


def test_a_run_configs_settings_left_out_are_the_trainers(tmp_path, capsys):
    """Re-planning a run config by hand (it has a parallelism section) writes what the run trains with:
    the trainer's fp32 and no distributed optimizer where it sets none, so resuming on the written
    config does not switch the run to bf16. A model file takes the planner's GPU defaults, and each
    one the trainer would not choose is named on stderr."""
    run = os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")
    out = tmp_path / "new.yaml"
    assert plan_cli.main(["--config", run, "--gpus", "1", "--gpu", "h100", "--out", str(out)]) == 0
    training = yaml.safe_load(out.read_text())["training"]
    assert (training["precision"], training["use_distributed_optimizer"]) == ("fp32", False)
    assert "note:" not in capsys.readouterr().err
    model = load_raw(run)
    del model["parallelism"]
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(model))
    assert plan_cli.main(["--config", str(path), "--gpus", "1", "--gpu", "h100", "--out", str(out)]) == 0
    training = yaml.safe_load(out.read_text())["training"]
    assert (training["precision"], training["use_distributed_optimizer"]) == ("bf16", True)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert [n.split()[1] for n in notes] == ["training.precision", "training.use_distributed_optimizer"], notes
    assert "the trainer's default is \"fp32\"" in notes[0]


def test_a_replan_floor_above_the_planned_size_is_dropped(tmp_path, capsys):
    """training.replan_min_ranks bounds the sizes a re-plan prepares for; a layout planned for fewer
    ranks drops it (the config check would refuse it), one planned for more keeps it."""
    run = os.path.join(ROOT, "examples", "configs", "cpu_noncolocated.yaml")
    out = tmp_path / "new.yaml"
    common = ["--config", run, "--gpu", "cpu", "--out", str(out), "--set", "training.replan=auto",
              "--set", f"training.save={tmp_path / 'ckpt'}"]
    for gpus, floor, kept in ((3, 5, False), (4, 2, True)):
        assert plan_cli.main([*common, "--gpus", str(gpus), "--set", f"training.replan_min_ranks={floor}"]) == 0
        assert ("replan_min_ranks" in yaml.safe_load(out.read_text())["training"]) == kept
    capsys.readouterr()


def test_gpu_and_profile_are_exclusive_and_a_missing_samples_file_names_the_flag(tmp_path, capsys):
    profile = os.path.join(ROOT, "examples", "profiles", "h200_2026-11-29.profile.json")
    assert plan_cli.main(["--config", LLAVA, "--gpus", "8", "--gpu", "a100", "--profile", profile]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --gpu: not with --profile (the profile names the device and its rates)"
    missing = str(tmp_path / "none.json")
    assert plan_cli.main(["--config", LLAVA, "--gpus", "8", "--samples", missing]) == 2
    assert capsys.readouterr().err.strip() == f"error: --samples: {missing}: cannot read (No such file or directory)"
