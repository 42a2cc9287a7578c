"""The step's FLOP counts from per-rank shares: each LLM DP replica's reporting rank counts its own
microbatches on the host (`flops.rank_work`), `metrics.reduce_step` adds the shares up inside its one
MAX all-reduce. Oracle: `flops.step_work` over the whole global batch at once (what rank 0 computed
every step before)."""

import copy

import pytest
import torch

from mimo.balance.step import StepBalancer
from mimo.config import LANGUAGE, build_config
from mimo.data import PAD_ID, Sample, build_dataset, collate
from mimo.model import attention_mask
from mimo.topology import Layout
from mimo.training.flops import count_later, microbatch_work, rank_work, reports_work, step_work
from mimo.training.metrics import pack_work, unpack_work, work_slots

from tiny import TINY


def cfg_of(raw):
    cfg, problems = build_config(copy.deepcopy(raw))
    assert not problems, problems
    return cfg


def heterogeneous(balance="entrain"):
    """LLM TP2 x DP2 x PP2 (ranks 0-7) with bitfield attention, images DP2 and audio on ranks of their
    own; `entrain` reorders the step's samples over the LLM replicas and microbatches (data-aware
    microbatching), `none` keeps them contiguous."""
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["parallelism"] = {"language": dict(tp=2, dp=2, pp=2), "images": dict(dp=2, rank_offset=8),
                          "audio": dict(rank_offset=10)}
    raw["data"]["balance"] = balance
    raw["training"].update(global_batch_size=8, micro_batch_size=2)
    return cfg_of(raw)


def world_of(cfg):
    return max(Layout.from_config(p).ranks.stop for p in cfg.parallelism.values())


def simulated_ranks(cfg, samples, duplicate=None, slot_of=None):
    """Every world rank's packed work slots, each rank holding what `step_data` gives it: the LLM
    microbatches of its DP replica (as the balancer assigns them), each with `count_later`'s call, as
    `llm_microbatch` makes it from the host batch and mask. `duplicate`: a world rank that lists its
    microbatches twice; `slot_of`: replaces a reporter's DP rank (its slot)."""
    lay = Layout.from_config(cfg.parallelism[LANGUAGE])
    assignment = StepBalancer(cfg).assignment(samples, PAD_ID)
    rows, counted = [], {}
    for r in range(world_of(cfg)):
        coords = lay.coords(r) if lay.contains(r) else None
        batches = []
        if coords is not None:
            for idx in assignment.llm[coords["dp"]]:
                host = collate([samples[i] for i in idx], cfg.placeholder_ids, False)
                mask = attention_mask(cfg, host["input_ids"], host.get("document_ids"))
                batches.append({"work": count_later(cfg, host, mask)})
            if r == duplicate:
                batches = batches + batches
        share = rank_work(cfg, coords, batches)
        if share is not None:
            counted[r] = share.work.samples
            if slot_of is not None and r in slot_of:
                share.dp_rank = slot_of[r]
        rows.append(pack_work(cfg, share))
    return rows, counted


def all_reduce_max(rows):
    return [max(col) for col in zip(*rows)]


@pytest.mark.parametrize("balance", ["entrain", "none"])
def test_sum_of_rank_shares_equals_the_whole_batch(balance):
    cfg = heterogeneous(balance)
    ds = build_dataset(cfg)
    G = cfg.training.global_batch_size
    for step in range(2):
        samples = [ds.sample(step * G + i) for i in range(G)]
        oracle = step_work(cfg, samples)
        rows, counted = simulated_ranks(cfg, samples)
        assert len(rows[0]) == work_slots(cfg) == 2 * (4 + 2)
        got = unpack_work(cfg, all_reduce_max(rows))
        assert got == oracle, (got, oracle)
        assert oracle.items["images"] > 0 and oracle.llm_attention_pairs < G * 48 * 49 // 2  # bitfield: fewer
        # One reporter per LLM DP replica (first stage, TP rank 0), each counting only its replica's samples.
        assert sorted(counted) == [0, 2] and sum(counted.values()) == G
        assert all(0 < n < G for n in counted.values())


def test_a_rank_counted_twice_or_in_anothers_slot_is_caught():
    cfg = heterogeneous()
    ds = build_dataset(cfg)
    samples = [ds.sample(i) for i in range(cfg.training.global_batch_size)]
    rows, _ = simulated_ranks(cfg, samples, duplicate=2)  # rank 2 (LLM DP rank 1) lists its microbatches twice
    with pytest.raises(RuntimeError, match="counted twice or not at all"):
        unpack_work(cfg, all_reduce_max(rows))
    rows, _ = simulated_ranks(cfg, samples, slot_of={2: 0})  # both replicas write DP rank 0's slots
    with pytest.raises(RuntimeError, match="counted twice or not at all"):
        unpack_work(cfg, all_reduce_max(rows))
    # No reporter at all (a caller that passes no shares): no work, not an error.
    assert unpack_work(cfg, all_reduce_max([pack_work(cfg, None)] * 3)) is None


def test_only_reporting_ranks_count():
    # The reporting rule; and a non-reporting rank never calls its microbatches' counters.
    assert reports_work(dict(tp=0, cp=0, pp=0, dp=1, ep=0))
    for other in (dict(tp=1), dict(cp=1), dict(pp=1)):
        assert not reports_work({**dict(tp=0, cp=0, pp=0, dp=0, ep=0), **other})
    assert not reports_work(None)

    def never():
        raise AssertionError("counted on a rank that does not report")

    cfg = heterogeneous()
    assert rank_work(cfg, dict(tp=1, cp=0, pp=0, dp=0, ep=0), [{"work": never}]) is None


def test_packed_documents_split_into_microbatches_add_up():
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    cfg = cfg_of(raw)
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(4):
        ids = torch.randint(1, 100, (10,), generator=g)
        docs = torch.tensor([0] * (3 + k) + [1] * (5 - k) + [-1, -1])
        samples.append(Sample(ids, {"images": torch.zeros(k % 2, 3, 8, 8), "audio": torch.zeros(0)},
                              document_ids=docs))
    oracle = step_work(cfg, samples)
    parts = []
    for idx in ([0, 1], [2], [3]):
        ids = torch.stack([samples[i].input_ids for i in idx])
        docs = torch.stack([samples[i].document_ids for i in idx])
        counts = {"images": torch.tensor([samples[i].count("images") for i in idx])}
        parts.append(microbatch_work(cfg, ids, docs, counts))
    total = parts[0] + parts[1] + parts[2]
    assert total == oracle
    assert oracle.tokens == 32 and oracle.items == {"images": 2, "audio": 0}


def _reduce_on_rank(raw):
    """One gloo rank: its share of the step (as the trainer passes it) through `reduce_step`'s all-reduce."""
    import torch.distributed as dist

    from mimo.runtime import StepTimer, select_runtime
    from mimo.training.metrics import reduce_step

    cfg = cfg_of(raw)
    runtime = select_runtime("cpu")
    rank = dist.get_rank()
    ds = build_dataset(cfg)
    samples = [ds.sample(i) for i in range(cfg.training.global_batch_size)]
    lay = Layout.from_config(cfg.parallelism[LANGUAGE])
    coords = lay.coords(rank) if lay.contains(rank) else None
    batches = []
    if coords is not None:
        for idx in StepBalancer(cfg).assignment(samples, PAD_ID).llm[coords["dp"]]:
            host = collate([samples[i] for i in idx], cfg.placeholder_ids, False)
            batches.append({"work": count_later(cfg, host, attention_mask(cfg, host["input_ids"]))})
    timer = StepTimer(runtime)
    timer.add(LANGUAGE, "F", 0, timer.now(), timer.now())
    times = reduce_step(timer, cfg, runtime, skipped_samples=rank, work=rank_work(cfg, coords, batches))
    return times.work, times.skipped_samples, step_work(cfg, samples)


def test_reduce_step_sums_the_shares_in_its_one_all_reduce():
    from mimo.runtime import run_on_ranks

    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["parallelism"] = {"language": dict(dp=2), "images": dict(rank_offset=2), "audio": dict(rank_offset=2)}
    results = run_on_ranks(_reduce_on_rank, 3, raw)
    for work, skipped, oracle in results:
        assert work == oracle
        assert skipped == 2  # the times part still takes the max over ranks


def _trainer_passes_shares() -> bool:
    """Whether the trainer hands `reduce_step` its rank's share (the step_data / trainer side of this)."""
    import inspect

    from mimo.training.trainer import Trainer

    return "rank_work" in inspect.getsource(Trainer.train_step)


def _train_one_step(raw):
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    res = trainer.train_step(0)
    ds = build_dataset(cfg)
    return res.times.work, step_work(cfg, [ds.sample(i) for i in range(cfg.training.global_batch_size)])


@pytest.mark.skipif(not _trainer_passes_shares(), reason="the trainer does not pass reduce_step its share yet")
def test_the_trainer_reports_the_whole_batch_work():
    """End to end: every rank's StepTimes.work after a real step equals the whole-batch oracle (LLM DP2
    on ranks 0-1, both encoders on rank 2, bitfield attention, data-aware microbatching)."""
    from mimo.runtime import run_on_ranks

    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["parallelism"] = {"language": dict(dp=2), "images": dict(rank_offset=2), "audio": dict(rank_offset=2)}
    raw["data"]["balance"] = "entrain"
    for work, oracle in run_on_ranks(_train_one_step, 3, raw, timeout_s=300):
        assert work == oracle
