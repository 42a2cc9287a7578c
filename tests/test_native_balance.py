"""Native-resolution images in the cost models: data.balance (per-item cost from each image's grid),
the FLOP count (gated MLPs), the planner (a Qwen2.5-VL-shaped config), and FP32 parity of balanced
native runs (LLaVA records of five image sizes, very different lengths) against the 1-rank run."""

import json
import os
import random
import sys

import pytest
import yaml

from mimo.config import ConfigError, load_config
from mimo.runtime import run_on_ranks
from mimo.training.parity import merge_ranks
from test_heterogeneous_parity import _train
from test_native_items import _sample, native
from test_training_parity import assert_same_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_sample_data  # noqa: E402
import plan  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "configs", "qwen2_5_vl_7b_8gpu.yaml")
STEPS = 2


def example():
    with open(EXAMPLE) as f:
        return yaml.safe_load(f)


# -- FLOPs: gated MLPs ----------------------------------------------------------------------------


def test_gated_mlps_count_three_matrices_in_the_llm_and_the_vit():
    from mimo.training.flops import module_flops, step_work

    raw = native()
    raw["training"].update(global_batch_size=2, micro_batch_size=2)
    cfg = load_config(raw)
    work = step_work(cfg, _step(cfg, [[(1, 6, 6), (1, 2, 4)], [(1, 4, 4)]]))
    lang, vit = cfg.model.language, cfg.model.encoders["images"]
    assert vit.activation == "swiglu" and lang.activation == "gelu"
    gated = module_flops(cfg, work)
    vit.activation, lang.activation = "gelu", "swiglu"
    swapped = module_flops(cfg, work)
    # The third matrix: 2 * positions * hidden * ffn per layer, forward.
    llm_extra = lang.num_layers * 2 * work.positions * lang.hidden_size * lang.ffn_hidden_size
    vit_extra = vit.num_layers * 2 * work.encoder_patches["images"] * vit.hidden_size * vit.ffn_hidden_size
    assert swapped["language"].forward - gated["language"].forward == llm_extra
    assert gated["images"].forward - swapped["images"].forward == vit_extra


# -- the planner ----------------------------------------------------------------------------------


def test_planner_costs_the_qwen_vit_with_the_flop_count_of_its_reference_image():
    from mimo.data.native_images import native_grid
    from mimo.planner.cost_model import CostModel, Workload
    from mimo.planner.hardware import get_gpu
    from mimo.planner.spec import read_model
    from mimo.training.flops import native_attention_pairs, native_encoder_flops

    raw = example()
    cfg = load_config(EXAMPLE)
    enc = cfg.model.encoders["images"]
    vit = read_model(raw["model"]).module("images")
    grid = vit.native.reference_grid()
    assert grid == native_grid(5000, 5000, enc) == (1, 70, 70)   # what the processor makes of a big square
    assert vit.tokens_per_item == 4900 and vit.llm_tokens_per_item == 1225
    works = CostModel(get_gpu("h100")).module_work(vit, 1, 1, 1.0, Workload(4096, {"images": 1.0}), 3584)
    planner_fwd = sum(w.fwd_flops for w in works)
    ours = native_encoder_flops(cfg, enc, 4900, native_attention_pairs(enc, grid))
    assert planner_fwd == pytest.approx(ours.forward, rel=1e-12)
    # Negative control: the MLP counted with two matrices (ungated) misses the third.
    ungated = read_model({**raw["model"], "encoders": {"images": {**raw["model"]["encoders"]["images"],
                                                                  "activation": "gelu"}}}).module("images")
    less = sum(w.fwd_flops for w in CostModel(get_gpu("h100")).module_work(
        ungated, 1, 1, 1.0, Workload(4096, {"images": 1.0}), 3584))
    assert less < ours.forward * 0.95


def test_plan_tool_searches_and_evaluates_a_qwen_vl_config(tmp_path, capsys):
    raw = example()
    del raw["parallelism"]
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert plan.main(["--config", str(path), "--gpus", "8", "--json", "--out", str(tmp_path / "best.yaml")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"]
    load_config(str(tmp_path / "best.yaml"))   # the planned config is a valid config
    assert plan.main(["--config", EXAMPLE, "--evaluate"]) == 0
    assert "step" in capsys.readouterr().out
    # training.replan: auto's search for fewer ranks (4 of the 8) finds a layout the check accepts.
    from mimo.checkpoint.replan import search, with_layout

    par, micro = search(example(), load_config(EXAMPLE), 4, "h100")
    load_config(with_layout(example(), par, micro), world_size=4)


# -- data.balance: per-item cost ------------------------------------------------------------------


def test_a_native_image_costs_by_its_size_and_attention_grows_quadratically():
    from mimo.balance.workload import WorkloadModel

    cfg = load_config(EXAMPLE)
    work = WorkloadModel.from_model(cfg.model)
    per_patch, per_pair = work.native["images"]
    assert per_patch.total > 0 and per_pair.total > 0
    sizes = [(1, 16, 16), (1, 32, 32), (1, 64, 64), (1, 96, 96)]
    costs = [work.item_cost("images", g) for g in sizes]
    assert costs == sorted(costs) and len(set(costs)) == 4
    # Windows keep most layers linear in the image; the full-attention layers grow with patches^2.
    per = [c / (g[1] * g[2]) for c, g in zip(costs, sizes)]
    assert per == sorted(per) and per[-1] > 1.05 * per[0]
    # A sample costs the sum of its images.
    assert work.encoder_grids({"images": [[(1, 16, 16), (1, 32, 32)], []]}).tolist() == [costs[0] + costs[1], 0.0]


def test_the_per_grid_cost_cache_is_bounded(monkeypatch):
    """Video frame counts make grids unbounded: the cache is emptied at its cap, costs unchanged."""
    from mimo.balance import workload

    work = workload.WorkloadModel.from_model(load_config(EXAMPLE).model)
    monkeypatch.setattr(workload, "_ITEM_COST_ENTRIES", 3)
    grids = [(t, 16, 16) for t in range(1, 9)]
    got = work.encoder_grids({"images": [[g] for g in grids]}).tolist()
    assert got == [work.item_cost("images", g) for g in grids]
    assert 0 < len(work._item_costs) <= 3


def _step(cfg, grids_per_sample):
    """Samples of one LLM length (text padding evens out the image tokens), images as given."""
    import torch

    out = []
    for grids in grids_per_sample:
        s = _sample(grids)
        s.input_ids = torch.cat([s.input_ids, torch.full((40 - len(s.input_ids),), 9)])
        out.append(s)
    return out


def test_balance_assignment_follows_image_sizes_and_a_swapped_pair_changes_it():
    from mimo.balance.step import StepBalancer
    from mimo.data import PAD_ID

    raw = native(language=dict(dp=2), images=dict(dp=2))
    raw["data"]["balance"] = "mmscale"
    raw["model"]["encoders"]["images"]["max_pixels"] = 576
    cfg = load_config(raw)
    balancer = StepBalancer(cfg)
    big, small = (1, 12, 12), (1, 2, 2)
    grids = [[big], [small], [small], [small], [big], [small], [small], [small]]
    a = balancer.assignment(_step(cfg, grids), PAD_ID)
    # The two big images land on different DP ranks.
    holds = [{i for mb in rank for i in mb} for rank in a.encoder]
    assert all(len(h & {0, 4}) == 1 for h in holds), a.encoder
    # Negative control: the same step with samples 1 and 4 holding each other's image.
    swapped = [[big], [big], [small], [small], [small], [small], [small], [small]]
    b = balancer.assignment(_step(cfg, swapped), PAD_ID)
    assert b.encoder != a.encoder
    holds = [{i for mb in rank for i in mb} for rank in b.encoder]
    assert all(len(h & {0, 1}) == 1 for h in holds), b.encoder


def test_balance_with_native_encoders_is_accepted_with_and_without_a_pipelined_vit():
    for policy in ("mmscale", "entrain"):
        for images in (dict(rank_offset=2), dict(pp=2, rank_offset=2)):
            raw = native(language=dict(pp=2), images=images)
            raw["data"]["balance"] = policy
            load_config(raw)


# -- FP32 parity ----------------------------------------------------------------------------------

WORDS = "a the on of in is what picture shape colour background two same yes no".split()


def skewed_records(seed=8, n=32):
    """1-2 images of five sizes per record (so every sample has encoder work and entrain cannot even
    out the LLM with text-only samples), 1-24 words: microbatches of very different work."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = rng.choice([1, 1, 2])
        words = rng.choice([1, 2, 3, 40 - 16 * images])
        rec = {"id": f"r{i}", "conversations": [
            {"from": "human", "value": "<image>\n" * images + " ".join(rng.choice(WORDS) for _ in range(words))},
            {"from": "gpt", "value": "yes ."}]}
        if images:
            rec["image"] = [f"images/img{rng.randrange(5):04d}.png" for _ in range(images)]
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("native_skewed"))
    assert make_sample_data.main([out, "--records", "5", "--qwen-vl"]) == 0
    with open(os.path.join(out, "skewed.json"), "w") as f:
        json.dump(skewed_records(), f)
    return out


def config(data_dir, policy, parallelism=None):
    raw = native()
    raw["model"]["language"].update(vocab_size=128, max_sequence_length=128, attention="bitfield")
    # 8-pixel merge blocks (make_sample_data's five sizes: 4 to 25 LLM tokens), 16-pixel windows.
    raw["model"]["encoders"]["images"].update(placeholder_id=120, patch_size=4, window_size=16, min_pixels=64,
                                              max_pixels=1600)
    raw["data"] = {"kind": "llava", "path": os.path.join(data_dir, "skewed.json"), "image_root": data_dir,
                   "tokenizer": os.path.join(data_dir, "tokenizer"), "seq_length": 96, "packing": False,
                   "shuffle": False, "balance": policy}
    raw["training"].update(global_batch_size=16, micro_batch_size=4)
    raw["parallelism"] = parallelism or {"language": {}, "images": {}}
    return raw


# LLM pp2 on ranks 0-1, the ViT not colocated, DP 2 over items on ranks 2-3.
NONCOLOCATED = ({"language": {"pp": 2}, "images": {"dp": 2, "rank_offset": 2}}, 4)


def assignments(raw):
    from mimo.balance.step import StepBalancer
    from mimo.data import PAD_ID, build_dataset

    cfg = load_config(raw)
    data, G = build_dataset(cfg), cfg.training.global_batch_size
    balancer = StepBalancer(cfg)
    return [(balancer.assignment([data.sample(s * G + i) for i in range(G)], PAD_ID),
             [data.sample(s * G + i).count("images") for i in range(G)]) for s in range(STEPS)]


@pytest.fixture(scope="module")
def reference(data_dir):
    return run_on_ranks(_train, 1, config(data_dir, "none"), STEPS)[0]


def test_the_data_makes_mmscale_reorder_and_entrain_defer_native_images(data_dir):
    """Without this the parity below would not exercise the balancers."""
    for a, _ in assignments(config(data_dir, "mmscale", NONCOLOCATED[0])):
        assert [i for k in range(a.microbatches) for i in a.llm[0][k]] != list(range(16))
    for a, images in assignments(config(data_dir, "entrain", NONCOLOCATED[0])):
        moved = [s for k in range(1, a.microbatches) for s in a.llm[0][k] if s not in a.encoder[0][k]]
        assert moved and any(images[s] for s in moved), (a.encoder, a.llm)


# The LLM on rank 0, the ViT in two pipeline stages on ranks 1-2: entrain's deferred images travel
# between the ViT stages behind the kept ones, as a second packed sequence.
VIT_PIPELINED = ({"language": {}, "images": {"pp": 2, "rank_offset": 1}}, 3)


@pytest.mark.parametrize("policy,layout", [("mmscale", NONCOLOCATED), ("entrain", NONCOLOCATED),
                                           ("entrain", VIT_PIPELINED)],
                         ids=["mmscale", "entrain", "entrain_vit_pp2"])
def test_balanced_native_layout_equals_single_rank(data_dir, reference, policy, layout):
    parallelism, world = layout
    if layout is VIT_PIPELINED:  # without deferred images this case would not test the packed join
        assert any(s not in a.encoder[0][k] for a, _ in assignments(config(data_dir, policy, parallelism))
                   for k in range(1, a.microbatches) for s in a.llm[0][k])
    got = merge_ranks(run_on_ranks(_train, world, config(data_dir, policy, parallelism), STEPS, timeout_s=240))
    assert set(got["params"]) == set(reference["params"])
    assert_same_run(reference, got)
