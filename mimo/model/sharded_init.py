"""Sharded initialisation: each rank draws only the parameters of its own part.

Every parameter's full (unsharded) initial value is a pure function of
(training.seed, module name, the parameter's global name): it is drawn from a
torch.Generator seeded from those three alone, so it does not depend on which
other parameters a rank holds, in what order it builds them, or the layout.
A rank draws one full parameter at a time and keeps its tensor-parallel slice
(the same slicing as reference init), so host memory stays at one part plus
the largest single parameter, and two layouts start bit-identical.

The distributions are the ones the modules would get from their own
initialisation: megatron's normal(0, init_method_std) for weights, the
output-layer scaling std / sqrt(2 * num_layers) for the layers that write
into the residual stream, zero biases, unit norm weights, and torch's default
for the plain torch layers of the encoders' front-ends.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Optional, Tuple

import torch

from mimo.config import LANGUAGE, MimoConfig

from .reference_init import ExpertShard, copy_shard, full_shape, source_name, tp_of
from .transformer_config import INIT_METHOD_STD

# (pattern on the parameter's global name, kind); the first match wins. Names are
# those of GPTModel (LLM) and EncoderWithProjector (encoder + projector).
_RULES: Tuple[Tuple[str, str], ...] = (
    (r"(^|\.)(linear_proj|linear_fc2)\.weight$", "scaled_normal"),
    (r"(^|\.)(linear_qkv|linear_fc1|linear|output_layer|word_embeddings)\.weight$", "normal"),
    (r"^encoder\.(class_embedding|position_embeddings)$", "normal"),
    (r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|linear)\.bias$", "zeros"),
    (r"(^|\.)\w*norm\.weight$", "ones"),
    (r"(^|\.)\w*norm\.bias$", "zeros"),
    # MoE (megatron-core's init_method for both): the router's gate and a shared expert's sigmoid gate.
    (r"(^|\.)mlp\.router\.(weight|bias)$", "normal"),
    (r"(^|\.)shared_experts\.gate_weight$", "normal"),
    (r"^encoder\.(patch_embed|conv1|conv2|frame_embed)\.(weight|bias)$", "torch_default"),
)


def init_kind(name: str) -> str:
    """How the parameter `name` (global name) is initialised; unknown names are an error, so
    no parameter is ever left with the uninitialised memory megatron hands out."""
    for pattern, kind in _RULES:
        if re.search(pattern, name):
            return kind
    raise ValueError(f"sharded init has no rule for parameter {name!r}; add one to mimo/model/sharded_init.py")


def param_seed(seed: int, module: str, name: str) -> int:
    """The generator seed of one parameter: training.seed, module and global parameter name only."""
    return (seed * 1_000_003 + zlib.crc32(f"{module}/{name}".encode())) % (2 ** 63)


def draw(kind: str, shape: torch.Size, generator: torch.Generator, scaled_std: float,
         fan_in: int) -> torch.Tensor:
    """The full fp32 initial value (megatron draws its master weights in fp32 too)."""
    out = torch.empty(shape, dtype=torch.float32)
    if kind == "normal":
        return out.normal_(0.0, INIT_METHOD_STD, generator=generator)
    if kind == "scaled_normal":
        return out.normal_(0.0, scaled_std, generator=generator)
    if kind == "zeros":
        return out.zero_()
    if kind == "ones":
        return out.fill_(1.0)
    if kind == "torch_default":
        # torch's Linear / Conv default (kaiming_uniform with a = sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        # for the weight, and the same bound for the bias.
        bound = 1.0 / math.sqrt(fan_in)
        return out.uniform_(-bound, bound, generator=generator)
    raise ValueError(f"unknown init kind {kind!r}")


def scaled_std(cfg: MimoConfig, module: str, name: str) -> float:
    """megatron's output-layer std: init_method_std / sqrt(2 * num_layers) of the whole module.

    A projector is built from the LLM's config, so it is scaled by the LLM's depth."""
    if module == LANGUAGE or name.startswith("projector."):
        layers = cfg.model.language.num_layers
    else:
        layers = cfg.model.encoders[module].num_layers
    return INIT_METHOD_STD / math.sqrt(2.0 * layers)


def init_sharded(part: torch.nn.Module, cfg: MimoConfig, module: str, layer_offset: int, tp_rank: int,
                 tp_size: int, experts: Optional[ExpertShard] = None) -> None:
    """Initialise every parameter of this rank's part of `module` (whose first layer is global
    layer `layer_offset`) as the TP rank `tp_rank` of `tp_size` slice of its full value. Routed
    experts (`experts`: this rank's ExpertShard) draw by their global index and are sliced by expert TP."""
    for name, p in part.named_parameters():
        # a tied copy draws the embedding's value
        gname = source_name(name, p, layer_offset, experts.offset if experts else 0)
        rank, size = tp_of(name, tp_rank, tp_size, experts)
        kind = init_kind(gname)
        fan_in = 0
        if kind == "torch_default":
            # Front-end layers are never TP-split: the local weight has the full shape.
            weight = part.get_parameter(name.rsplit(".", 1)[0] + ".weight")
            fan_in = math.prod(weight.shape[1:])
        generator = torch.Generator().manual_seed(param_seed(cfg.training.seed, module, gname))
        full = draw(kind, full_shape(p, size), generator, scaled_std(cfg, module, gname), fan_in)
        copy_shard(name, p, full, rank, size)
