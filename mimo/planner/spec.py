"""The planner's own, deliberately small reading of a model config.

It accepts a plain dict (parsed YAML) or an object with the same attribute
names (``mimo.config`` dataclasses), applies the config defaults and checks
only what the cost model needs, raising ``ValueError`` with a dotted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from mimo.config.schema import ACTIVATIONS, EncoderConfig
from mimo.planner.native import NativeViT


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    kind: str                  # language | vision | audio
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    frozen: bool
    # swiglu's MLP is gated: its first linear layer is two ffn-wide halves (gate, up).
    gated: bool = False
    head_dim: int = 0                  # kv_channels; 0: hidden_size / num_attention_heads
    vocab_size: int = 0                # language only
    tie_embeddings: bool = False       # language only: the output layer reuses the embedding
    tokens_per_item: int = 0           # encoders: tokens one image / clip becomes (in the encoder)
    input_features: int = 0            # encoders: features per token entering the embed
    projector_kind: str | None = None  # encoders: mlp | linear | patch_merger | None
    projector_frozen: bool = False
    class_token: bool = False          # vision: a class token (CLIP) runs through the layers too
    # Native-resolution vision (Qwen2-VL / Qwen2.5-VL): the ViT's geometry. Each image has its own
    # size; the planner costs every image as its reference image (`NativeViT.reference_grid`: a
    # square image at max_pixels), so tokens_per_item is that image's patches.
    native: NativeViT | None = None
    # Keys per query, when set: the balancers fit per-patch and per-pair costs with it.
    attention_keys: float | None = None
    # Mixture of experts (language only; docs/moe.md): experts per MoE layer (0: dense), experts
    # per token, each expert's FFN width, the shared expert's (0: none), and which layers are MoE.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn: int = 0
    moe_shared_ffn: int = 0
    moe_layers: tuple[bool, ...] = ()
    moe_bias: bool = False             # biased linear layers (add_bias_linear): experts then need etp 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_mlp_params(self) -> tuple[int, int, int]:
        """Parameters of one MoE layer's MLP: (router, ALL routed experts, shared expert)."""
        per = (3 if self.gated else 2) * self.hidden_size
        return self.hidden_size * self.num_experts, self.num_experts * per * self.moe_ffn, per * self.moe_shared_ffn

    def layer_linear_flops(self, i: int) -> float:
        """Forward matmul FLOPs per token of transformer layer ``i``: QKV and the attention
        output projection, then the dense MLP or, in an MoE layer, its ACTIVE parameters (router,
        the top-k experts, the shared expert). Equal to mimo.training.flops' count."""
        h, q = self.hidden_size, self.attention_width
        kv = self.num_query_groups * self.kv_channels
        attention = 2 * h * (q + 2 * kv) + 2 * q * h
        if self.moe_layers and self.moe_layers[i]:
            router, experts, shared = self.moe_mlp_params()
            return attention + 2 * (router + experts * self.moe_topk / self.num_experts + shared)
        return attention + 2 * (self.mlp_in_width + self.ffn_hidden_size) * h

    @property
    def is_language(self) -> bool:
        return self.kind == "language"

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_width(self) -> int:
        """Width of the query heads (and of the attention output projection's input)."""
        return self.num_attention_heads * self.kv_channels

    @property
    def llm_tokens_per_item(self) -> int:
        """LLM tokens one item becomes (a native ViT's patch merger joins merge^2 patches)."""
        return self.tokens_per_item // self.native.merge_tokens if self.native else self.tokens_per_item

    @property
    def keys_per_query(self) -> float:
        """Keys each token attends to, averaged over the layers: the whole item, or for a native
        ViT with window layers the reference image's pairs per patch and layer."""
        if self.attention_keys is not None:
            return float(self.attention_keys)
        if self.native is None:
            return float(self.tokens_per_item)
        grid = self.native.reference_grid()
        return self.native.pairs(grid) / (self.num_layers * self.tokens_per_item)

    @property
    def mlp_in_width(self) -> int:
        """Output width of the MLP's first linear layer."""
        return (2 if self.gated else 1) * self.ffn_hidden_size


@dataclass(frozen=True)
class ModelSpec:
    language: ModuleSpec
    encoders: tuple[ModuleSpec, ...] = field(default_factory=tuple)

    @property
    def modules(self) -> tuple[ModuleSpec, ...]:
        return (self.language,) + self.encoders

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


# Far above any real model, low enough that the planner's arithmetic stays in
# float range and its per-layer lists stay small.
MAX_SIZE = 2 ** 40
MAX_LAYERS = 10_000


def _int(obj: Any, key: str, path: str, default: Any = None, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    value = _get(obj, key, default)
    if value is None:
        raise ValueError(f"{path}.{key}: required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}.{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{path}.{key}: must be >= {minimum}")
    if value > maximum:
        raise ValueError(f"{path}.{key}: {value} is beyond what the planner costs (at most {maximum})")
    return value


def _bool(obj: Any, key: str, path: str, default: bool = False) -> bool:
    value = _get(obj, key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{path}.{key}: expected true/false, got {value!r}")
    return value


def _transformer(obj: Any, path: str) -> dict:
    hidden = _int(obj, "hidden_size", path)
    heads = _int(obj, "num_attention_heads", path)
    groups = _int(obj, "num_query_groups", path, default=heads)
    # None (the config dataclass's default) or absent: hidden_size / heads.
    head_dim = 0 if _get(obj, "kv_channels") is None else _int(obj, "kv_channels", path)
    if not head_dim and hidden % heads:
        raise ValueError(f"{path}.hidden_size: not divisible by num_attention_heads (set kv_channels)")
    activation = _get(obj, "activation", "gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{path}.activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if heads % groups:
        raise ValueError(f"{path}.num_query_groups: must divide num_attention_heads")
    return dict(
        num_layers=_int(obj, "num_layers", path, maximum=MAX_LAYERS),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=_int(obj, "ffn_hidden_size", path, default=4 * hidden),
        frozen=_bool(obj, "frozen", path),
        gated=activation == "swiglu",
        head_dim=head_dim,
    )


def _encoder(name: str, obj: Any) -> ModuleSpec:
    path = f"model.encoders.{name}"
    if name == "language":
        raise ValueError(f"{path}: 'language' is reserved for the LLM")
    kind = _get(obj, "kind")
    common = _transformer(obj, path)
    native = None
    if kind == "vision" and _get(obj, "resolution", "fixed") == "native":
        native = _native(obj, path, common["num_layers"])
        tokens, features = _patches(native.reference_grid()), native.patch_features
    elif kind == "vision":
        image, patch = _int(obj, "image_size", path), _int(obj, "patch_size", path)
        if image % patch:
            raise ValueError(f"{path}.image_size: not divisible by patch_size")
        tokens, features = (image // patch) ** 2, 3 * patch * patch
    elif kind == "audio":
        mel = _int(obj, "num_mel_bins", path, default=16)
        frames = _int(obj, "clip_frames", path, default=64)
        per_token = _int(obj, "frames_per_token", path, default=4)
        if frames % per_token:
            raise ValueError(f"{path}.clip_frames: not divisible by frames_per_token")
        tokens, features = frames // per_token, mel * per_token
    else:
        raise ValueError(f"{path}.kind: expected vision or audio, got {kind!r}")
    proj = _get(obj, "projector")
    if proj is not None and not isinstance(proj, Mapping) and not hasattr(proj, "kind"):
        raise ValueError(f"{path}.projector: expected a mapping (kind, frozen), got {proj!r}")
    proj_kind = _get(proj, "kind", "mlp") if proj is not None else "mlp"
    if native is not None and proj_kind != "patch_merger":
        raise ValueError(f"{path}.projector.kind: resolution native needs patch_merger, got {proj_kind!r}")
    if native is None and proj_kind not in ("mlp", "linear"):
        raise ValueError(f"{path}.projector.kind: expected mlp or linear, got {proj_kind!r}")
    proj_frozen = _bool(proj, "frozen", f"{path}.projector") if proj is not None else False
    return ModuleSpec(name=name, kind=kind, tokens_per_item=tokens, input_features=features,
                      projector_kind=proj_kind, projector_frozen=proj_frozen,
                      class_token=kind == "vision" and native is None and _bool(obj, "class_token", path),
                      native=native, **common)


def _default(key: str) -> Any:
    return EncoderConfig.__dataclass_fields__[key].default


def _patches(grid) -> int:
    t, h, w = grid
    return t * h * w


def _native(obj: Any, path: str, num_layers: int) -> NativeViT:
    """A native-resolution ViT's geometry (defaults as the config's)."""
    ints = {k: _int(obj, k, path, default=_default(k)) for k in
            ("temporal_patch_size", "spatial_merge_size", "num_channels", "min_pixels", "max_pixels")}
    patch = _int(obj, "patch_size", path)
    window = _int(obj, "window_size", path, default=0, minimum=0)
    full = _get(obj, "full_attention_layers") or []
    if not isinstance(full, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in full):
        raise ValueError(f"{path}.full_attention_layers: expected a list of layer indices, got {full!r}")
    if ints["min_pixels"] > ints["max_pixels"]:
        raise ValueError(f"{path}.min_pixels: exceeds max_pixels")
    return NativeViT(num_layers, patch, window_size=window, full_attention_layers=tuple(full), **ints)


def _moe(obj: Any, path: str, common: dict) -> dict:
    """The LLM's mixture-of-experts fields (defaults as the config's); {} for a dense LLM."""
    if _get(obj, "num_moe_experts") is None:
        return {}
    experts = _int(obj, "num_moe_experts", path)
    topk = _int(obj, "moe_router_topk", path, default=2, maximum=experts)
    ffn = _int(obj, "moe_ffn_hidden_size", path, default=common["ffn_hidden_size"])
    shared = _int(obj, "moe_shared_expert_intermediate_size", path, default=0, minimum=0)
    freq, n = _get(obj, "moe_layer_freq", 1), common["num_layers"]
    if isinstance(freq, (list, tuple)) and len(freq) == n and all(x in (0, 1) for x in freq):
        layers = tuple(bool(x) for x in freq)
    elif isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        layers = tuple(i % freq == 0 for i in range(n))
    else:
        raise ValueError(f"{path}.moe_layer_freq: expected a positive integer or one 0/1 per layer, got {freq!r}")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn=ffn, moe_shared_ffn=shared, moe_layers=layers,
                moe_bias=_bool(obj, "add_bias_linear", path, default=True))


def read_model(model: Any) -> ModelSpec:
    if model is None:
        raise ValueError("model: required")
    lang_obj = _get(model, "language")
    if lang_obj is None:
        raise ValueError("model.language: required")
    common = _transformer(lang_obj, "model.language")
    lang = ModuleSpec(name="language", kind="language",
                      vocab_size=_int(lang_obj, "vocab_size", "model.language"),
                      tie_embeddings=_bool(lang_obj, "tie_embeddings", "model.language"),
                      **common, **_moe(lang_obj, "model.language", common))
    encoders_obj = _get(model, "encoders") or {}
    if isinstance(encoders_obj, Mapping):
        items = list(encoders_obj.items())
    else:
        raise ValueError("model.encoders: expected a mapping of name -> encoder")
    for n, _ in items:
        if not isinstance(n, str):
            raise ValueError(f"model.encoders: names must be strings, got {n!r}")
    return ModelSpec(lang, tuple(_encoder(n, o) for n, o in items))


def max_sequence_length(model: Any) -> int | None:
    return _get(_get(model, "language"), "max_sequence_length")
