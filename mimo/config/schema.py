"""Dataclasses mirroring the YAML contract (README, "Config reference").

Every field has the YAML name. Defaults live here and nowhere else, so the
loader, the validator and the docs agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

LANGUAGE = "language"
ENCODER_KINDS = ("vision", "audio")
# patch_merger: a native-resolution ViT's merger (norm, spatial_merge_size^2 patches concatenated, MLP).
PROJECTOR_KINDS = ("mlp", "linear", "patch_merger")
ATTENTION_KINDS = ("sdpa", "bitfield")
OPTIMIZERS = ("adam", "sgd")
PRECISIONS = ("fp32", "bf16")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
INIT_MODES = ("sharded", "reference", "local")
CP_POLICIES = ("lpt", "lpt_free", "zigzag", "contiguous", "random")
RECOMPUTE_KINDS = ("none", "selective", "full")
DATA_KINDS = ("mock", "llava", "energon")
# training.replan: what a job does on a world size its layout does not fill (docs/checkpoints.md).
REPLAN_MODES = ("off", "auto")
# data.balance: which samples each DP rank and microbatch runs (mimo.balance).
BALANCE_POLICIES = ("none", "mmscale", "entrain")
BAD_RECORD_MODES = ("skip", "error")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# swiglu is the gated form (silu(gate) * up) Llama, Mistral and Qwen2 use.
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "swiglu")
AUDIO_FRONTENDS = ("linear", "conv")
# model.language.position_embedding: 1-D rotary, or M-RoPE (time, height, width positions; Qwen2-VL).
LLM_POSITION_EMBEDDINGS = ("rope", "mrope")
# model.language.modality_attention (bitfield attention): how encoder tokens attend in the LLM.
MODALITY_ATTENTION = ("bidirectional", "causal")
# model.language.moe_token_dispatcher_type: megatron-core's all-to-all (over EP) or all-gather (over expert TP x EP).
MOE_DISPATCHERS = ("alltoall", "allgather")
# model.encoders.<vision>.resolution: every image resized to image_size, or each at its own size.
RESOLUTIONS = ("fixed", "native")
# model.encoders.<vision>.position_embedding: a learned table (fixed) or 2-D rotary (native).
VISION_POSITION_EMBEDDINGS = ("learned", "rope2d")


@dataclass
class ProjectorConfig:
    kind: str = "mlp"
    frozen: bool = False
    # mlp: the activation between its two linear layers (LLaVA: projector_hidden_act).
    activation: str = "gelu"


@dataclass
class LanguageConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_sequence_length: int
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    frozen: bool = False
    # A Hugging Face causal-LM directory (Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3-MoE, Mixtral): architecture
    # and weights come from it.
    hf: Optional[str] = None
    attention: str = "sdpa"
    # attention: bitfield only: the kernels' tile sizes and launch settings, KernelConfig's fields
    # (mimo/config/kernel.py; `tools/tune_attention.py` prints them for a GPU); unset fields keep
    # their defaults.
    attention_kernel: Optional[Dict[str, Any]] = None
    # Architecture details (set from the HF config when `hf` is given; these defaults are mimo's own).
    normalization: str = "LayerNorm"
    norm_eps: float = 1.0e-5
    activation: str = "gelu"
    add_bias_linear: bool = True
    qkv_bias: Optional[bool] = None          # default: add_bias_linear
    kv_channels: Optional[int] = None        # head dim; default hidden_size / num_attention_heads
    qk_layernorm: bool = False               # a norm over each head's q and k (Qwen3; set from the HF config)
    rope_theta: float = 10000.0
    # Llama-3 RoPE scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
    rope_scaling: Optional[Dict[str, float]] = None
    tie_embeddings: bool = False
    # rope | mrope: M-RoPE splits the rotary half-dim into mrope_section (time, height, width) parts.
    position_embedding: str = "rope"
    mrope_section: Optional[List[int]] = None
    # attention: bitfield only: encoders whose tokens text may attend to (default: all).
    text_sees: Optional[List[str]] = None
    # attention: bitfield only. bidirectional: an encoder's tokens in one document see each other both
    # ways (mimo's multimodal mask); causal: every token attends causally, as in transformers' LLaVA and
    # Qwen-VL (what model.hf sets, so the imported model computes what it was trained to).
    modality_attention: str = "bidirectional"
    # Context parallelism (cp > 1): how query blocks are dealt to CP ranks.
    cp_policy: str = "lpt"
    cp_block_size: int = 128
    # Mixture of experts (docs/moe.md): megatron-core MoE layers when num_moe_experts is set.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None            # each expert's FFN width; default ffn_hidden_size
    moe_shared_expert_intermediate_size: int = 0         # 0: no shared expert
    moe_shared_expert_gate: bool = False                 # sigmoid gate on the shared expert (Qwen2-MoE)
    moe_layer_freq: Any = 1                              # N: every Nth layer is MoE; or a list of 0/1 per layer
    # false: top-k of the logits, softmax over those k (Mixtral, Qwen3-MoE norm_topk_prob: true);
    # true: softmax over all experts, then the top k unrenormalised (Qwen2-MoE, norm_topk_prob: false).
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    # Routed experts' GEMMs: auto (grouped where the runtime has torch's grouped GEMM: CUDA, compute
    # capability >= 9.0, and the shapes allow it), true (always, CPU included), false (one per expert).
    moe_grouped_gemm: Any = "auto"

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def moe_layers(self) -> List[bool]:
        """Per global layer: whether it is a mixture-of-experts layer (megatron-core's
        `moe_layer_freq`: N makes layers 0, N, 2N, ... MoE; a list gives 1 (MoE) or 0 (dense) per layer)."""
        if not self.is_moe:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return [bool(x) for x in freq]
        return [i % freq == 0 for i in range(self.num_layers)]


@dataclass
class EncoderConfig:
    kind: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    frozen: bool = False
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    # A Hugging Face tower directory (CLIP / SigLIP vision, Whisper encoder for audio).
    hf: Optional[str] = None
    attention: str = "sdpa"
    attention_kernel: Optional[Dict[str, Any]] = None   # as model.language.attention_kernel
    # Token id of this encoder's placeholders in input_ids (default: the top ids of the vocabulary;
    # LLaVA: image_token_id).
    placeholder_id: Optional[int] = None
    # Architecture details (set from the HF config when `hf` is given; these defaults are mimo's own).
    norm_eps: float = 1.0e-5
    activation: str = "gelu"
    class_token: bool = False     # vision: a learned class token first (CLIP); LLaVA drops its output
    pre_norm: bool = False        # a LayerNorm on the embeddings before the first layer (CLIP)
    final_norm: bool = True       # a LayerNorm after the last layer (off for LLaVA's inner-layer features)
    patch_bias: bool = True       # vision: bias of the patch embedding
    frontend: str = "linear"      # audio: linear (frames_per_token frames -> token) | conv (Whisper)
    # vision
    image_size: Optional[int] = None
    patch_size: Optional[int] = None
    num_channels: int = 3
    # vision, resolution native (Qwen2-VL / Qwen2.5-VL): each image resized as the HF processor's
    # smart_resize (a multiple of patch_size * spatial_merge_size per side, pixels within
    # [min_pixels, max_pixels]); LLM tokens per image = t * h * w / spatial_merge_size^2 patches.
    resolution: str = "fixed"
    min_pixels: int = 3136
    max_pixels: int = 1003520
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    position_embedding: str = "learned"
    # Qwen2.5-VL window attention: window side in pixels (0: every layer sees the whole image) and
    # the layers that see the whole image anyway.
    window_size: int = 0
    full_attention_layers: Optional[List[int]] = None
    # Qwen2.5-VL ViT blocks: RMSNorm and a gated MLP (normalization RMSNorm, activation swiglu);
    # Qwen2-VL: LayerNorm and quick_gelu.
    normalization: str = "LayerNorm"
    # audio
    num_mel_bins: int = 16
    clip_frames: int = 64
    frames_per_token: int = 4

    def __post_init__(self):
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def tokens_per_item(self) -> int:
        """Modality tokens one image / one clip turns into (fixed-resolution encoders only)."""
        if self.kind == "vision" and self.resolution == "native":
            # Each image has its own size: count its tokens from its grid
            # (mimo.data.native_images.native_grid and placeholder_count).
            raise ValueError("tokens_per_item: a resolution native vision encoder has no fixed tokens per image; "
                             "each image's count comes from its size (mimo.data.native_images.placeholder_count)")
        if self.kind == "vision":
            return (self.image_size // self.patch_size) ** 2
        return self.clip_frames // self.frames_per_token


@dataclass
class ModelConfig:
    language: LanguageConfig
    encoders: Dict[str, EncoderConfig] = field(default_factory=dict)
    # A Hugging Face LlavaForConditionalGeneration directory: LLM, `images` encoder and projector come from it.
    hf: Optional[str] = None


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    # Expert parallel and expert tensor parallel (MoE LLM only): a second decomposition of the
    # module's own tp*cp*dp ranks per pipeline stage (etp x ep x expert-dp); they add no ranks.
    ep: int = 1
    etp: int = 1
    rank_offset: int = 0
    stage_layers: Optional[List[int]] = None
    # megatron-core sequence parallelism inside this module's TP group (no effect at tp 1).
    sp: bool = False
    # Activation recompute of this module's transformer layers: none | selective | full.
    recompute: str = "none"

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)


@dataclass
class DataConfig:
    kind: str = "mock"
    seq_length: int = 128
    seed: int = 0
    # Real data (kind: llava): a JSON list / JSONL of records, image paths relative to image_root.
    path: Optional[str] = None
    image_root: Optional[str] = None
    # An HF tokenizer directory (default: model.hf).
    tokenizer: Optional[str] = None
    # Several samples per sequence, separated by document ids in the attention mask.
    packing: bool = False
    # One global order per epoch: a permutation from (seed, epoch), or the file order.
    shuffle: bool = True
    num_workers: int = 0
    on_bad_record: str = "skip"
    max_images_per_sample: int = 2
    max_audio_per_sample: int = 1
    # Data-aware microbatching: none | mmscale | entrain (see docs/balance.md).
    balance: str = "none"
    # kind llava: a file that keeps the record index (token and media counts of every record) for
    # later starts of a multi-rank run; rebuilt when the records, tokenizer or settings change.
    index: Optional[str] = None


@dataclass
class TrainingConfig:
    global_batch_size: int
    micro_batch_size: int = 1
    train_iters: int = 10
    optimizer: str = "adam"
    lr: float = 1.0e-3
    seed: int = 1234
    precision: str = "fp32"
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    # Adam's moment decay rates and denominator epsilon (Megatron-LM's --adam-beta1/2, --adam-eps;
    # LLaVA-style recipes often use adam_beta2 0.95).
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    # Each DP rank of a module keeps the optimizer state (and fp32 master weights) of its
    # 1/dp share of the module's parameters (megatron-core's distributed optimizer).
    use_distributed_optimizer: bool = False
    # Learning rate: linear warmup from 0 over lr_warmup_iters steps, then decay to min_lr at train_iters.
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    # Start the LLM's gradient reduction while backward still runs (megatron-core's DDP hooks).
    overlap_grad_reduce: bool = False
    # bf16 only: accumulate and reduce gradients in fp32 (Megatron-LM's default; 4 bytes of
    # gradient buffer per parameter). false: bf16 gradient buffers and reduction (Megatron-LM's
    # --grad-reduce-in-bf16): half the buffer and half the DP traffic, coarser summation.
    grad_reduce_in_fp32: bool = True
    log_interval: int = 1
    timeout_minutes: float = 10.0
    # sharded: each rank draws only its own part, every parameter from a generator
    # seeded by (seed, module, global parameter name): identical weights for every
    # layout at the memory of one part. reference: every rank slices its shard out
    # of the full module built from the seed with megatron's initialisation (one
    # full copy in host memory per rank while initialising). local: megatron
    # initialises each shard in place (weights depend on the layout).
    init: str = "sharded"
    # Colocated encoders on the three-phase schedule: release their weights'
    # device memory while the LLM runs (phase 2), restore them for phase 3.
    offload_encoders: bool = False
    # Metrics (see README "Watching a run"): one JSON object per step appended to this file (rank 0).
    log_json: Optional[str] = None
    # Dense bf16 peak of one device in TFLOPS for `mfu`; default from the device name (unknown: mfu null).
    peak_tflops: Optional[float] = None
    tensorboard_dir: Optional[str] = None     # needs the tensorboard package
    wandb_project: Optional[str] = None       # needs the wandb package; WANDB_MODE=offline works
    # Chrome trace of one step (every rank's schedule actions), written by rank 0.
    timeline: Optional[str] = None
    timeline_step: int = 2
    # Checkpoints (see README "Checkpoints and resuming"): DIR/iter_NNNNNNN/ plus DIR/latest.
    save: Optional[str] = None
    save_interval: Optional[int] = None       # every N steps (and always after the last step)
    load: Optional[str] = None                # resume from DIR/latest; save == load and empty: fresh start
    load_optimizer: bool = True               # false: weights only; step and optimizer restart
    keep_last: Optional[int] = None           # keep only the K newest complete checkpoints
    async_save: bool = False                  # write shards in the background (megatron-core async; GPU or CPU ranks)
    # Stop before the allocation does (README "Checkpoints and resuming"): on exit_signal (e.g. Slurm's
    # `#SBATCH --signal=TERM@120`), or once exit_duration_minutes have passed since the trainer
    # started, every rank finishes its step, a checkpoint is saved and the run exits 0.
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"              # SIGTERM | SIGINT | SIGUSR1 | SIGUSR2
    exit_duration_minutes: Optional[float] = None
    # Elastic re-plan: auto resumes training.load on the planner's best layout for the ranks the job
    # has when they differ from the layout's; templates for smaller world sizes, down to
    # replan_min_ranks (default: half the layout's ranks), are planned ahead into save/templates.json.
    replan: str = "off"
    replan_min_ranks: Optional[int] = None


@dataclass
class MimoConfig:
    model: ModelConfig
    parallelism: Dict[str, ParallelConfig]
    data: DataConfig
    training: TrainingConfig

    @property
    def modules(self) -> List[str]:
        """Module names in a fixed order: encoders (config order), then the LLM."""
        return list(self.model.encoders) + [LANGUAGE]

    @property
    def placeholder_ids(self) -> Dict[str, int]:
        """Each encoder's placeholder token: its `placeholder_id`, else the top ids of the LLM
        vocabulary, in config order."""
        v = self.model.language.vocab_size
        return {name: e.placeholder_id if e.placeholder_id is not None else v - 1 - i
                for i, (name, e) in enumerate(self.model.encoders.items())}

    @property
    def mock_text_ids(self) -> range:
        """The token ids mock data draws text from: above the pad id 0 and below every placeholder id (the
        top of the vocabulary, or an HF model's image_token_id)."""
        ids = self.placeholder_ids
        return range(1, min([self.model.language.vocab_size - len(ids)] + list(ids.values())))

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: the end of the furthest rank range."""
        return max(p.rank_offset + p.size for p in self.parallelism.values())


def max_placeholder_count(enc) -> int:
    """LLM tokens of an image resized to max_pixels: max_pixels // (patch_size * merge)^2.

    smart_resize keeps h * w <= max_pixels, with two exceptions the sequence-length check
    tolerates (the data pipeline counts each image's tokens from its header anyway): a short
    side clamped up to one factor (aspect ratios near 200 with max_pixels < 200 * factor^2),
    and the round-up of images scaled to min_pixels when min_pixels is close to max_pixels."""
    factor = enc.patch_size * enc.spatial_merge_size
    return max(1, enc.max_pixels // (factor * factor))
