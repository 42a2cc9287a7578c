"""Routed experts whose GEMMs run as grouped GEMMs (`model.language.moe_grouped_gemm`, docs/moe.md).

megatron-core's grouped expert modules need Transformer Engine (`TEGroupedMLP`) or the
`grouped_gemm` package (`GroupedMLP`, whose weights are packed tensors with their own names and
checkpoint layout). `GroupedExperts` keeps megatron's `SequentialMLP` as it is — the same
parameters, `local_experts.<i>.linear_fc1/fc2.weight`, so HF import and export, checkpoints,
initialisation and every parity tool see the same tensors — and only replaces its forward: all local
experts' fc1 in one `torch._grouped_mm` over the (token, expert) rows the dispatcher sorted by expert,
the activation scaled by the routing probabilities, then all fc2 in a second one, instead of a Python
loop of two small GEMMs per expert.

The expert weights are stacked inside the autograd function and again in its backward, so no stacked
copy stays alive between forward and backward (at 16 local experts of a Qwen3-30B-A3B-shaped layer
that copy would be 150 MB per layer and microbatch in flight).
"""

from __future__ import annotations

from typing import List

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ W_e^T, for every local expert e in one grouped GEMM.
    `ends[e]` is the end row of expert e's rows (rows are sorted by expert; an expert may have none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, *weights)
        if x.shape[0] == 0:  # a rank that received no token (torch's kernel refuses empty operands)
            return x.new_zeros(0, weights[0].shape[0])
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, ends, *weights = ctx.saved_tensors
        if x.shape[0] == 0:
            return (torch.zeros_like(x), None, *(torch.zeros_like(w) for w in weights))
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, torch.stack(weights), offs=ends)
        # dW_e = dy_e^T x_e: the grouped GEMM with the groups along the reduced (row) dimension. An
        # expert without rows gets exactly zero (some GPU kernels leave its block unwritten).
        dw = torch._grouped_mm(dy.t(), x, offs=ends)
        has_rows = torch.diff(ends, prepend=ends.new_zeros(1)) > 0
        dw = dw * has_rows.to(dw.dtype)[:, None, None]
        return (dx, None, *dw.unbind(0))


def _ends(tokens_per_expert: torch.Tensor, device) -> torch.Tensor:
    """Each expert's end row. megatron-core's dispatchers give the counts on the host: they are summed
    there and copied without blocking, since a plain copy from pageable memory would make the host
    wait for the stream (the tokens' all-to-all) before it queues the grouped GEMMs."""
    ends = torch.cumsum(tokens_per_expert.to(torch.int64), 0).to(torch.int32)
    return ends.to(device, non_blocking=True)


class GroupedExperts(SequentialMLP):
    """megatron-core's SequentialMLP (same submodules and parameters) with grouped-GEMM forward.
    Built only for experts without biases (the config check refuses `moe_grouped_gemm: true` with
    `add_bias_linear`), without FP8/FP4, and with the routing probabilities applied after the
    activation (mimo never sets megatron's `moe_apply_probs_on_input`)."""

    def _weights(self, layer: str) -> List[torch.Tensor]:
        return [getattr(e, layer).weight for e in self.local_experts]

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x, probs = permuted_local_hidden_states, permuted_probs
        ends = _ends(tokens_per_expert, x.device)
        h = _GroupedLinear.apply(x, ends, *self._weights("linear_fc1"))
        if self.config.gated_linear_unit:  # as megatron's MLP (unfused path) computes it
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := self.config.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
            h = self.config.activation_func(gate) * (linear + self.config.glu_linear_offset)
        else:
            h = self.config.activation_func(h)
        h = (h * probs.unsqueeze(-1)).to(x.dtype)
        return _GroupedLinear.apply(h, ends, *self._weights("linear_fc2")), None
