#!/usr/bin/env python
"""Planner predictions against the heterogeneous-parallelism paper's measurements.

    python tools/paper_check.py [--table A2|A3|A4] [--json] [--gpu h100]

For every row of the paper's Tables A2 (colocated, 8K), A3 (colocated, long
context) and A4 (non-colocated, 120B) it costs the printed layouts with the
planner's step model (``--evaluate`` semantics: bf16, distributed optimizer,
SP on, the paper's recompute settings, gradients reduced in bf16 as the
paper's memory shows, default H100 constants, no calibration) and prints
predicted vs measured step time, peak memory and gain, then the acceptance
metrics. The paper gives model sizes only; the
shapes below are our choice (see docs/planner.md) and nothing was fitted to
the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo.planner.hardware import get_gpu  # noqa: E402
from mimo.planner.layout_search import GB, LayoutSearch  # noqa: E402
from mimo.planner.megatron import Par, Work  # noqa: E402
from mimo.planner.spec import read_model  # noqa: E402

VOCAB = 128256
# (layers, hidden, heads, query groups, ffn); GELU-style two-matrix MLP whose
# ffn is sized so the parameter count matches the stated size.
LLMS = {
    "7B": (32, 4096, 32, 8, 16384),
    "14B": (40, 5120, 40, 8, 20480),
    "32B": (52, 7168, 56, 8, 28672),
    "70B": (80, 8192, 64, 8, 43008),
    "120B": (96, 10240, 80, 8, 49152),
}
# ViT encoders on 448 px images, 14 px patches: 1024 tokens per image.
ENCODERS = {
    "1B": (24, 2048, 16, 8192),
    "3B": (40, 2560, 32, 10240),
    "6B": (52, 3072, 24, 12288),
    "7.2B": (36, 4096, 32, 16384),
    "12B": (60, 4096, 32, 16384),
}
IMAGE, PATCH = 448, 14
TOKENS_PER_IMAGE = (IMAGE // PATCH) ** 2
SIZES = {"7B": 7e9, "14B": 14e9, "32B": 32e9, "70B": 70e9, "120B": 120e9,
         "1B": 1e9, "3B": 3e9, "6B": 6e9, "7.2B": 7.2e9, "12B": 12e9}


def _ffn(params: float, layers: int, hidden: int, heads: int, groups: int, vocab: int,
         matrices: int = 2) -> int:
    """ffn of an MLP of ``matrices`` ffn x hidden matrices (3 when gated)
    that brings the model to ``params`` (multiple of 512)."""
    kv = groups * hidden // heads
    per_layer = params / layers - vocab * 2 * hidden / layers
    f = (per_layer - 2 * hidden * hidden - 2 * hidden * kv) / (matrices * hidden)
    return max(512, int(round(f / 512)) * 512)


# Our encoders' (layers, hidden, heads), for the sets that vary only the LLMs.
OUR_ENCODERS = {size: shape[:3] for size, shape in ENCODERS.items()}


class ShapeSet(NamedTuple):
    """Model shapes of the paper's sizes: (layers, hidden, heads, query
    groups) per LLM and (layers, hidden, heads) per encoder; ffn is
    computed to keep each size."""
    llms: dict
    encoders: dict
    image: int = IMAGE
    gated: bool = False          # swiglu LLMs (three ffn x hidden matrices)
    vocab: int = VOCAB


# Other shapes of the same sizes, for the robustness check (``--shapes``):
# deeper and narrower, or shallower and wider, than ours; "wide" also uses
# 336 px images (576 tokens each).
ALT = {
    "deep": ShapeSet({"7B": (48, 3584, 56, 8), "14B": (56, 4608, 48, 8), "32B": (64, 6144, 48, 8),
                      "70B": (96, 7168, 56, 8), "120B": (120, 9216, 72, 8)},
                     {"1B": (32, 1792, 16), "3B": (48, 2304, 24), "6B": (64, 2816, 32), "7.2B": (48, 3584, 32),
                      "12B": (80, 3584, 32)}),
    "wide": ShapeSet({"7B": (24, 4608, 48, 8), "14B": (32, 6144, 48, 8), "32B": (40, 8192, 64, 8),
                      "70B": (64, 9216, 72, 8), "120B": (80, 11264, 88, 8)},
                     {"1B": (16, 2560, 32), "3B": (28, 3072, 24), "6B": (40, 3584, 32), "7.2B": (32, 4608, 48),
                      "12B": (48, 4608, 48)}, 336),
    # Llama-style LLMs: a gated (swiglu) MLP, the layer counts and widths of
    # Llama-2 7B, Qwen2.5 14B / 32B, Llama-3 70B and a 120B of that family;
    # encoders as ours.
    "gated": ShapeSet({"7B": (32, 4096, 32, 8), "14B": (48, 5120, 40, 8), "32B": (64, 5120, 40, 8),
                       "70B": (80, 8192, 64, 8), "120B": (96, 10240, 80, 8)},
                      OUR_ENCODERS, gated=True),
    # Llama-1/2-style: gated MLPs and multi-head attention (a K/V head per
    # query head, so CP moves and stores far more K/V), the widths of
    # Llama-2 7B / 13B, Llama-1 33B / 65B and a 120B; encoders as ours.
    "mha": ShapeSet({"7B": (32, 4096, 32, 32), "14B": (40, 5120, 40, 40), "32B": (60, 6656, 52, 52),
                     "70B": (80, 8192, 64, 64), "120B": (96, 10240, 80, 80)},
                    OUR_ENCODERS, gated=True),
    # Deeper and narrower LLMs than "deep" (14B = 64 x 4096: the most
    # activation memory per parameter of any set), encoders as ours.
    "narrow": ShapeSet({"7B": (40, 3584, 28, 4), "14B": (64, 4096, 32, 8), "32B": (80, 5120, 40, 8),
                        "70B": (100, 7168, 56, 8), "120B": (128, 8192, 64, 8)},
                       OUR_ENCODERS),
}

# Ranges ``random_shapes`` draws from. Widths per size bracket published
# dense models of that size; depth follows from the width, an MLP ratio
# (gelu 3.5-5.5 x hidden, swiglu 2.6-3.6 x) and the size, and is kept to
# the aspect ratios (hidden / layers) such models have: LLMs 64-200
# (Llama-2 7B 128, Qwen2.5-32B 80, Llama-3 70B 102), ViTs 28-130 (ViT-L/14
# 43, ViT-g 35, InternViT-6B 71, EVA-CLIP-8B 128).
RANDOM_LLM_WIDTHS = {"7B": (3072, 4608), "14B": (4096, 6144), "32B": (5120, 8192),
                     "70B": (7168, 9216), "120B": (8192, 12288)}
RANDOM_ENCODER_WIDTHS = {"1B": (1536, 2560), "3B": (2048, 3584), "6B": (2560, 4096),
                         "7.2B": (3072, 4608), "12B": (3584, 5120)}
RANDOM_VOCABS = (32000, 128256, 152064, 256000)
RANDOM_IMAGES = (224, 336, 448)          # 14 px patches: 256, 576, 1024 tokens
LLM_ASPECT, ENCODER_ASPECT = (64, 200), (28, 130)


def random_shapes(seed: int) -> ShapeSet:
    """A random but plausible shape set of the paper's sizes: head
    dimensions 64-128, head and query-group counts that TP 8 divides (the
    paper's layouts run every LLM and, in H, every encoder at TP up to 8),
    query groups 8, 16 or one per head, gated or not, one of four
    vocabularies and image sizes."""
    rng = random.Random(seed)
    gated = rng.random() < 0.6
    vocab = rng.choice(RANDOM_VOCABS)
    llms = {}
    for size, (lo, hi) in RANDOM_LLM_WIDTHS.items():
        while True:
            h, heads = rng.choice([(h, h // d) for h in range(lo, hi + 1, 512) for d in (64, 96, 128)
                                   if h % d == 0 and (h // d) % 8 == 0])
            groups = rng.choice([g for g in (8, 16, heads) if heads % g == 0])
            ratio = rng.uniform(2.6, 3.6) if gated else rng.uniform(3.5, 5.5)
            per_layer = 2 * h * h + 2 * h * h * groups / heads + (3 if gated else 2) * ratio * h * h
            layers = max(4, round((SIZES[size] - 2 * vocab * h) / per_layer / 4) * 4)
            if LLM_ASPECT[0] <= h / layers <= LLM_ASPECT[1]:
                break
        llms[size] = (layers, h, heads, groups)
    encoders = {}
    for size, (lo, hi) in RANDOM_ENCODER_WIDTHS.items():
        while True:
            h, heads = rng.choice([(h, a) for h in range(lo, hi + 1, 256) for a in range(8, 81, 8)
                                   if h % a == 0 and h // a in (64, 80, 96, 128)])
            layers = max(4, round(SIZES[size] / (12 * h * h)))
            if ENCODER_ASPECT[0] <= h / layers <= ENCODER_ASPECT[1]:
                break
        encoders[size] = (layers, h, heads)
    return ShapeSet(llms, encoders, rng.choice(RANDOM_IMAGES), gated, vocab)


_SHAPES = {"set": None, "encoders": "paper", "grad_reduce_in_fp32": False}
ENCODER_MODES = ("paper", "trainable", "frozen")


def use_shapes(name: str, encoders: str = "paper", grad_reduce_in_fp32: bool = False) -> None:
    """Select the model shapes (``ours``, a name in ``ALT`` or ``random:SEED``) for the rows,
    the encoders' training state: ``trainable``, ``frozen`` (projectors stay
    trainable) or ``paper`` (see ``encoders_frozen``), and the gradient
    buffers' dtype.

    The paper's runs reduced gradients in bf16 (Megatron-LM's
    --grad-reduce-in-bf16): its measured peaks leave no room for fp32
    gradient buffers. Table A2's 70B layout 8/1/1/32 (no pipeline, no
    recompute) peaks at 61.5 GB; its 8.75e9 parameters per GPU take 17.5 GB
    of bf16 weights, and fp32 gradients would add 35 GB more before a single
    activation (about 24 GB for one 8K microbatch). ``True`` costs the rows
    as mimo's trainer runs bf16 by default (what ``plan.py --evaluate`` does
    for a config that leaves ``training.grad_reduce_in_fp32`` out)."""
    if encoders not in ENCODER_MODES:
        raise ValueError(f"unknown encoder mode {encoders!r} ({', '.join(ENCODER_MODES)})")
    _SHAPES["set"], _SHAPES["encoders"] = shape_set(name), encoders
    _SHAPES["grad_reduce_in_fp32"] = grad_reduce_in_fp32


def encoders_frozen(table: str) -> bool:
    """Whether the encoders of ``table``'s runs are costed frozen.

    The paper does not say. ``paper`` reads it from the paper itself: Table
    A2 sweeps the number of *encoder* distributed-optimizer instances, so its
    encoders were trained (A3 has no evidence either way and keeps them
    trainable). Table A4's measured non-colocated steps are too short for a
    trainable encoder on its 8-GPU island: ``trainable_floor_ms`` (the
    forward, recompute and backward FLOPs of the step's images at the GPU's
    dense peak, with no attention, communication or imbalance) needs more
    than the rate large bf16 GEMMs reach in half the rows, and more than
    the dense peak itself in three. A4 is therefore costed with frozen
    encoders (trainable projectors), as in the paper's own validation runs."""
    mode = _SHAPES["encoders"]
    if mode != "paper":
        return mode == "frozen"
    return table == "A4"


def shape_set(name: str) -> ShapeSet | None:
    """``ours`` (None: the tables above), a name in ``ALT``, or
    ``random:SEED``."""
    if name == "ours":
        return None
    if name in ALT:
        return ALT[name]
    kind, _, seed = name.partition(":")
    if kind == "random" and seed.isdigit():
        return random_shapes(int(seed))
    raise ValueError(f"unknown shapes {name!r} (ours, {', '.join(ALT)}, random:SEED)")


def _shapes(enc: str, llm: str):
    """(LLM shape with ffn, encoder shape with ffn, image px, gated, vocab)."""
    shapes = _SHAPES["set"]
    if shapes is None:
        return LLMS[llm], ENCODERS[enc], IMAGE, False, VOCAB
    L, h, a, g = shapes.llms[llm]
    el, eh, ea = shapes.encoders[enc]
    f = _ffn(SIZES[llm], L, h, a, g, shapes.vocab, 3 if shapes.gated else 2)
    return ((L, h, a, g, f), (el, eh, ea, _ffn(SIZES[enc], el, eh, ea, ea, 0)), shapes.image,
            shapes.gated, shapes.vocab)


def model_config(enc: str, llm: str, frozen: bool = False) -> dict:
    (L, h, a, g, f), (el, eh, ea, ef), image, gated, vocab = _shapes(enc, llm)
    return {
        "language": {"num_layers": L, "hidden_size": h, "num_attention_heads": a, "num_query_groups": g,
                     "ffn_hidden_size": f, "vocab_size": vocab, "frozen": False,
                     "activation": "swiglu" if gated else "gelu"},
        "encoders": {"images": {"kind": "vision", "num_layers": el, "hidden_size": eh, "num_attention_heads": ea,
                                "ffn_hidden_size": ef, "image_size": image, "patch_size": PATCH,
                                "frozen": frozen,
                                "projector": {"kind": "mlp", "frozen": False}}},
    }


def _t(s: str) -> tuple[int, int, int, int]:
    return tuple(int(x) for x in s.split("/"))  # type: ignore[return-value]


# Table A2: model, vis%, gpus, gbs, H layout, C-E, C-L, measured gain %, mem H/C, step ms H/C
A2 = [
    ("1B+14B", 50, 72, 288, "4/1/1/18", "2/1/1/36", "2/1/2/18", 12.1, 57.2, 57.1, 7570, 6750),
    ("1B+14B", 75, 72, 288, "4/1/1/18", "1/1/1/72", "2/1/2/18", 13.5, 57.2, 57.6, 7780, 6840),
    ("1B+14B", 87.5, 72, 288, "4/1/1/18", "1/1/1/72", "2/1/2/18", 12.7, 57.2, 57.8, 7660, 6800),
    ("3B+14B", 50, 72, 288, "4/1/1/18", "2/1/1/36", "2/1/2/18", 12.9, 59.7, 57.3, 7850, 6970),
    ("3B+14B", 75, 72, 288, "4/1/1/18", "1/1/1/72", "2/1/2/18", 12.7, 59.7, 57.7, 8020, 7140),
    ("3B+14B", 87.5, 72, 288, "4/1/1/18", "1/1/1/72", "2/1/2/18", 14.0, 59.7, 57.9, 8130, 7150),
    ("1B+32B", 75, 72, 288, "4/1/1/18", "1/1/1/72", "4/1/2/9", None, 66.2, 55.2, 14210, 14380),
    ("3B+32B", 50, 72, 288, "4/1/1/18", "1/1/1/72", "4/1/2/9", None, 68.7, 54.2, 14330, 14750),
    ("3B+32B", 75, 72, 288, "4/1/1/18", "1/1/1/72", "4/1/2/9", 11.1, 68.7, 55.3, 14370, 12950),
    ("3B+32B", 87.5, 72, 288, "4/1/1/18", "1/1/1/72", "4/1/2/9", 13.1, 68.7, 55.8, 14630, 12910),
    ("1B+70B", 50, 256, 256, "8/1/1/32", "1/1/1/256", "8/1/2/16", 16.5, 61.5, 47.2, 8441, 7244),
    ("1B+70B", 75, 256, 256, "8/1/1/32", "1/1/1/256", "8/1/2/16", 15.1, 61.5, 47.8, 8415, 7312),
    ("3B+70B", 50, 256, 256, "8/1/1/32", "1/1/1/256", "8/1/2/16", 13.9, 62.7, 48.8, 8471, 7434),
    ("3B+70B", 75, 256, 256, "8/1/1/32", "1/1/1/256", "8/1/2/16", 12.7, 62.7, 49.4, 8452, 7501),
    ("1B+120B", 50, 256, 256, "8/1/4/8", "1/1/1/256", "8/1/4/8", 16.6, 57.2, 54.0, 15258, 13081),
    ("1B+120B", 75, 256, 256, "8/1/4/8", "1/1/1/256", "8/1/4/8", 13.9, 63.2, 55.4, 15169, 13319),
    ("3B+120B", 50, 256, 256, "8/1/4/8", "2/1/1/128", "8/1/4/8", 21.5, 60.5, 66.2, 15093, 12420),
    ("3B+120B", 75, 256, 256, "8/1/4/8", "2/1/1/128", "8/1/4/8", 21.6, 60.5, 67.6, 15303, 12579),
    ("6B+120B", 50, 256, 256, "8/1/4/8", "2/1/1/128", "8/1/4/8", -0.7, 53.6, 68.0, 17890, 18020),
    ("7.2B+120B", 50, 256, 256, "8/1/4/8", "4/1/1/64", "8/1/4/8", -0.3, 53.6, 64.4, 17980, 18040),
    ("12B+120B", 50, 256, 256, "8/1/4/8", "4/1/1/64", "8/1/4/8", -8.0, 66.9, 69.6, 15860, 18190),
]
# Table A3: model, seq K, vis%, gpus, gbs, nmb, H layout, C-E, C-L, gain %, mem H/C, F+B ms H/C
A3 = [
    ("1B+7B", 16, 50, 16, 8, 2, "2/2/1/4", "1/1/1/16", "2/2/1/4", 6.6, 54.5, 50.2, 1300, 1221),
    ("1B+7B", 16, 75, 16, 8, 2, "2/2/1/4", "1/1/1/16", "2/2/1/4", 8.5, 59.6, 52.2, 1352, 1248),
    ("1B+7B", 32, 50, 16, 4, 2, "2/4/1/2", "1/1/1/16", "2/4/1/2", 11.7, 65.3, 50.7, 1836, 1644),
    ("1B+7B", 32, 75, 16, 4, 2, "2/4/1/2", "1/1/1/16", "2/4/1/2", 20.3, 75.6, 52.7, 1980, 1640),
    ("1B+7B", 64, 50, 32, 4, 2, "4/8/1/1", "1/1/1/32", "2/8/1/2", 34.3, 54.0, 48.4, 3966, 2937),
    ("1B+7B", 64, 75, 32, 4, 2, "4/8/1/1", "1/1/1/32", "2/8/1/2", 49.3, 68.9, 50.3, 4457, 2973),
    ("1B+7B", 128, 50, 64, 4, 2, "4/16/1/1", "1/1/1/64", "2/16/1/2", 17.8, 25.1, 48.6, 6321, 5381),
    ("1B+7B", 128, 75, 64, 4, 2, "4/16/1/1", "1/1/1/64", "2/16/1/2", 24.8, 26.6, 50.4, 6614, 5291),
    ("1B+14B", 16, 50, 16, 4, 1, "4/1/1/4", "2/1/1/8", "4/1/1/4", 0.1, 75.1, 73.8, 1202, 1205),
    ("1B+14B", 16, 75, 16, 4, 1, "8/1/1/2", "2/1/1/8", "4/1/1/4", 16.3, 50.4, 76.3, 1438, 1211),
    ("1B+14B", 32, 50, 32, 4, 1, "4/2/1/4", "2/1/1/16", "4/2/1/4", 2.9, 76.6, 67.8, 1628, 1583),
    ("1B+14B", 32, 75, 32, 4, 1, "8/2/1/2", "2/1/1/16", "4/2/1/4", 21.3, 53.5, 70.3, 1962, 1585),
    ("1B+14B", 64, 50, 32, 4, 2, "8/4/1/1", "2/1/1/16", "4/4/1/2", 23.9, 61.2, 69.1, 5687, 4579),
    ("1B+14B", 64, 75, 32, 4, 2, "8/4/1/1", "2/1/1/16", "4/4/1/2", 30.3, 73.2, 71.6, 5848, 4479),
    ("1B+14B", 128, 50, 64, 4, 2, "4/8/2/1", "2/1/1/32", "4/8/1/2", 29.8, 55.4, 63.0, 9397, 7184),
    ("1B+14B", 128, 75, 64, 4, 2, "4/8/2/1", "2/1/1/32", "4/8/1/2", 34.0, 55.8, 62.9, 9692, 7175),
]
# Table A4: model, seq K, vis%, gpus H, gbs, H layout, NC-E, NC-L, tokens/s gain %, mem H/NC, step ms H/NC
A4 = [
    ("6B+120B", 8, 50, 256, 256, "8/1/4/8", "1/1/1/8", "8/1/2/16", 5.9, 64.8, 76.6, 17700, 16710),
    ("6B+120B", 8, 75, 256, 256, "8/1/4/8", "1/1/1/8", "8/1/2/16", 4.4, 53.6, 76.8, 17600, 16860),
    ("6B+120B", 8, 50, 512, 512, "8/1/4/16", "1/1/1/8", "8/1/2/32", 4.0, 50.4, 73.5, 17870, 17180),
    ("6B+120B", 16, 50, 256, 256, "8/2/4/4", "1/1/1/8", "8/2/4/4", 0.7, 53.6, 53.6, 38380, 38110),
    ("6B+120B", 16, 75, 256, 256, "8/2/4/4", "2/1/1/4", "8/2/4/4", 3.3, 53.6, 63.8, 38120, 36900),
    ("6B+120B", 16, 50, 512, 512, "8/2/4/8", "1/1/1/8", "8/2/2/16", 5.1, 50.4, 74.6, 38400, 36550),
    ("7.2B+120B", 8, 50, 256, 256, "8/1/4/8", "1/1/1/8", "8/1/2/16", 7.1, 53.6, 76.6, 17980, 16790),
    ("7.2B+120B", 8, 75, 256, 256, "8/1/2/16", "1/1/1/8", "8/1/2/16", 13.0, 77.2, 73.3, 16210, 14340),
    ("7.2B+120B", 16, 50, 256, 256, "8/2/4/4", "1/1/1/8", "8/2/4/4", 5.5, 53.6, 63.2, 38260, 36260),
    ("7.2B+120B", 16, 75, 256, 256, "8/2/4/4", "2/1/1/4", "8/2/4/4", 3.6, 53.6, 63.8, 38380, 37070),
    ("7.2B+120B", 16, 50, 512, 512, "8/2/4/8", "1/1/1/8", "8/2/2/16", 4.9, 50.4, 74.6, 38450, 36650),
    ("12B+120B", 8, 50, 256, 256, "8/1/4/8", "2/1/1/4", "8/1/2/16", 7.3, 66.9, 73.1, 15860, 14780),
    ("12B+120B", 8, 75, 256, 256, "8/1/4/8", "2/1/1/4", "8/1/2/16", 12.7, 67.0, 73.3, 16690, 14810),
    ("12B+120B", 8, 87.5, 256, 256, "8/1/4/8", "2/1/1/4", "8/1/2/16", 9.5, 67.0, 73.4, 17020, 15540),
    ("12B+120B", 16, 50, 256, 256, "8/2/4/4", "2/1/1/4", "8/2/4/4", 5.6, 56.3, 63.2, 38430, 36400),
    ("12B+120B", 16, 50, 512, 512, "8/2/4/8", "2/1/1/4", "8/2/2/16", 2.5, 52.6, 74.6, 38370, 37430),
]


def _enc_recompute(enc: str) -> str:
    # "1B encoder rows no encoder recompute; larger encoder rows full encoder recompute"
    return "none" if enc == "1B" else "full"


def _searcher(model: str, seq: int, vis: float, gbs: int, mb: int, gpu: str,
              frozen: bool = False) -> LayoutSearch:
    enc, llm = model.split("+")
    spec = read_model(model_config(enc, llm, frozen))
    images = seq * vis / 100.0 / spec.encoders[0].tokens_per_item
    return LayoutSearch(spec, get_gpu(gpu), Work(seq, {"images": images}), gbs, mb,
                        grad_reduce_in_fp32=_SHAPES["grad_reduce_in_fp32"])


def _par(t: str, offset: int = 0, recompute: str = "none") -> Par:
    tp, cp, pp, dp = _t(t)
    return Par(tp, cp, pp, dp, tp > 1, recompute, offset)


def _row(table, model, seqk, vis, gpus, gbs, nmb, h, ce, cl, gain, mem_h, mem_c, ms_h, ms_c, gpu):
    enc = model.split("+")[0]
    seq = seqk * 1024
    rec = _enc_recompute(enc)
    frozen = encoders_frozen(table)
    hl = _par(h)
    mb_h = gbs // (hl.dp * nmb) if nmb else 1
    eh = _searcher(model, seq, vis, gbs, mb_h, gpu, frozen).evaluate(
        {"language": hl, "images": Par(sp=True, recompute=rec)}, homogeneous=True)
    cll = _par(cl)
    mb_c = gbs // (cll.dp * nmb) if nmb else 1
    off = 0 if table != "A4" else cll.size
    sc = _searcher(model, seq, vis, gbs, mb_c, gpu, frozen)
    ec = sc.evaluate({"language": cll, "images": _par(ce, off, rec)})
    # A3 reports forward + backward time (no optimizer step); A2 and A4 whole
    # steps. Gains are iso-GBS tokens/s: H time / C or NC time - 1.
    th, tc = eh.step_time, ec.step_time
    if table == "A3":
        th, tc = th - eh.update_time, tc - ec.update_time
    pred = (th / tc - 1) * 100
    return {
        "table": table, "model": model, "seq_k": seqk, "vis": vis, "gpus": gpus,
        "layout_h": h, "layout_e": ce, "layout_l": cl,
        "measured_gain": gain, "predicted_gain": round(pred, 1),
        "step_h_ms": (ms_h, round(th * 1e3)), "step_x_ms": (ms_c, round(tc * 1e3)),
        "mem_h_gb": (mem_h, round(eh.peak_memory / GB, 1)), "mem_x_gb": (mem_c, round(ec.peak_memory / GB, 1)),
        "encoders_frozen": frozen,
        "trainable_floor_ms": round(trainable_floor(sc, _par(ce, 0, rec), gbs, gpu) * 1e3),
    }


def trainable_floor(search: LayoutSearch, enc: Par, gbs: int, gpu: str) -> float:
    """Seconds a *trainable* encoder needs, at the very least, for one step's
    images on its ``enc.size`` GPUs: 2 FLOPs per parameter per token for the
    forward, again for a full recompute, twice for the backward (data and
    weight gradients), at the GPU's dense bf16 peak with no loss at all.
    On a dedicated island (Table A4) the step cannot be shorter."""
    m = search.model
    e = m.spec.encoders[0]
    params = sum(m.module_layers(e, Par(), 1.0, float(e.tokens_per_item), m.spec.language.hidden_size)[1])
    passes = 4 if enc.recompute == "full" else 3
    tokens = gbs * m.work.items(e.name) * e.tokens_per_item
    return 2 * passes * params * tokens / (enc.size * get_gpu(gpu).peak_flops)


def rows(table: str, gpu: str = "h100") -> list[dict]:
    out = []
    if table == "A2":
        for model, vis, gpus, gbs, h, ce, cl, gain, mh, mc, sh, sc in A2:
            out.append(_row("A2", model, 8, vis, gpus, gbs, 0, h, ce, cl, gain, mh, mc, sh, sc, gpu))
    elif table == "A3":
        for r in A3:
            out.append(_row("A3", *r, gpu))
    else:
        for model, seqk, vis, gpus, gbs, h, ce, cl, gain, mh, mc, sh, sc in A4:
            out.append(_row("A4", model, seqk, vis, gpus, gbs, 0, h, ce, cl, gain, mh, mc, sh, sc, gpu))
    return out


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def metrics(table: str, rs: list[dict], gpu: str = "h100") -> dict:
    ratios = [p / m for r in rs for m, p in (r["step_h_ms"], r["step_x_ms"])]
    mems = [(m, p) for r in rs for m, p in (r["mem_h_gb"], r["mem_x_gb"])]
    meas = [r["measured_gain"] if r["measured_gain"] is not None else 0.0 for r in rs]
    pred = [r["predicted_gain"] for r in rs]
    out = {
        "rows": len(rs),
        "spearman_gain": round(spearman(meas, pred), 3),
        "step_ratio_median": round(statistics.median(ratios), 3),
        "step_ratio_within_0.5_2": round(sum(0.5 <= x <= 2.0 for x in ratios) / len(ratios), 3),
        "memory_within_40pct": round(sum(abs(p / m - 1) <= 0.4 for m, p in mems) / len(mems), 3),
        "max_predicted_memory_gb": max(p for _, p in mems),
    }
    big = {"A2": 11, "A3": 10, "A4": 5}[table]
    hits = [p > 0 for m, p in zip(meas, pred) if m >= big]
    out["big_gains_predicted"] = all(hits)
    out["big_gains_hit"] = f"{sum(hits)}/{len(hits)}"
    if table == "A4":
        # share of the dense peak a trainable island would have to sustain
        need = [r["trainable_floor_ms"] / r["step_x_ms"][0] for r in rs]
        rate = get_gpu(gpu).gemm_efficiency
        out["nc_trainable_needs_over_gemm_rate"] = f"{sum(x > rate for x in need)}/{len(need)}"
        out["nc_trainable_needs_over_peak"] = f"{sum(x > 1 for x in need)}/{len(need)}"
    if table == "A2":
        slow = [p < 8 for m, p in zip(meas, pred) if m <= 0]
        out["par_or_slower_below_8"] = all(slow)
        out["par_or_slower_hit"] = f"{sum(slow)}/{len(slow)}"
    return out


def crossover(gpu: str = "h100") -> dict:
    """The 120B operating-range claim at 8K, 50% vision (Table A5), with the
    paper's layouts: for 1B and 3B encoders colocated (Table A2's layout)
    beats homogeneous; from 6B on, non-colocated (Table A4's layout, 256 + 8
    GPUs, tokens/s at the same global batch) beats the best colocated
    layout, the faster of Table A2's and the homogeneous one (a special case
    of colocated; the paper reports C = H there). Predicted gains in %."""
    out = {}
    by_model = {r[0]: r for r in A2 if r[0].endswith("+120B") and r[1] == 50}
    for model, r in by_model.items():
        enc = model.split("+")[0]
        rec = _enc_recompute(enc)
        # 1B/3B: Table A2's workload; 6B on: Table A4's (all three modes alike)
        frozen = encoders_frozen("A2" if enc in ("1B", "3B") else "A4")
        s = _searcher(model, 8192, 50, 256, 1, gpu, frozen)
        h = s.evaluate({"language": _par(r[4]), "images": Par(sp=True, recompute=rec)}, homogeneous=True)
        c = s.evaluate({"language": _par(r[6]), "images": _par(r[5], 0, rec)})
        best_c = min(c.step_time, h.step_time)
        entry = {"colocated_vs_h": round((h.step_time / c.step_time - 1) * 100, 1)}
        nc = [x for x in A4 if x[0] == model and x[1] == 8 and x[2] == 50 and x[3] == 256]
        if nc:
            _, _, _, _, _, _, ne, nl, *_ = nc[0]
            lp = _par(nl)
            e = s.evaluate({"language": lp, "images": _par(ne, lp.size, rec)})
            entry["non_colocated_vs_best_c"] = round((best_c / e.step_time - 1) * 100, 1)
        out[model] = entry
    small = [v["colocated_vs_h"] > 0 for m, v in out.items() if m.split("+")[0] in ("1B", "3B")]
    large = [v.get("non_colocated_vs_best_c", -1) > 0 for m, v in out.items()
             if m.split("+")[0] in ("6B", "7.2B", "12B")]
    return {"rows": out, "colocated_beats_h_small": all(small), "non_colocated_beats_c_large": all(large)}


def _fmt(r: dict) -> str:
    g = "on par" if r["measured_gain"] is None else f"{r['measured_gain']:+.1f}"
    seq = f"{r['seq_k']}K"
    return (f"| {r['table']} | {r['model']} | {seq} | {r['vis']} | {r['gpus']} | {r['layout_h']} | "
            f"{r['layout_e']} | {r['layout_l']} | {r['step_h_ms'][0]:,} / {r['step_h_ms'][1]:,} | "
            f"{r['step_x_ms'][0]:,} / {r['step_x_ms'][1]:,} | {r['mem_h_gb'][0]} / {r['mem_h_gb'][1]} | "
            f"{r['mem_x_gb'][0]} / {r['mem_x_gb'][1]} | {g} | {r['predicted_gain']:+.1f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--table", choices=["A2", "A3", "A4"], action="append")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--json", action="store_true")
    p.add_argument("--shapes", default="ours",
                   help="model shapes of the paper's sizes: ours, or for the robustness check deep / wide / "
                        "narrow, gated (swiglu LLMs), mha (gated with multi-head attention), random:SEED")
    p.add_argument("--encoders", choices=ENCODER_MODES, default="paper",
                   help="encoders trainable, frozen (projectors trainable), or as the paper's evidence says "
                        "(default: A2/A3 trainable, A4 frozen)")
    p.add_argument("--grad-reduce", choices=["bf16", "fp32"], default="bf16",
                   help="gradient buffers and DP reduction: bf16 as the paper's memory shows (default), "
                        "or fp32 as mimo's trainer defaults to")
    args = p.parse_args(argv)
    try:
        use_shapes(args.shapes, args.encoders, args.grad_reduce == "fp32")
    except ValueError as exc:
        print(f"error: --shapes: {exc}", file=sys.stderr)
        return 2
    try:
        get_gpu(args.gpu)
    except ValueError as exc:
        print(f"error: --gpu: {exc}", file=sys.stderr)
        return 2
    report = {}
    for t in args.table or ["A2", "A3", "A4"]:
        rs = rows(t, args.gpu)
        report[t] = {"rows": rs, "metrics": metrics(t, rs, args.gpu)}
    if not args.table or "A4" in args.table:
        report["crossover"] = crossover(args.gpu)
    if args.json:
        print(json.dumps(report))
        return 0
    print("| table | model | seq | vis% | GPUs | H | C/NC-E | C/NC-L | step ms H meas / pred | "
          "step ms C/NC meas / pred | mem GB H meas / pred | mem GB C/NC meas / pred | gain meas % | gain pred % |")
    print("|" + "---|" * 14)
    for t, rep in report.items():
        if t != "crossover":
            for r in rep["rows"]:
                print(_fmt(r))
    print()
    for t, rep in report.items():
        if t != "crossover":
            print(f"{t}: " + ", ".join(f"{k} {v}" for k, v in rep["metrics"].items()))
    if "crossover" in report:
        x = report["crossover"]
        print("crossover (120B, 8K, 50%): " + "; ".join(
            f"{m}: " + ", ".join(f"{k} {v:+.1f}" for k, v in e.items()) for m, e in x["rows"].items())
            + f"; colocated_beats_h_small {x['colocated_beats_h_small']}, "
              f"non_colocated_beats_c_large {x['non_colocated_beats_c_large']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
