"""Embedding assembly, the mock dataset's determinism, and DP sharding."""

import pytest
import torch

from mimo.config import load_config
from mimo.data import PAD_ID, MockMultimodalDataset, collate, shard_indices
from mimo.model import assemble_embeddings
from tiny import tiny


def test_assembly_places_tokens_row_major_and_routes_gradients():
    torch.manual_seed(0)
    b, s, h, img = 3, 10, 4, 9
    ids = torch.randint(1, 8, (b, s))
    ids[0, 2:4] = img            # sample 0: one 2-token item
    ids[2, 0:2] = img            # sample 2: two items, sample 1: none
    ids[2, 6:8] = img
    text = torch.randn(b, s, h, requires_grad=True)
    tokens = torch.randn(6, h, requires_grad=True)
    out = assemble_embeddings(text, ids, {img: tokens})
    # Oracle: explicit loop over placeholders in row-major order.
    expect = text.detach().clone()
    k = 0
    for i in range(b):
        for j in range(s):
            if ids[i, j] == img:
                expect[i, j] = tokens[k].detach()
                k += 1
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    w = torch.randn(b, s, h)
    (out * w).sum().backward()
    where = (ids == img).unsqueeze(-1)
    torch.testing.assert_close(text.grad, torch.where(where, 0.0, w))
    torch.testing.assert_close(tokens.grad, w[ids == img])


def test_assembly_rejects_count_mismatch_and_accepts_no_items():
    ids = torch.tensor([[1, 5, 5, 2]])
    text = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="2 placeholder tokens"):
        assemble_embeddings(text, ids, {5: torch.zeros(3, 3)})
    out = assemble_embeddings(text, torch.tensor([[1, 2, 3, 4]]), {5: torch.zeros(0, 3)})
    assert torch.equal(out, text)


def test_samples_are_deterministic_and_well_formed():
    cfg = load_config(tiny())
    ds, again = MockMultimodalDataset(cfg), MockMultimodalDataset(cfg)
    counts = {"images": set(), "audio": set()}
    for i in range(40):
        a, b = ds.sample(i), again.sample(i)
        assert torch.equal(a.input_ids, b.input_ids)
        assert a.input_ids.shape == (cfg.data.seq_length,)
        for name, enc in cfg.model.encoders.items():
            assert torch.equal(a.items[name], b.items[name])
            n = a.items[name].shape[0]
            counts[name].add(n)
            # Each item has a contiguous run of tokens_per_item placeholders.
            assert int((a.input_ids == cfg.placeholder_ids[name]).sum()) == n * enc.tokens_per_item
    # 0..k items per sample actually occur, zero included.
    assert counts["images"] == {0, 1, 2} and counts["audio"] == {0, 1}
    assert not torch.equal(ds.sample(0).input_ids, ds.sample(1).input_ids)
    other_seed = tiny()
    other_seed["data"]["seed"] = 4
    assert not torch.equal(MockMultimodalDataset(load_config(other_seed)).sample(0).input_ids, ds.sample(0).input_ids)


def test_collate_labels_and_loss_mask():
    cfg = load_config(tiny())
    ds = MockMultimodalDataset(cfg)
    samples = [ds.sample(i) for i in range(4)]
    batch = collate(samples, cfg.placeholder_ids)
    ids = batch["input_ids"]
    assert torch.equal(batch["labels"][:, :-1], ids[:, 1:])
    special = set(cfg.placeholder_ids.values()) | {PAD_ID}
    for i in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            assert bool(batch["loss_mask"][i, t]) == (int(batch["labels"][i, t]) not in special)
    for name in cfg.model.encoders:
        assert batch[name].shape[0] == sum(s.items[name].shape[0] for s in samples)


@pytest.mark.parametrize("g,m,dp", [(8, 2, 2), (8, 1, 4), (12, 3, 1), (16, 2, 4)])
def test_dp_shards_partition_the_global_batch(g, m, dp):
    shards = [shard_indices(g, m, r, dp) for r in range(dp)]
    flat = sorted(i for sh in shards for mb in sh for i in mb)
    assert flat == list(range(g))
    for r, sh in enumerate(shards):
        assert len(sh) == g // (m * dp) and all(len(mb) == m for mb in sh)
        # microbatch k of every shard comes from window k, shard r holds its r-th slice
        for k, mb in enumerate(sh):
            assert mb == list(range(k * m * dp + r * m, k * m * dp + (r + 1) * m))
    with pytest.raises(ValueError):
        shard_indices(g + 1, m, 0, dp)


def test_an_items_inputs_are_made_only_when_asked_for_and_alike_alone():
    """Planning a sample makes none of its items' inputs; item k is the same made alone or with the rest."""
    from mimo.data.mock import MockMultimodalDataset as Mock

    cfg = load_config(tiny())
    made = []
    ds = Mock(cfg)
    inputs = ds._item_inputs
    ds._item_inputs = lambda *a, **k: made.append(a[:2]) or inputs(*a, **k)
    samples = [ds.sample(i) for i in range(16)]
    assert sum(s.count(n) for s in samples for n in cfg.model.encoders) > 4 and made == []
    for s in samples:
        for n in cfg.model.encoders:
            for k in range(s.count(n)):
                alone = s.item(n, k)
                assert torch.equal(alone, s.items[n][k])
    assert len(made) == 2 * len(set(made))  # each item made twice: by item(), then by items[] (all of them)


def _items_made(raw):
    """How many item inputs this rank made over a short mock run."""
    from mimo.data import mock
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    made = []
    inputs = mock.MockMultimodalDataset._item_inputs
    mock.MockMultimodalDataset._item_inputs = lambda self, *a, **k: made.append(a[:2]) or inputs(self, *a, **k)
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    for step in range(raw["training"]["train_iters"]):
        trainer.train_step(step)
    return made


def test_each_mock_item_is_made_once_by_the_rank_that_encodes_it():
    """Non-colocated: the LLM rank makes no pixels, each encoder rank only its own items, each once."""
    from mimo.runtime import run_on_ranks

    raw = tiny()
    raw["parallelism"] = {"language": {}, "images": {"rank_offset": 1}, "audio": {"rank_offset": 2}}
    raw["training"].update(train_iters=2)
    cfg = load_config(raw)
    made = run_on_ranks(_items_made, 3, raw, timeout_s=240)
    ds = MockMultimodalDataset(cfg)
    G = cfg.training.global_batch_size
    total = {n: sum(ds.sample(i).count(n) for i in range(2 * G)) for n in ("images", "audio")}
    assert made[0] == []
    assert len(made[1]) == total["images"] and {n for n, _ in made[1]} <= {"images"}, (len(made[1]), total)
    assert len(made[2]) == total["audio"] and {n for n, _ in made[2]} <= {"audio"}, (len(made[2]), total)
    assert len(set(made[1])) == len(made[1]) and len(set(made[2])) == len(made[2])  # each item once


def test_assembly_equals_masked_scatter_forward_and_backward_bit_for_bit():
    """The static-shape gather gives masked_scatter's result and gradients exactly (the reference here),
    on the [s, b, h] -> [b, s, h] view the LLM hands it, with two modalities."""
    g = torch.Generator().manual_seed(0)
    b, s, h = 3, 17, 8
    ids = torch.randint(0, 5, (b, s), generator=g)
    text = torch.randn(s, b, h, generator=g, requires_grad=True)
    mods = {t: torch.randn(int((ids == t).sum()), h, generator=g, requires_grad=True) for t in (3, 4)}
    upstream = torch.randn(b, s, h, generator=g)

    def run(fn):
        for x in (text, *mods.values()):
            x.grad = None
        out = fn()
        (out * upstream).sum().backward()
        return out.detach(), [x.grad.clone() for x in (text, *mods.values())]

    def reference():
        out = text.transpose(0, 1)
        for token_id, tokens in mods.items():
            out = out.masked_scatter((ids == token_id).unsqueeze(-1), tokens)
        return out

    counts = {t: int((ids == t).sum()) for t in mods}
    want, want_grads = run(reference)
    got, got_grads = run(lambda: assemble_embeddings(text.transpose(0, 1), ids, mods, counts))
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_mock_counts_come_from_the_layout_and_equal_those_of_the_made_ids():
    """Length, documents and loss positions are known before the ids are made, and equal what the
    generic Sample computes from the ids, a placeholder at position 0 included."""
    from mimo.data.mock import Sample

    cfg = load_config(tiny())
    ds = MockMultimodalDataset(cfg)
    at_zero = 0
    for i in range(300):
        s = ds.sample(i)
        counts = (s.token_count(), s.document_tokens(), s.loss_count(cfg.placeholder_ids))
        assert s._ids is None  # nothing made yet
        at_zero += bool(s.runs and s.cuts[0] == 0)
        assert counts == (Sample.token_count(s), Sample.document_tokens(s), Sample.loss_count(s, cfg.placeholder_ids))
        assert s.loss_count({}) == Sample.loss_count(s, {})  # placeholders counted as text
        assert torch.equal(s.input_ids, ds.sample(i).input_ids)  # the same ids, made again
    assert at_zero > 0
