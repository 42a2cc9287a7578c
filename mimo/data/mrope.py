"""M-RoPE position ids (Qwen2-VL, Qwen2.5-VL): three positions per token, on the host.

M-RoPE gives every token a (temporal, height, width) position. A text token has the same id on
all three axes, one more than the token before it. The tokens of an image (its grid of
t x h x w patches, merged spatial_merge_size x spatial_merge_size into one token each) take the
grid coordinates of their merged patch, each axis offset by the text position where the image
starts; the text after the image continues from that offset plus the larger merged side (the
largest position the image used, plus one). This is transformers' ``get_rope_index`` for one
sequence of still images (their temporal spacing is 1; video is not handled here).

A packed sample holds several documents: each starts again from position 0, as mimo's 1-D
positions do, and padding (document id < 0) gets 0 on all three axes.

Computed from the token ids and each image's grid alone (host-side metadata, nothing decoded),
so the data pipeline makes it with the sample and the step never reads a device tensor for it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

Grid = Tuple[int, int, int]


def image_token_count(grid: Sequence[int], spatial_merge_size: int) -> int:
    """LLM tokens of an image of `grid` (t, h, w) patches: t * h * w / merge^2."""
    t, h, w = (int(v) for v in grid)
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def _check_grid(k: int, grid: Sequence[int], merge: int) -> Grid:
    if len(grid) != 3 or any(int(v) <= 0 for v in grid):
        raise ValueError(f"image_grids[{k}]: expected three positive sizes (t, h, w), got {tuple(grid)}")
    t, h, w = (int(v) for v in grid)
    if h % merge or w % merge:
        raise ValueError(f"image_grids[{k}]: h and w ({h}, {w}) must be multiples of "
                         f"spatial_merge_size ({merge})")
    return t, h, w


def _runs(keys: torch.Tensor):
    """(start, end) of each run of equal consecutive rows of `keys` [S, k]."""
    S = keys.shape[0]
    change = torch.ones(S, dtype=torch.bool)
    change[1:] = (keys[1:] != keys[:-1]).any(dim=1)
    starts = torch.nonzero(change).flatten().tolist()
    return list(zip(starts, starts[1:] + [S]))


def mrope_position_ids(input_ids: torch.Tensor, image_token_id: int, image_grids: Sequence[Sequence[int]],
                       spatial_merge_size: int, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [3, S] M-RoPE positions (temporal, height, width) of one token sequence.

    input_ids: [S] (image tokens already expanded: one per merged patch); image_token_id: the
    placeholder id; image_grids: each image's (t, h, w) in patches, in order of appearance;
    spatial_merge_size: patches merged per side into one LLM token; document_ids: [S] for a packed
    sample (positions restart per document, -1 marks padding), None for one document.
    Adjacent images (no text between) are told apart by their grids' token counts.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be one sequence [S], got shape {tuple(input_ids.shape)}")
    if spatial_merge_size <= 0:
        raise ValueError(f"spatial_merge_size must be > 0, got {spatial_merge_size}")
    S = input_ids.shape[0]
    docs = torch.zeros(S, dtype=torch.long) if document_ids is None else document_ids.to("cpu", torch.long)
    if tuple(docs.shape) != (S,):
        raise ValueError(f"document_ids has shape {tuple(docs.shape)}, input_ids {tuple(input_ids.shape)}")
    grids = [_check_grid(k, g, spatial_merge_size) for k, g in enumerate(image_grids)]
    is_image = (input_ids.to("cpu") == image_token_id).long()
    out = torch.zeros(3, S, dtype=torch.long)
    used, pos, doc = 0, 0, None
    for a, b in _runs(torch.stack([docs, is_image], dim=1)):
        if int(docs[a]) < 0:  # padding
            continue
        if int(docs[a]) != doc:
            doc, pos = int(docs[a]), 0
        if not is_image[a]:
            out[:, a:b] = torch.arange(pos, pos + b - a)
            pos += b - a
            continue
        i = a
        while i < b:  # one image per grid, until the run of image tokens is used up
            if used == len(grids):
                raise ValueError(f"image_grids: {len(grids)} grids, but input_ids has more image tokens "
                                 f"(token {i} has none left)")
            t, h, w = grids[used]
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            n = t * gh * gw
            if i + n > b:
                raise ValueError(f"image_grids[{used}]: grid {(t, h, w)} needs {n} image tokens, input_ids has "
                                 f"{b - i} at token {i}")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            out[:, i:i + n] = torch.stack([tt, hh, ww]).reshape(3, n) + pos
            pos += max(gh, gw)
            used, i = used + 1, i + n
    if used != len(grids):
        raise ValueError(f"image_grids: {len(grids)} grids, but input_ids has image tokens for only {used}")
    return out


def microbatch_mrope_position_ids(cfg, host) -> torch.Tensor:
    """int64 [3, b, s] M-RoPE positions of a collated microbatch (`mimo.data.collate`) whose samples
    carry 1-D positions (mock data, LLaVA records, packed or not).

    The images of the native-resolution vision encoder (`resolution: native`) take their grid
    positions, from the microbatch's `<name>_grids` [N, 3] and `<name>_counts` [b] (host tensors);
    every other token (text, padding, any other modality's placeholders) is positioned as text.
    Without such an encoder every token has its 1-D position on all three axes, where M-RoPE is
    1-D RoPE."""
    native = [n for n, e in cfg.model.encoders.items()
              if e.kind == "vision" and getattr(e, "resolution", "fixed") == "native"]
    if len(native) > 1:
        raise ValueError(f"model.encoders: M-RoPE positions one native-resolution image encoder, got {native}")
    if not native:
        return host["position_ids"].unsqueeze(0).expand(3, -1, -1).contiguous()
    name = native[0]
    enc = cfg.model.encoders[name]
    grids = host.get(f"{name}_grids", torch.zeros(0, 3, dtype=torch.int64)).tolist()
    counts = host[f"{name}_counts"].tolist()
    docs = host.get("document_ids")
    rows, first = [], 0
    for b, row in enumerate(host["input_ids"]):
        rows.append(mrope_position_ids(row, cfg.placeholder_ids[name], grids[first:first + counts[b]],
                                       enc.spatial_merge_size, None if docs is None else docs[b]))
        first += counts[b]
    return torch.stack(rows, dim=1)
