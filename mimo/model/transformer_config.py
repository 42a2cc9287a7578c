"""megatron-core TransformerConfig for one module under its own layout."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mimo.runtime.fusions import FusionSupport, fusion_flags
from mimo.runtime.fusions import active as active_fusions
from mimo.topology import Layout

from .architecture import architecture_kwargs, mrope_kwargs


# megatron's normal(0, std) weight initialisation; mimo.model.sharded_init draws with the same std.
INIT_METHOD_STD = 0.02


def _leave_unset(tensor: torch.Tensor) -> None:
    """An init method that draws nothing (see `transformer_config(initialize=False)`)."""


def initialized_by_megatron(training) -> bool:
    """Whether megatron draws the initial weights while building a module: not under
    `training.init: sharded`, where mimo.model.sharded_init overwrites every parameter anyway."""
    return training.init != "sharded"


def dtype_of(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def memory_knobs(par, tp: int) -> dict:
    """megatron settings for `parallelism.<module>.sp` and `.recompute` (see docs/memory.md).

    Sequence parallelism only exists inside a TP group, so with tp = 1 it is off.
    `full` recomputes every layer from its input (uniform, one layer per chunk),
    `selective` only the core attention.
    """
    sp = bool(par is not None and par.sp and tp > 1)
    kind = "none" if par is None else par.recompute
    recompute = {"none": dict(recompute_granularity=None),
                 "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                 "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                 }[kind]
    return dict(sequence_parallel=sp, **recompute)


def transformer_config(module_cfg, layout: Layout, precision: str, num_layers: int = None,
                       par=None, initialize: bool = True) -> TransformerConfig:
    """The megatron config of one module.

    Always CPU initialisation: megatron then draws each TP-split weight from
    the full master weight, so the initial model is the same whatever the
    tensor-parallel size (the precondition for layout-independent parity).
    Dropout is off so runs are deterministic and comparable. `par` (the
    module's ParallelConfig) supplies the memory knobs `sp` and `recompute`.
    `initialize=False` leaves megatron's weights unset (the caller fills them):
    its init methods draw nothing. (megatron's `perform_initialization=False`
    would also skip tagging the weights with their TP partition dim and stride,
    which shard slicing, the gradient norm and checkpoints read.)
    """
    dtype = dtype_of(precision)
    no_draw = {} if initialize else dict(init_method=_leave_unset, output_layer_init_method=_leave_unset,
                                         embedding_init_method=_leave_unset)
    return TransformerConfig(
        num_layers=num_layers if num_layers is not None else module_cfg.num_layers,
        hidden_size=module_cfg.hidden_size,
        num_attention_heads=module_cfg.num_attention_heads,
        num_query_groups=getattr(module_cfg, "num_query_groups", None) or module_cfg.num_attention_heads,
        ffn_hidden_size=module_cfg.ffn_hidden_size,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_METHOD_STD,
        **no_draw,
        # Norm, activation, biases, head dim: the module's architecture fields.
        **architecture_kwargs(module_cfg),
        **mrope_kwargs(module_cfg),
        # megatron's fused kernels where this process's runtime has them (mimo.runtime.fusions):
        # all off on CPU ranks, the jit_fuser ones (and TE / apex ones where installed) on CUDA.
        **module_fusion_flags(module_cfg),
        # "native" is the cross-entropy that takes the module's own TP group
        # instead of megatron's global parallel state.
        cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="native",
        **memory_knobs(par, layout.tp),
        **moe_kwargs(module_cfg, layout),
    )


def module_fusion_flags(module_cfg, support: FusionSupport = None) -> dict:
    """TransformerConfig's fusion fields for one module under `support` (default: the fusions of
    the runtime `mimo.runtime.setup_megatron` activated; none before that and on CPU)."""
    arch = architecture_kwargs(module_cfg)
    return fusion_flags(active_fusions() if support is None else support,
                        activation_func=arch["activation_func"], gated=arch["gated_linear_unit"],
                        add_bias_linear=arch["add_bias_linear"],
                        mrope=getattr(module_cfg, "position_embedding", None) == "mrope",
                        moe=bool(getattr(module_cfg, "is_moe", False)))


def moe_kwargs(module_cfg, layout: Layout) -> dict:
    """TransformerConfig's mixture-of-experts fields for an MoE LLM (nothing for any other module).

    `expert_model_parallel_size` > 1 makes megatron-core mark expert weights `allreduce=False`
    (reduced over the expert-DP group by its DDP). The CUDA-only or TE-only paths stay off:
    permute / router fusion, shared-expert overlap, megatron's grouped GEMM modules (mimo builds
    SequentialMLP experts, or its own GroupedExperts with the same parameters: mimo.model.specs).
    """
    if not getattr(module_cfg, "is_moe", False):
        return {}
    shared = module_cfg.moe_shared_expert_intermediate_size
    return dict(
        num_moe_experts=module_cfg.num_moe_experts,
        moe_router_topk=module_cfg.moe_router_topk,
        moe_ffn_hidden_size=module_cfg.moe_ffn_hidden_size or module_cfg.ffn_hidden_size,
        moe_shared_expert_intermediate_size=shared if shared else None,
        moe_shared_expert_gate=bool(module_cfg.moe_shared_expert_gate),
        moe_router_pre_softmax=module_cfg.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=module_cfg.moe_aux_loss_coeff,
        moe_token_dispatcher_type=module_cfg.moe_token_dispatcher_type,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_shared_expert_overlap=False,
    )
