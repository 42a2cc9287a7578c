"""Mask construction and the dense allowed-matrix semantics of the contract."""

import pytest
import torch

from mimo.attention import (
    CAUSAL, LOW, TEXT, BitfieldMask, build_bitfield_mask, document_ids_from_eod, modality_bit,
)
from mimo.attention.inputs import allowed_matrix, check_inputs


def allowed(mask, docs=None):
    b, s = mask.shape
    x = torch.zeros(b, s, 1, 8)
    return allowed_matrix(check_inputs(x, x, x, mask, mask, q_document_ids=docs, k_document_ids=docs))[0]


def test_bit_layout_matches_design():
    assert TEXT == 1 and CAUSAL == 1 << 62 and LOW == CAUSAL - 1
    assert modality_bit(1) == 2 and modality_bit(61) == 1 << 61
    for bad in (0, 62, -1, True, 2.0):
        with pytest.raises(ValueError):
            modality_bit(bad)


def test_build_mask_values():
    ids = torch.tensor([[7, 5, 5, 8, 6, 9, 0]])
    mask = build_bitfield_mask(ids, {5: 1, 6: 2}, text_sees={1}, pad_id=0)
    text = CAUSAL | TEXT | modality_bit(1)
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[text, 2, 2, text, 4, text, 0]]
    everything = build_bitfield_mask(ids[0], {5: 1, 6: 2})  # 1-D input, text sees all modalities
    assert everything.shape == (1, 7) and everything[0, 0].item() == CAUSAL | TEXT | 2 | 4


def test_build_mask_rejects_bad_input():
    with pytest.raises(ValueError):
        build_bitfield_mask(torch.zeros(2, 3, dtype=torch.long), {5: 62})
    with pytest.raises(ValueError):
        build_bitfield_mask(torch.zeros(2, 3, dtype=torch.long), {0: 1}, pad_id=0)
    with pytest.raises(TypeError):
        build_bitfield_mask(torch.zeros(2, 3), {5: 1})


def test_semantics_image_text_padding():
    # text, img, img, text, audio, text(blind to audio), pad
    ids = torch.tensor([[7, 5, 5, 8, 6, 9, 0]])
    ok = allowed(build_bitfield_mask(ids, {5: 1, 6: 2}, text_sees={1}, pad_id=0))
    assert ok[1].tolist() == [False, True, True, False, False, False, False]  # image sees only images, both ways
    assert ok[2, 1] and ok[1, 2]
    assert ok[3].tolist() == [True, True, True, True, False, False, False]    # text: causal, sees image
    assert ok[4].tolist() == [False, False, False, False, True, False, False]  # audio sees itself only
    assert ok[5].tolist() == [True, True, True, True, False, True, False]     # text does not see audio
    assert not ok[6].any() and not ok[:, 6].any()                              # padding isolated


def test_semantics_two_images_and_documents():
    ids = torch.tensor([[5, 5, 7, 5, 5, 8]])
    mask = build_bitfield_mask(ids, {5: 1})
    ok = allowed(mask)
    assert ok[0, 4] and ok[4, 0]  # same modality bits attend bidirectionally (DESIGN.md)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    ok = allowed(mask, docs)
    assert not ok[0, 4] and not ok[4, 0] and not ok[5, 2] and ok[5, 3]


def test_document_ids_from_eod():
    ids = torch.tensor([[4, 4, 2, 4, 2, 4]])
    assert document_ids_from_eod(ids, 2).tolist() == [[0, 0, 0, 1, 1, 2]]


def test_bitfield_mask_tensor_round_trip():
    bits = torch.full((2, 5), TEXT, dtype=torch.int64)
    docs = torch.zeros(2, 5, dtype=torch.int64)
    m = BitfieldMask.from_tensor(BitfieldMask(bits, docs).to_tensor())
    assert torch.equal(m.bits, bits) and torch.equal(m.document_ids, docs)
    assert BitfieldMask.from_tensor(bits).document_ids is None
    with pytest.raises(ValueError):
        BitfieldMask.from_tensor(torch.zeros(3, 2, 5, dtype=torch.int64))
    with pytest.raises(TypeError):
        BitfieldMask(bits.int())
