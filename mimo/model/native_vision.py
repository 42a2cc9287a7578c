"""Native-resolution vision encoder of Qwen2-VL / Qwen2.5-VL from megatron-core parts.

Images of any size arrive as the HF processor emits them: `patches`
[Σ t·h·w, C·T·P·P] (each patch's pixels flattened, the patches of one image
consecutive, in merge-block order: the spatial_merge_size² patches that the
patch merger later fuses into one LLM token are adjacent) and their `grids`,
(t, h, w) in patches per image, a host-side Python list. All images of a call
form one sequence (megatron's [s, b=1, h]); attention never crosses images:

* full-attention layers see their frame (HF: one `cu_seqlens` segment per
  frame, so a still image sees itself);
* window layers (Qwen2.5-VL) see their window of window_size pixels, i.e.
  window_size / patch_size / spatial_merge_size merge units per side.

Both are document ids for one token each: the encoder hands the block an int64
tensor [2, 2, 1, s] holding the bitfield mask in tensor form (bits, document
ids) for full layers ([0]) and window layers ([1]); each layer's core
attention picks its row by its global layer index. HF permutes tokens into window order
to make windows contiguous for its kernels; attention restricted by the ids is
permutation-equivariant, so the tokens stay in processor order here and need no
permutation back.

Positions are 2-D rotary: half of each head's rotary frequencies encode the
patch row, half the column (HF's VisionRotaryEmbedding), handed to megatron's
TransformerBlock as `rotary_pos_emb`: megatron's apply_rotary_pos_emb
(rotate-half, non-interleaved) is HF's apply_rotary_pos_emb_vision when the
angle table is [row, column, row, column] frequencies.
"""

from __future__ import annotations

import functools
import numbers
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from mimo.attention.core_attention import BitfieldCoreAttention
from mimo.attention.mask import TEXT
from mimo.config.kernel import KernelConfig

from .architecture import ACTIVATION_FUNCS
from .sdpa_attention import SDPACoreAttention
from .sequence_parallel import full_sequence, shard_sequence
from .specs import encoder_layer_spec

Grid = Tuple[int, int, int]

# Rows of the per-layer mask tensor.
FULL, WINDOW = 0, 1
# HF's vision towers fix their norms' epsilon and RoPE base.
QWEN_VISION_NORM_EPS = 1e-6
QWEN_VISION_ROPE_THETA = 10000.0


def check_grids(grids, merge: int) -> List[Grid]:
    if not isinstance(grids, (list, tuple)) or not grids:
        raise ValueError(f"grids must be a non-empty host-side list of (t, h, w), got {type(grids).__name__}")
    out = []
    for g in grids:
        # Host integers only: a device tensor here would mean a device read on every call.
        if (isinstance(g, torch.Tensor) or len(g) != 3
                or not all(isinstance(x, numbers.Integral) and not isinstance(x, torch.Tensor) and x > 0 for x in g)):
            raise ValueError(f"grids: each entry must be three positive host integers (t, h, w), got {g!r}")
        t, h, w = (int(x) for x in g)
        if h % merge or w % merge:
            raise ValueError(f"grids: h and w of {(t, h, w)} must be multiples of spatial_merge_size {merge}")
        out.append((t, h, w))
    return out


def merge_block_rows_cols(h: int, w: int, merge: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Patch row and column ids of one frame in merge-block order (HF's rot_pos_emb)."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    block = (h // merge, merge, w // merge, merge)
    return (rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten())


def frame_ids(grids: Sequence[Grid]) -> torch.Tensor:
    """One id per frame of every image: full-attention layers attend within a frame."""
    counts = torch.tensor([h * w for t, h, w in grids for _ in range(t)])
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def window_ids(grids: Sequence[Grid], merge: int, units: int) -> torch.Tensor:
    """One id per window (Qwen2.5-VL's get_window_index): windows of `units` x `units` merge units
    tile each frame from its top-left corner (the last row/column of windows may be smaller)."""
    out, offset = [], 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        nh, nw = -(-mh // units), -(-mw // units)
        unit = (torch.arange(mh)[:, None] // units) * nw + torch.arange(mw)[None, :] // units
        per_frame = unit.flatten().repeat_interleave(merge * merge)  # the merge block's patches share it
        frames = per_frame[None] + torch.arange(t)[:, None] * (nh * nw)
        out.append(frames.flatten() + offset)
        offset += t * nh * nw
    return torch.cat(out)


def layer_masks(grids: Sequence[Grid], merge: int, window_units: int) -> torch.Tensor:
    """int64 [2 (full, window), 2 (bits, document ids), 1, s]: bitfield masks in tensor form.

    Every token is bidirectional (bit TEXT); the document ids keep frames
    (full layers) or windows (window layers) apart. `window_units` 0: no windows.
    """
    full = frame_ids(grids)
    window = window_ids(grids, merge, window_units) if window_units else full
    bits = torch.full_like(full, TEXT)
    return torch.stack([torch.stack([bits, full]), torch.stack([bits, window])])[:, :, None, :]


class _LayerMask:
    """Core attention that uses the full-attention or the window mask, by its global layer index.

    megatron numbers a block's layers from 1 (HF's fullatt_block_indexes count
    from 0 over the whole tower). A pipeline stage is a block of its own whose
    numbering restarts at 1, so `layer_offset` (the global index of the stage's
    first layer) makes the index global: full_attention_layers name layers of
    the whole encoder, wherever the stage boundaries fall.
    """

    def __init__(self, config, layer_number, *args, full_attention_layers=None, layer_offset=0, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        index = layer_offset + layer_number - 1
        self.full_attention = full_attention_layers is None or index in full_attention_layers

    def layer_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return attention_mask[FULL if self.full_attention else WINDOW]


class NativeBitfieldAttention(_LayerMask, BitfieldCoreAttention):
    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        return super().forward(query, key, value, self.layer_mask(attention_mask), *args, **kwargs)


class NativeSDPAAttention(_LayerMask, SDPACoreAttention):
    """The dense equivalent: a [b, 1, s, s] mask, True where the document ids differ (megatron's
    convention: True = may not attend)."""

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        ids = self.layer_mask(attention_mask)[1]
        return super().forward(query, key, value, (ids[:, :, None] != ids[:, None, :])[:, None], *args, **kwargs)


def native_layer_spec(attention: str, full_attention_layers, layer_offset: int = 0, kernel=None):
    """`kernel`: the bitfield kernels' KernelConfig fields (the encoder's `attention_kernel`)."""
    spec = encoder_layer_spec(attention)
    core = {"bitfield": NativeBitfieldAttention, "sdpa": NativeSDPAAttention}[attention]
    extra = {"kernel_config": KernelConfig(**kernel)} if kernel and attention == "bitfield" else {}
    spec.submodules.self_attention.submodules.core_attention = functools.partial(
        core, full_attention_layers=full_attention_layers, layer_offset=layer_offset, **extra)
    return spec


class NativeVisionEncoder(MegatronModule):
    """Qwen2-VL / Qwen2.5-VL ViT: patches [Σ t·h·w, C·T·P·P] + grids -> tokens [Σ t·h·w, hidden].

    Parameters: `patch_embed.weight` [hidden, C, T, P, P] (HF's Conv3d weight;
    kernel = stride = the patch, so it is one linear map of the flattened patch)
    and `block.layers.{i}.…` (megatron's TransformerLayer). No final norm: the
    patch merger's norm follows.

    A pipeline stage (`mimo.model.encoder_stages`) builds it with its share of
    the layers (`config.num_layers`) and the global index of its first one
    (`layer_offset`); it then runs `embed` (first stage only) and `run_block`.
    """

    def __init__(self, config, enc, pg_collection, layer_offset: int = 0):
        super().__init__(config=config)
        if enc.attention not in ("bitfield", "sdpa"):
            raise ValueError(f"attention must be bitfield or sdpa for a native-resolution encoder, got {enc.attention!r}")
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism (parallelism cp > 1) is not supported by the native-resolution "
                             "vision encoder; its images are one packed sequence split by sequence parallelism")
        if enc.position_embedding != "rope2d":
            raise ValueError(f"position_embedding must be rope2d for resolution native, got {enc.position_embedding!r}")
        self.tp_group = pg_collection.tp
        self.merge = enc.spatial_merge_size
        self.patch_shape = (enc.num_channels, enc.temporal_patch_size, enc.patch_size, enc.patch_size)
        if enc.window_size:
            self.window_units = enc.window_size // enc.patch_size // enc.spatial_merge_size
            if self.window_units < 1:
                raise ValueError(f"window_size {enc.window_size} is smaller than one merge unit "
                                 f"({enc.patch_size * enc.spatial_merge_size} pixels)")
            full_layers = tuple(enc.full_attention_layers or ())
            bad = [i for i in full_layers if not 0 <= i < enc.num_layers]  # global indices, whole encoder
            if bad:
                raise ValueError(f"full_attention_layers {bad} outside 0..{enc.num_layers - 1}")
        else:
            self.window_units, full_layers = 0, None  # every layer sees its whole frame
        # HF's Conv3d, whose weight layout it keeps; kernel = stride = the patch, so it is applied
        # as one linear map of the flattened patch (the processor's layout: C, T, P, P). torch's
        # default init, like the fixed-resolution patch embedding (and sharded init's rule for it).
        self.patch_embed = torch.nn.Conv3d(enc.num_channels, config.hidden_size, kernel_size=self.patch_shape[1:],
                                           stride=self.patch_shape[1:], bias=False, dtype=config.params_dtype)
        # Row and column each take half of the rotary frequencies: megatron's table for a
        # head_dim / 2 rotary dimension has head_dim / 4 frequencies, HF's axial inv_freq.
        head_dim = config.kv_channels
        if head_dim % 4:
            raise ValueError(f"2-D rotary positions need a head dimension divisible by 4, got {head_dim}")
        self.rotary = RotaryEmbedding(head_dim // 2, rotary_percent=1.0, rotary_base=QWEN_VISION_ROPE_THETA,
                                      use_cpu_initialization=True, cp_group=getattr(pg_collection, "cp", None))
        self.block = TransformerBlock(config=config,
                                      spec=TransformerBlockSubmodules(
                                          layer_specs=[native_layer_spec(enc.attention, full_layers, layer_offset,
                                                                         enc.attention_kernel)]
                                          * config.num_layers),
                                      pre_process=True, post_process=True, post_layer_norm=False,
                                      pg_collection=pg_collection)

    def rotary_pos_emb(self, grids: Sequence[Grid], device) -> torch.Tensor:
        """Angles [s, 1, 1, head_dim]: [row freqs, column freqs] twice (rotate-half layout)."""
        rows, cols = zip(*(merge_block_rows_cols(h, w, self.merge) for _, h, w in grids))
        reps = [t for t, _, _ in grids]
        rows = torch.cat([r.repeat(t) for r, t in zip(rows, reps)])
        cols = torch.cat([c.repeat(t) for c, t in zip(cols, reps)])
        side = max(max(h, w) for _, h, w in grids)
        table = self.rotary.get_freqs_non_repeated(side)  # [side, head_dim / 4], on the host
        half = torch.cat([table[rows], table[cols]], dim=-1)
        return torch.cat([half, half], dim=-1)[:, None, None, :].to(device, non_blocking=True)

    def forward(self, patches: torch.Tensor, grids) -> torch.Tensor:
        grids = check_grids(grids, self.merge)
        return self.run_block(self.embed(patches, grids), grids, first=True, last=True)[:, 0]

    def embed(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Patches [Σ t·h·w, C·T·P·P] of checked `grids` -> the first layer's input [Σ t·h·w, 1, hidden]."""
        total = sum(t * h * w for t, h, w in grids)
        width = self.patch_shape[0] * self.patch_shape[1] * self.patch_shape[2] * self.patch_shape[3]
        if patches.dim() != 2 or tuple(patches.shape) != (total, width):
            raise ValueError(f"patches must be [{total}, {width}] for grids {grids}, got {list(patches.shape)}")
        w = self.patch_embed.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1))[:, None, :]  # [s, b=1, hidden]

    def run_block(self, h: torch.Tensor, grids: Sequence[Grid], first: bool, last: bool) -> torch.Tensor:
        """This block's layers on the packed sequence of checked `grids` ([s, 1, hidden], sequence-first).

        Whole in at the first stage and out at the last; between pipeline stages
        this rank's sequence-parallel shard travels as it is. Every stage makes
        the masks and the rotary table itself, from the host-side grids."""
        total = sum(t * hh * w for t, hh, w in grids)
        tp = self.config.tensor_model_parallel_size
        if self.config.sequence_parallel and total % tp:
            raise ValueError(f"sequence parallelism splits the {total} patches over tp={tp} ranks: the total must "
                             f"be a multiple of tp (set parallelism sp: false, or batch images accordingly)")
        masks = layer_masks(grids, self.merge, self.window_units).to(h.device, non_blocking=True)
        if first:
            h = shard_sequence(h, self.config, self.tp_group)
        h = self.block(h, attention_mask=masks, rotary_pos_emb=self.rotary_pos_emb(grids, h.device))
        return full_sequence(h, self.config, self.tp_group) if last else h


class PatchMerger(MegatronModule):
    """Qwen2-VL's patch merger: norm each patch, concatenate each merge block's
    spatial_merge_size² patches, Linear -> GELU -> Linear to the LLM width.

    fc1 is column parallel and fc2 row parallel over the encoder's TP group
    (megatron's MLP pattern); input and output are whole, replicated over TP.
    Parameters: `norm.weight` (+ `norm.bias` for LayerNorm), `linear_fc1.*`, `linear_fc2.*`.
    """

    def __init__(self, config, encoder_hidden: int, spatial_merge_size: int, normalization: str, tp_group,
                 activation: str = "gelu"):
        super().__init__(config=config)
        norms = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if normalization not in norms:
            raise ValueError(f"normalization must be RMSNorm or LayerNorm for the patch merger, got {normalization!r}")
        self.units = spatial_merge_size ** 2
        width = encoder_hidden * self.units
        self.norm = norms[normalization](encoder_hidden, eps=QWEN_VISION_NORM_EPS, dtype=config.params_dtype)
        self.activation = ACTIVATION_FUNCS[activation][0]
        self.linear_fc1 = ColumnParallelLinear(width, width, config=config, init_method=config.init_method,
                                               bias=True, gather_output=False, tp_group=tp_group)
        self.linear_fc2 = RowParallelLinear(width, config.hidden_size, config=config,
                                            init_method=config.output_layer_init_method, bias=True,
                                            input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[Σ patches, encoder_hidden] -> [Σ patches / merge², llm_hidden]."""
        n, hidden = tokens.shape
        if n % self.units:
            raise ValueError(f"patch merger: {n} patches are not whole merge blocks of {self.units}")
        x = self.norm(tokens).reshape(n // self.units, 1, hidden * self.units)  # megatron linears: [s, b, h]
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(self.activation(x))
        return x[:, 0]
