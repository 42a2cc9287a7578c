"""Encoder data parallelism over items (images, clips), not samples: division, validation, FP32 parity."""

import copy
import subprocess
import sys
from itertools import accumulate

import pytest
import yaml

from mimo.config import load_config
from mimo.data import MockMultimodalDataset
from mimo.data.items import divide_items, imbalance, sample_item_bounds
from mimo.runtime import run_on_ranks
from test_heterogeneous_parity import _check, _merge, _train, deeper, layout
from test_training_parity import assert_same_run

STEPS = 2


# -- the division ------------------------------------------------------------------------------


def test_divide_items_is_contiguous_and_balanced():
    assert divide_items([4] * 10, 4) == [0, 2, 5, 7, 10]
    assert divide_items([4] * 3, 8) == [0, 0, 1, 1, 1, 2, 2, 3, 3]  # more ranks than items: some get none
    assert divide_items([], 3) == [0, 0, 0, 0]
    assert divide_items([1, 9, 1, 1, 1, 1], 2) == [0, 2, 6]  # by tokens, not by count
    # The sample-level division is the special case of uniform samples: 8 samples x 2 items over 4 ranks.
    assert divide_items([4] * 16, 4) == sample_item_bounds([2] * 8, [0, 2, 4, 6, 8])
    for n in range(0, 40):
        for parts in (1, 2, 3, 7, 32):
            b = divide_items([16] * n, parts)
            sizes = [y - x for x, y in zip(b, b[1:])]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert imbalance([0, 2, 4], [1] * 4) == 1.0 and imbalance([0, 3, 4], [1] * 4) == 1.5
    with pytest.raises(ValueError, match="parts"):
        divide_items([1], 0)


def test_each_bound_is_the_closest_item_edge_lowest_on_a_tie():
    """Against a brute force over every edge, with zero-token items (runs of equal prefixes) and
    zero totals among random inputs."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.choice([0, 0, 1, 3, 9, 40]) for _ in range(rng.randint(0, 12))]
        parts = rng.randint(1, 9)
        prefix = [0] + list(accumulate(tokens))
        total, n = prefix[-1], len(tokens)
        if total == 0:
            want = [(i * n) // parts for i in range(parts)] + [n]
        else:
            want = [min(range(n + 1), key=lambda k: (abs(parts * prefix[k] - i * total), k))
                    for i in range(parts)] + [n]
        assert divide_items(tokens, parts) == want, (tokens, parts)


# -- validation: the paper's long-context colocated layouts (Table A3, C-E / C-L as printed) -------

# (seq_length, gpus, global batch, microbatches, encoder tp/cp/pp/dp, LLM tp/cp/pp/dp)
TABLE_A3 = [
    (16384, 16, 8, 2, (1, 1, 1, 16), (2, 2, 1, 4)), (16384, 16, 8, 2, (1, 1, 1, 16), (2, 2, 1, 4)),
    (32768, 16, 4, 2, (1, 1, 1, 16), (2, 4, 1, 2)), (32768, 16, 4, 2, (1, 1, 1, 16), (2, 4, 1, 2)),
    (65536, 32, 4, 2, (1, 1, 1, 32), (2, 8, 1, 2)), (65536, 32, 4, 2, (1, 1, 1, 32), (2, 8, 1, 2)),
    (131072, 64, 4, 2, (1, 1, 1, 64), (2, 16, 1, 2)), (131072, 64, 4, 2, (1, 1, 1, 64), (2, 16, 1, 2)),
    (16384, 16, 4, 1, (2, 1, 1, 8), (4, 1, 1, 4)), (16384, 16, 4, 1, (2, 1, 1, 8), (4, 1, 1, 4)),
    (32768, 32, 4, 1, (2, 1, 1, 16), (4, 2, 1, 4)), (32768, 32, 4, 1, (2, 1, 1, 16), (4, 2, 1, 4)),
    (65536, 32, 4, 2, (2, 1, 1, 16), (4, 4, 1, 2)), (65536, 32, 4, 2, (2, 1, 1, 16), (4, 4, 1, 2)),
    (131072, 64, 4, 2, (2, 1, 1, 32), (4, 8, 1, 2)), (131072, 64, 4, 2, (2, 1, 1, 32), (4, 8, 1, 2)),
]


def a3_config(row):
    """A tiny model with the row's parallelism degrees, sequence length and batch sizes."""
    seq, gpus, gbs, nmb, enc, llm = row
    as_dict = lambda t: dict(zip(("tp", "cp", "pp", "dp"), t))  # noqa: E731
    micro = gbs // (nmb * llm[3])
    return {
        "model": {
            "language": dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256,
                             max_sequence_length=seq, attention="bitfield"),
            "encoders": {"images": dict(kind="vision", num_layers=1, hidden_size=32, num_attention_heads=4,
                                        image_size=32, patch_size=8, projector={"kind": "mlp"})},
        },
        "parallelism": {"language": as_dict(llm), "images": as_dict(enc)},
        "data": {"kind": "mock", "seq_length": seq},
        "training": {"global_batch_size": gbs, "micro_batch_size": micro},
    }, gpus


@pytest.mark.parametrize("row", range(len(TABLE_A3)))
def test_table_a3_layouts_pass_the_config_check(row, tmp_path):
    raw, gpus = a3_config(TABLE_A3[row])
    assert raw["parallelism"]["images"]["dp"] > raw["training"]["global_batch_size"]  # more encoder ranks than samples
    path = tmp_path / "a3.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path), "--world-size", str(gpus)],
                         capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "ok", "")


def test_the_llm_batch_rule_stays(tmp_path):
    raw, gpus = a3_config(TABLE_A3[4])
    raw["training"]["global_batch_size"] = 5  # not a multiple of micro_batch_size * language dp
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(path), "--world-size", str(gpus)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: training.global_batch_size:")


# -- FP32 parity --------------------------------------------------------------------------------


def small(raw, gbs=4, micro=1):
    raw["training"]["global_batch_size"], raw["training"]["micro_batch_size"] = gbs, micro
    return raw


def frozen_images(raw):
    raw["model"]["encoders"]["images"]["frozen"] = True  # the projector still trains: gradients route back
    return raw


def ranks_without_items(raw, name, windows):
    """Encoder ranks that get no item in some window of step 0 (windows: lists of sample indices)."""
    cfg = load_config(raw)
    data = MockMultimodalDataset(cfg)
    dp = cfg.parallelism[name].dp
    idle = set()
    for w in windows:
        counts = [data.sample(s).items[name].shape[0] for s in w]
        b = divide_items([1] * sum(counts), dp)
        idle |= {i for i in range(dp) if b[i] == b[i + 1]}
    return idle


@pytest.fixture(scope="module")
def deeper_small_reference():
    return run_on_ranks(_train, 1, small(deeper()), STEPS)[0]


@pytest.fixture(scope="module")
def small_reference():
    return run_on_ranks(_train, 1, small(layout()), STEPS)[0]


def colocated_case():
    # 6 shared ranks: LLM pp3 x dp2; images dp6 for a step of 4 samples; audio tp2 x dp3 (3 vs 2).
    return small(deeper(language=dict(pp=3, dp=2), images=dict(dp=6), audio=dict(tp=2, dp=3)))


def noncolocated_case():
    # LLM dp2 on ranks 0-1 (microbatch of 2 samples); images dp3 and audio dp3 share ranks 2-4.
    return small(layout(language=dict(dp=2), images=dict(dp=3, rank_offset=2), audio=dict(dp=3, rank_offset=2)))


def test_colocated_encoder_dp_over_items(deeper_small_reference):
    raw = colocated_case()
    assert ranks_without_items(raw, "images", [range(4)])  # some encoder rank has nothing to encode
    _check(deeper_small_reference, raw, 6)


def test_noncolocated_encoder_dp_over_items(small_reference):
    raw = noncolocated_case()
    assert ranks_without_items(raw, "images", [range(0, 2), range(2, 4)])
    _check(small_reference, raw, 5)


@pytest.mark.slow
def test_parity_catches_two_items_swapped_on_their_way_to_the_llm(small_reference):
    got = _merge(run_on_ranks(_train_swapped, 5, noncolocated_case(), 1, timeout_s=240))
    with pytest.raises(AssertionError):
        assert_same_run(dict(small_reference, losses=small_reference["losses"][:1], params={}), got)


def _train_swapped(raw, steps):
    """Deliberately wrong routing: the first and the last image of every window trade destinations."""
    from mimo.config import load_config as load
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.parity import record_run

    from mimo.training.windows import StepWindows

    window = StepWindows.window

    def swapped(self, name, mb=0, part="kept"):
        plan, ids = window(self, name, mb, part)
        ids = list(ids)
        if name == "images" and len(ids) > 1:
            ids[0], ids[-1] = ids[-1], ids[0]
        return plan, ids

    StepWindows.window = swapped  # this rank process only
    return record_run(Trainer(load(raw), select_runtime("cpu")), steps)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["colocated_frozen", "colocated_tp_fan", "noncolocated_frozen",
                                  "noncolocated_pipelined", "noncolocated_4_vs_2_tp"])
def test_more_item_layouts(case, deeper_small_reference, small_reference):
    if case == "colocated_frozen":  # frozen image encoder (trainable projector), audio frozen entirely
        raw = frozen_images(colocated_case())
        raw["model"]["encoders"]["audio"].update(frozen=True)
        raw["model"]["encoders"]["audio"]["projector"]["frozen"] = True
        ref_raw = copy.deepcopy(raw)
        ref_raw["parallelism"] = {m: {} for m in ("language", "images", "audio")}
        return _check(run_on_ranks(_train, 1, ref_raw, STEPS)[0], raw, 6)
    if case == "colocated_tp_fan":  # LLM tp2 x dp2; images dp4 and audio dp4 for a step of 2 samples
        raw = small(layout(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(dp=4)), gbs=2)
        ref = run_on_ranks(_train, 1, small(layout(), gbs=2), STEPS)[0]
        return _check(ref, raw, 4)
    if case == "noncolocated_frozen":
        raw = frozen_images(noncolocated_case())
        ref_raw = frozen_images(small(layout()))
        return _check(run_on_ranks(_train, 1, ref_raw, STEPS)[0], raw, 5)
    if case == "noncolocated_pipelined":  # images pp2 x dp3 on ranks 2-7 feeding LLM pp2 (dp1, microbatch 1)
        raw = small(deeper(language=dict(pp=2), images=dict(pp=2, dp=3, rank_offset=2), audio=dict(pp=2)))
        return _check(deeper_small_reference, raw, 8)
    # images dp4 and audio dp4 on ranks 4-7, away from LLM tp2 x dp2 (4 ranks for 2 samples per microbatch)
    raw = small(layout(language=dict(tp=2, dp=2), images=dict(dp=4, rank_offset=4), audio=dict(dp=4, rank_offset=4)))
    _check(small_reference, raw, 8)
