"""What an LLM microbatch carries to the device, derived on the host (mimo.training.step_data)."""

import copy

import pytest
import torch

from mimo.attention import plan_context_parallel
from mimo.attention.context_parallel import check_slots
from mimo.config import load_config
from mimo.data import MockMultimodalDataset, collate
from mimo.model import assemble_embeddings, attention_mask
from mimo.training.step_data import llm_microbatch

from tiny import TINY


def _packed(cfg):
    """Two mock samples, the second made of two packed documents and padding."""
    from mimo.data.mock import Sample

    ds = MockMultimodalDataset(cfg)
    # Plain samples with the mock ones' tokens and items (a mock sample counts from its own layout).
    a, b = (Sample(input_ids=m.input_ids, items=m.items, grids=m.grids) for m in (ds.sample(0), ds.sample(1)))
    s = a.input_ids.shape[0]
    a.document_ids = torch.zeros(s, dtype=torch.long)
    b.document_ids = torch.tensor([0] * (s // 2) + [1] * (s // 2 - 4) + [-1] * 4)
    for x in (a, b):
        x.targets = x.document_ids >= 0
        x.position_ids = torch.arange(s)
    return [a, b]


def test_an_llm_microbatch_carries_its_mask_slots_and_placeholder_counts():
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["attention"] = "bitfield"
    raw["parallelism"] = {"language": {"cp": 2}, "images": {"dp": 2}, "audio": {"dp": 2}}
    cfg = load_config(raw, world_size=2)
    host = collate(_packed(cfg), cfg.placeholder_ids)
    got = llm_microbatch(cfg, host, torch.device("cpu"), torch.float32)

    want = attention_mask(cfg, host["input_ids"], host["document_ids"])
    assert torch.equal(got["attention_mask"].bits, want.bits)
    assert torch.equal(got["attention_mask"].document_ids, want.document_ids)
    # The CP plan balances the packed documents' work (document ids included), and is valid.
    slots = plan_context_parallel(want.bits, 2, cfg.model.language.cp_block_size, cfg.model.language.cp_policy,
                                  want.document_ids)
    assert torch.equal(got["cp_slots"], slots)
    check_slots(got["cp_slots"], host["input_ids"].shape[1])
    counts = {i: int((host["input_ids"] == i).sum()) for i in cfg.placeholder_ids.values()}
    assert got["placeholder_counts"] == counts and sum(counts.values()) > 0
    for key in ("input_ids", "labels", "loss_mask"):
        assert torch.equal(got[key], host[key])


def test_assembly_trusts_host_counts_and_still_checks_them():
    ids = torch.tensor([[1, 9, 9, 2], [9, 3, 4, 5]])
    text = torch.zeros(2, 4, 3)
    tokens = {9: torch.ones(3, 3)}
    assert torch.equal(assemble_embeddings(text, ids, tokens, {9: 3}), assemble_embeddings(text, ids, tokens))
    with pytest.raises(ValueError, match="2 placeholder tokens"):
        assemble_embeddings(text, ids, tokens, {9: 2})


def test_encoder_items_take_slices_consecutive_rows_and_indexes_the_rest():
    """A window's items on consecutive rows come back as a view of the step's rows (no index copied to
    the device); any other choice as an indexed copy; both equal indexing item by item."""
    from mimo.training.step_data import EncoderItems

    rows = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    items = EncoderItems(rows, {10 + r: r for r in range(5)})
    for ids in ([11, 12, 13], [13, 11], [10, 12], [14], []):
        got = items.take(ids)
        assert torch.equal(got, rows[[i - 10 for i in ids]]), ids
    storage = rows.untyped_storage().data_ptr()
    assert items.take([11, 12, 13]).untyped_storage().data_ptr() == storage
    assert items.take([13, 11]).untyped_storage().data_ptr() != storage

    grids = [(1, 2, 2), (1, 2, 4), (1, 2, 2)]  # 4, 8 and 4 patches
    patches = torch.arange(16 * 2, dtype=torch.float32).view(16, 2)
    packed = EncoderItems(patches, {7: 0, 8: 1, 9: 2}, grids)
    span = {7: patches[0:4], 8: patches[4:12], 9: patches[12:16]}
    for ids in ([8, 9], [9, 7], [7], []):
        got = packed.take(ids)
        want = torch.cat([span[i] for i in ids]) if ids else patches[:0]
        assert torch.equal(got.patches, want) and got.grids == [grids[i - 7] for i in ids], ids


def test_loss_tokens_counted_per_sample_equal_the_collated_loss_mask():
    """The step's loss-token count every rank makes from metadata equals the loss_mask sum of the collated
    samples: mock samples (placeholders and padding excluded) and packed real ones (document bounds)."""
    from mimo.data import loss_tokens

    cfg = load_config(copy.deepcopy(TINY))
    ds = MockMultimodalDataset(cfg)
    for samples in ([ds.sample(i) for i in range(6)], _packed(cfg)):
        want = int(collate(samples, cfg.placeholder_ids)["loss_mask"].sum())
        assert loss_tokens(samples, cfg.placeholder_ids) == want > 0
    # Negative control: counting placeholders as text changes the count.
    samples = [ds.sample(i) for i in range(6)]
    assert loss_tokens(samples, {}) > loss_tokens(samples, cfg.placeholder_ids)
