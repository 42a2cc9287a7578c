"""Per-rank memory model: model states plus in-flight activations.

Model states per parameter (bytes):
  bf16 training: weight 2; trainable adds an fp32 main gradient (4) and Adam's
  fp32 master copy plus two moments (12). fp32 training: weight 4; trainable
  adds gradient 4 and two moments 8. Frozen parameters hold only the weight:
  no gradient buffer, no optimizer state. SGD keeps no moments.

Activations: a layer keeps what its backward needs only if a backward runs
through it (frozen-aware: a frozen layer with no trainable parameters before
it saves nothing). Under 1F1B stage ``i`` of a ``p``-stage chain holds
``p - i`` microbatches; with several encoders Cornstarch's multi-pipeline view
applies: each encoder + LLM is one chain, so an encoder stage counts the LLM
stages after it.
"""

from __future__ import annotations


def state_bytes_per_param(trainable: bool, precision: str = "bf16", optimizer: str = "adam") -> float:
    weight = 2.0 if precision == "bf16" else 4.0
    if not trainable:
        return weight
    grad = 4.0
    master = 4.0 if precision == "bf16" else 0.0
    moments = 8.0 if optimizer == "adam" else 0.0
    return weight + grad + master + moments


def in_flight_microbatches(stage: int, chain_stages: int, num_microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` (0-based) holds at peak
    in 1F1B over a chain of ``chain_stages`` stages."""
    return max(1, min(chain_stages - stage, num_microbatches))


def stage_memory(params: float, trainable_params: float, activation_bytes: float,
                 in_flight: int, precision: str = "bf16", optimizer: str = "adam") -> float:
    frozen = params - trainable_params
    return (frozen * state_bytes_per_param(False, precision, optimizer)
            + trainable_params * state_bytes_per_param(True, precision, optimizer)
            + activation_bytes * in_flight)
