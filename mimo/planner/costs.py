"""Frozen-aware per-layer cost (one forward + one backward).

Backward splits into the weight-gradient part and the input-gradient part.
Autograd computes the weight gradient only for trainable layers, and the
input gradient only when *something earlier* needs it: a strictly earlier
trainable layer in the chain, or an upstream input that requires grad. The
first trainable layer of a chain therefore pays no input-gradient cost when
nothing before it is trainable (a refinement over the papers' Eq. 3.3, whose
``p(L_0) = not f(L_0)`` would charge it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class LayerCost:
    forward: float
    backward_input: float
    backward_weight: float
    frozen: bool = False

    @property
    def full(self) -> float:
        """Cost if every gradient were computed (the frozen-unaware view)."""
        return self.forward + self.backward_input + self.backward_weight


def input_grad_flags(layers: Sequence[LayerCost], upstream_requires_grad: bool = False) -> list[bool]:
    """Whether each layer must produce a gradient w.r.t. its input."""
    flags = []
    grad_flows = upstream_requires_grad
    for layer in layers:
        flags.append(grad_flows)
        grad_flows = grad_flows or not layer.frozen
    return flags


def backward_costs(layers: Sequence[LayerCost], upstream_requires_grad: bool = False) -> list[float]:
    flags = input_grad_flags(layers, upstream_requires_grad)
    return [
        (0.0 if layer.frozen else layer.backward_weight) + (layer.backward_input if need else 0.0)
        for layer, need in zip(layers, flags)
    ]


def frozen_aware_costs(layers: Sequence[LayerCost], upstream_requires_grad: bool = False) -> list[float]:
    """Per-layer forward + backward, charging only gradients autograd computes."""
    return [layer.forward + b for layer, b in zip(layers, backward_costs(layers, upstream_requires_grad))]


def frozen_unaware_costs(layers: Sequence[LayerCost]) -> list[float]:
    """Baseline that assumes every layer computes both gradients."""
    return [layer.full for layer in layers]


def output_requires_grad(layers: Sequence[LayerCost], upstream_requires_grad: bool = False) -> bool:
    """Whether a chain's output carries grad (so modules after it need input grads)."""
    return upstream_requires_grad or any(not layer.frozen for layer in layers)


def llm_upstream_requires_grad(encoder_chains: Iterable[Sequence[LayerCost]]) -> bool:
    """The LLM input needs gradients when any encoder path (encoder layers or
    its projector) has trainable parameters."""
    return any(output_requires_grad(chain) for chain in encoder_chains)
