"""Tiny multimodal layouts shared by the attention tests (token ids, not numbers to compare)."""

import torch

from mimo.attention import build_bitfield_mask

IMG, AUD, PAD = 1001, 1002, 0
PLACEHOLDERS = {IMG: 1, AUD: 2}


def _ids(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (b, s), generator=g)


def scenario(name: str):
    """(mask [b, s], document_ids or None) for a named layout."""
    docs = None
    text_sees = None
    if name == "prefix_image":
        ids = _ids(2, 48, 1)
        ids[:, :20] = IMG
    elif name == "embedded_image_audio":
        ids = _ids(2, 70, 2)
        ids[0, 5:25] = IMG
        ids[0, 40:52] = AUD
        ids[1, 30:47] = AUD
        ids[1, 50:66] = IMG
    elif name == "two_images_one_modality":
        ids = _ids(1, 64, 3)
        ids[0, 4:18] = IMG
        ids[0, 30:47] = IMG
    elif name == "text_blind_to_audio":
        ids = _ids(2, 50, 4)
        ids[:, 3:15] = IMG
        ids[:, 20:38] = AUD
        text_sees = {1}
    elif name == "packed_documents":
        ids = _ids(2, 64, 5)
        ids[:, 2:12] = IMG
        ids[:, 35:50] = IMG
        docs = torch.zeros(2, 64, dtype=torch.int64)
        docs[0, 30:] = 1
        docs[1, 17:] = 1
        docs[1, 45:] = 2
    elif name == "padding_odd_length":
        ids = _ids(2, 53, 6)
        ids[0, 10:22] = IMG
        ids[0, 41:] = PAD
        ids[1, 0:3] = PAD
        ids[1, 30:53] = PAD
    else:
        raise KeyError(name)
    return build_bitfield_mask(ids, PLACEHOLDERS, text_sees=text_sees, pad_id=PAD), docs


NAMES = ["prefix_image", "embedded_image_audio", "two_images_one_modality", "text_blind_to_audio",
         "packed_documents", "padding_odd_length"]


def qkv(b, s, hq, hkv, d, dtype=torch.float32, seed=0, s_k=None):
    g = torch.Generator().manual_seed(seed)
    s_k = s if s_k is None else s_k
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, s_k, hkv, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, s_k, hkv, d, generator=g).to(dtype).requires_grad_()
    return q, k, v
