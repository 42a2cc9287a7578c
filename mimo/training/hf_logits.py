"""FP32 logits of a mimo model for given inputs, at any layout (verifies an HF conversion).

The config's own trainer runs one forward (and backward, which is discarded)
over the given samples instead of its dataset; a hook on the LLM's output
layer keeps each microbatch's logits, which are gathered over tensor
parallelism on the last pipeline stage (and under context parallelism over
its CP ranks, back in sequence order). With micro_batch_size 1, LLM DP
rank j's k-th microbatch is sample k * dp + j.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from mimo.attention import as_context_parallel_mask, unpermute
from mimo.config import LANGUAGE, MimoConfig, load_config
from mimo.data.items import grid_patches, grid_tokens, is_native, patch_width
from mimo.data.mock import Sample
from mimo.runtime import run_on_ranks, select_runtime

from .trainer import Trainer


class FixedSamples:
    """A dataset that is exactly the given samples (step 0)."""

    def __init__(self, samples: List[Sample]):
        self.samples = samples

    def sample(self, index: int) -> Sample:
        return self.samples[index]


def split_inputs(cfg: MimoConfig, inputs: Dict[str, torch.Tensor]) -> List[Sample]:
    """LLaVA-style inputs (expanded placeholders, images in order) -> one Sample per row.

    A native-resolution encoder (Qwen2-VL style) takes `pixel_values` [Σ patches, C*T*P*P] and
    `image_grid_thw` int64 [N, 3]: the images in order of appearance, each one's placeholder run
    t*h*w / spatial_merge_size^2 tokens long (`split_native`)."""
    ids = inputs["input_ids"].long()
    vocab = cfg.model.language.vocab_size
    if ids.dim() != 2:
        raise ValueError(f"input_ids: must be [batch, tokens], got {list(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids: token ids must be in [0, {vocab}) (model.language.vocab_size), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    native = {n: split_native(cfg, n, ids, inputs) for n, e in cfg.model.encoders.items() if is_native(e)}
    samples, used = [], {n: 0 for n in cfg.model.encoders}
    keys = {n: ("pixel_values" if e.kind == "vision" else "input_features") for n, e in cfg.model.encoders.items()}
    for r, row in enumerate(ids):
        items = {}
        for name, enc in cfg.model.encoders.items():
            if name in native:
                items[name] = native[name][r][0]
                continue
            n_tokens = int((row == cfg.placeholder_ids[name]).sum())
            if n_tokens % enc.tokens_per_item:
                raise ValueError(f"input_ids: a row holds {n_tokens} placeholder tokens of {name}, not a multiple of "
                                 f"{enc.tokens_per_item} (one per feature)")
            k = n_tokens // enc.tokens_per_item
            pool = inputs.get(keys[name])
            if k and (pool is None or pool.shape[0] < used[name] + k):
                raise ValueError(f"{keys[name]}: fewer items than input_ids has placeholders for")
            if pool is None:
                shape = (0, enc.num_channels, enc.image_size, enc.image_size) if enc.kind == "vision" else (
                    0, enc.clip_frames, enc.num_mel_bins)
                items[name] = torch.zeros(shape)
            else:
                x = pool[used[name]:used[name] + k].float()
                # HF Whisper takes [n, mel, frames]; mimo's audio items are [n, frames, mel].
                items[name] = x.transpose(1, 2) if enc.kind == "audio" else x
            used[name] += k
        grids = {n: per_row[r][1] for n, per_row in native.items()} or None
        samples.append(Sample(input_ids=row.clone(), items=items, grids=grids))
    for name in cfg.model.encoders:
        pool = inputs.get(keys[name])
        if name not in native and pool is not None and pool.shape[0] != used[name]:
            # transformers refuses this too ("Image features and image tokens do not match").
            raise ValueError(f"{keys[name]}: {pool.shape[0]} items, but input_ids has placeholders for {used[name]}")
    return samples


def split_native(cfg: MimoConfig, name: str, ids: torch.Tensor, inputs: Dict[str, torch.Tensor]) -> List[Tuple]:
    """Per row of `ids`: (its images' patches [Σ patches, C*T*P*P], their grids) for native encoder
    `name`. Each placeholder run holds whole images: consecutive images' token counts must add up
    to it exactly (an image of grid (t, h, w) is t*h*w / merge^2 tokens)."""
    enc = cfg.model.encoders[name]
    width, merge, pid = patch_width(enc), enc.spatial_merge_size, cfg.placeholder_ids[name]
    thw, pixels = inputs.get("image_grid_thw"), inputs.get("pixel_values")
    if thw is None:
        thw = torch.zeros(0, 3, dtype=torch.int64)
    if thw.dim() != 2 or thw.shape[1] != 3 or thw.is_floating_point() or (thw.numel() and int(thw.min()) < 1):
        raise ValueError(f"image_grid_thw: must be positive integers [N, 3] (t, h, w per image), "
                         f"got {thw.dtype} {list(thw.shape)}")
    grids = [tuple(int(x) for x in g) for g in thw.tolist()]
    for g in grids:
        if g[1] % merge or g[2] % merge:
            raise ValueError(f"image_grid_thw: {g}: h and w must be multiples of spatial_merge_size {merge}")
    total = sum(grid_patches(g) for g in grids)
    if grids and (pixels is None or pixels.dim() != 2 or tuple(pixels.shape) != (total, width)):
        raise ValueError(f"pixel_values: must be [{total}, {width}] (Σ t*h*w patches of image_grid_thw, "
                         f"C*T*P*P each), got {None if pixels is None else list(pixels.shape)}")
    out, image, start = [], 0, 0
    for r, row in enumerate(ids):
        mine = []
        is_pad = torch.cat([torch.zeros(1, dtype=torch.bool), row == pid, torch.zeros(1, dtype=torch.bool)])
        edges = torch.nonzero(is_pad[1:] != is_pad[:-1]).flatten().tolist()
        for a, b in zip(edges[::2], edges[1::2]):  # placeholder runs [a, b)
            left = b - a
            while left > 0:
                if image == len(grids):
                    raise ValueError(f"image_grid_thw: {len(grids)} images, but input_ids row {r} has more "
                                     f"placeholder tokens of {name} than they fill")
                n = grid_tokens(grids[image], merge)
                if n > left:
                    raise ValueError(f"image_grid_thw: image {image} {grids[image]} is {n} placeholder tokens "
                                     f"(t*h*w / {merge}^2), but its run in input_ids row {r} has {left} left")
                mine.append(grids[image])
                left, image = left - n, image + 1
        n_patches = sum(grid_patches(g) for g in mine)
        patches = pixels[start:start + n_patches].float() if n_patches else torch.zeros(0, width)
        out.append((patches, mine))
        start += n_patches
    if image != len(grids):
        raise ValueError(f"image_grid_thw: {len(grids)} images, but input_ids has placeholder runs for {image}")
    return out


def logits_config(raw: Dict, batch: int, seq: int) -> Dict:
    raw = copy.deepcopy(raw)
    # Sample i must be DP rank i % dp's microbatch i // dp (trainer_logits reads them back so): no
    # balancer may move samples between microbatches.
    raw.setdefault("data", {}).update(seq_length=seq, balance="none")
    tr = raw.setdefault("training", {})
    tr.update(precision="fp32", global_batch_size=batch, micro_batch_size=1, train_iters=1)
    return raw


def trainer_logits(trainer, samples: List[Sample]) -> Dict[int, torch.Tensor]:
    """Sample index -> float32 [S, V] logits, on the LLM's last-stage TP-rank-0 ranks (empty elsewhere).

    Runs one forward and backward; the gradients are left unused (no optimizer step)."""
    trainer.dataset = FixedSamples(samples)
    captured: List[torch.Tensor] = []
    slots: List[torch.Tensor] = []  # under CP: each microbatch's token layout (its mask's slots)
    llm = trainer.parts.get(LANGUAGE)
    last = llm is not None and getattr(llm, "post_process", False)
    grid = trainer.topo.grid(LANGUAGE)
    hooks = []
    if last:
        # A copy: the fused cross-entropy that follows works in place on the logits.
        hooks.append(llm.output_layer.register_forward_hook(
            lambda m, i, out: captured.append(out[0].detach().clone())))
        if grid.layout.cp > 1:
            hooks.append(llm.register_forward_pre_hook(
                lambda m, a, kw: slots.append(as_context_parallel_mask(kw["attention_mask"]).slots),
                with_kwargs=True))
    trainer.forward_backward(0)
    if not last:
        return {}
    for h in hooks:
        h.remove()
    tp, cp = grid.groups["tp"], grid.groups["cp"]
    out = {}
    dp, j = grid.layout.dp, grid.coords["dp"]
    for k, piece in enumerate(captured):  # [s (under CP: this rank's L slots), 1, V / tp]
        parts = [torch.empty_like(piece) for _ in range(dist.get_world_size(tp))]
        dist.all_gather(parts, piece.contiguous(), group=tp)
        whole = torch.cat(parts, dim=-1)
        if grid.layout.cp > 1:  # every CP rank's slots, back in sequence order
            local = [torch.empty_like(whole) for _ in range(grid.layout.cp)]
            dist.all_gather(local, whole, group=cp)
            whole = unpermute(local, slots[k], dim=0)
        if grid.coords["tp"] == 0 and grid.coords["cp"] == 0:
            out[k * dp + j] = whole[:, 0].float().cpu()
    return out


def _rank_logits(raw: Dict, inputs: Dict[str, torch.Tensor]):
    cfg = load_config(raw)
    return trainer_logits(Trainer(cfg, select_runtime("cpu")), split_inputs(cfg, inputs))


def merge_logits(per_rank: List[Dict[int, torch.Tensor]], batch: int) -> torch.Tensor:
    merged = {}
    for r in per_rank:
        merged.update(r)
    return torch.stack([merged[i] for i in range(batch)])


def hf_logits(raw: Dict, inputs: Dict[str, torch.Tensor], timeout_s: float = 900.0) -> torch.Tensor:
    """float32 [B, S, V] logits of the config's model for LLaVA-style `inputs`."""
    batch = inputs["input_ids"].shape[0]
    raw = logits_config(raw, batch, inputs["input_ids"].shape[1])
    cfg = load_config(raw)
    split_inputs(cfg, inputs)  # bad inputs fail here, before any rank starts
    return merge_logits(run_on_ranks(_rank_logits, cfg.world_size, raw, inputs, timeout_s=timeout_s), batch)
