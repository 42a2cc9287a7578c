"""The step's MoE metrics (`moe_aux_loss`, `expert_load_max_over_mean`; README "Watching a run").

Both travel in the step's existing loss all-reduce (a world sum, `RankStep.collective` LOSS), as
slots after the loss, the bad-media count and the stop flag; nothing here syncs with the device
during the step.

* Expert load: a forward hook on each megatron-core `TopKRouter` of this rank's LLM part adds its
  `routing_map` column sums (tokens routed to each expert, a token counted once for each of its
  top-k experts) into a per-MoE-layer row, on the device. Every token is routed on exactly one rank
  of a stage (TP ranks hold sequence shards under SP, CP ranks chunks, DP ranks other samples) and
  each layer lives on one stage, so the world sum is each layer's global count for the step.
  `expert_load_max_over_mean` = max over MoE layers of (max over experts / mean over experts) of
  those counts: 1.0 is perfect balance.
* Aux loss: megatron-core's router adds each MoE layer's load-balancing loss (coefficient divided
  out; each TP x CP rank its partial sum over its tokens) to its layer-wise tracker once per
  microbatch. `moe_aux_loss` is what megatron's `track_moe_metrics` logs as `load_balancing_loss`:
  summed over the TP x CP ranks, averaged over the step's microbatches (all DP replicas), averaged
  over MoE layers. The hooks also count router calls, which gives the number of microbatches. It
  is None when `moe_aux_loss_coeff` is 0 (the router computes no aux loss then).

Only routes taken with gradients enabled count: the training forward, or under activation
recomputation the recomputed one (the first runs without gradients), so each token counts once.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from mimo.model.reference_init import global_name

_AUX = "load_balancing_loss"  # megatron-core's tracker entry of the switch (aux_loss) loss


def _tracker() -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()


class MoEMetrics:
    """Per-step expert-load counts of this rank's routers and its share of the aux-loss tracker."""

    def __init__(self, lang, tp: int, cp: int, part: Optional[torch.nn.Module], layer_offset: int, device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.tp_cp = tp * cp
        self.experts = lang.num_moe_experts
        self.moe_layers = [i for i, moe in enumerate(lang.moe_layers()) if moe]
        self.aux = lang.moe_aux_loss_coeff > 0
        # One row per MoE layer (global order): its experts' token counts, then its router calls.
        self.counts = torch.zeros(len(self.moe_layers), self.experts + 1, dtype=torch.float64, device=device)
        if part is None:
            return
        for name, module in part.named_modules():
            if isinstance(module, TopKRouter):
                layer = int(global_name(name, layer_offset).split("layers.", 1)[1].split(".", 1)[0])
                module.register_forward_hook(self._hook(self.moe_layers.index(layer)))

    def _hook(self, row: int):
        def count(module, args, output):
            if torch.is_grad_enabled():
                routing_map = output[1]
                if len(args) > 1 and args[1] is not None:  # CP padding slots (True) route too: not counted
                    routing_map = routing_map & ~args[1].reshape(-1, 1)
                self.counts[row, :-1] += routing_map.sum(dim=0)
                self.counts[row, -1] += 1
        return count

    def reset(self) -> None:
        """At the start of a step (megatron's tracker otherwise accumulates over steps)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()

    def slots(self) -> torch.Tensor:
        """This rank's contribution to the world sum: the aux losses it tracked (summed), the counts."""
        entry = _tracker().get(_AUX)
        aux = entry["values"].sum().to(self.counts) if entry is not None else self.counts.new_zeros(())
        return torch.cat([aux.reshape(1), self.counts.reshape(-1)])

    def width(self) -> int:
        return 1 + self.counts.numel()

    def summarize(self, summed: List[float]) -> dict:
        """The two metrics from the world-summed slots (host floats)."""
        counts = torch.tensor(summed[1:], dtype=torch.float64).reshape(self.counts.shape)
        load, calls = counts[:, :-1], counts[:, -1]
        mean = load.mean(dim=1)
        imbalance = max((float(load[i].max() / mean[i]) for i in range(len(self.moe_layers)) if mean[i] > 0),
                        default=None)
        aux = None
        if self.aux and calls.sum() > 0:
            # calls = tp*cp router calls per (layer, microbatch); the tracker sums over layers.
            aux = summed[0] * self.tp_cp / float(calls.sum())
        return {"moe_aux_loss": aux, "expert_load_max_over_mean": imbalance}
