"""FP32 logits of a mimo model for given inputs, at any layout (verifies an HF conversion).

The config's own trainer runs one forward (and backward, which is discarded)
over the given samples instead of its dataset; a hook on the LLM's output
layer keeps each microbatch's logits, which are gathered over tensor
parallelism on the last pipeline stage. With micro_batch_size 1, LLM DP
rank j's k-th microbatch is sample k * dp + j.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.distributed as dist

from mimo.config import LANGUAGE, MimoConfig, load_config
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
    """LLaVA-style inputs (expanded placeholders, images in order) -> one Sample per row."""
    ids = inputs["input_ids"].long()
    samples, used = [], {n: 0 for n in cfg.model.encoders}
    keys = {n: ("pixel_values" if e.kind == "vision" else "input_features") for n, e in cfg.model.encoders.items()}
    for row in ids:
        items = {}
        for name, enc in cfg.model.encoders.items():
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
        samples.append(Sample(input_ids=row.clone(), items=items))
    return samples


def logits_config(raw: Dict, batch: int, seq: int) -> Dict:
    raw = copy.deepcopy(raw)
    raw.setdefault("data", {})["seq_length"] = seq
    tr = raw.setdefault("training", {})
    tr.update(precision="fp32", global_batch_size=batch, micro_batch_size=1, train_iters=1)
    return raw


def trainer_logits(trainer, samples: List[Sample]) -> Dict[int, torch.Tensor]:
    """Sample index -> float32 [S, V] logits, on the LLM's last-stage TP-rank-0 ranks (empty elsewhere).

    Runs one forward and backward; the gradients are left unused (no optimizer step)."""
    trainer.dataset = FixedSamples(samples)
    captured: List[torch.Tensor] = []
    llm = trainer.parts.get(LANGUAGE)
    last = llm is not None and getattr(llm, "post_process", False)
    hook = None
    if last:
        # A copy: the fused cross-entropy that follows works in place on the logits.
        hook = llm.output_layer.register_forward_hook(lambda m, i, out: captured.append(out[0].detach().clone()))
    trainer.forward_backward(0)
    if not last:
        return {}
    hook.remove()
    grid = trainer.topo.grid(LANGUAGE)
    tp = grid.groups["tp"]
    out = {}
    dp, j = grid.layout.dp, grid.coords["dp"]
    for k, piece in enumerate(captured):  # [s, 1, V / tp]
        parts = [torch.empty_like(piece) for _ in range(dist.get_world_size(tp))]
        dist.all_gather(parts, piece.contiguous(), group=tp)
        if grid.coords["tp"] == 0:
            out[k * dp + j] = torch.cat(parts, dim=-1)[:, 0].float().cpu()
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
    if cfg.parallelism[LANGUAGE].cp != 1:
        raise ValueError("parallelism.language.cp: logits are taken with cp = 1")
    split_inputs(cfg, inputs)  # bad inputs fail here, before any rank starts
    return merge_logits(run_on_ranks(_rank_logits, cfg.world_size, raw, inputs, timeout_s=timeout_s), batch)
