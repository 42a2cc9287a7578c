"""The routed experts' second linear layer, fit for experts with biases on one expert-TP rank.

megatron-core 0.16.1 sends an expert's `linear_fc2` output through
`reduce_from_tensor_model_parallel_region` whenever the layer has neither expert TP nor EP (its
expert-TP group is one rank and `ep` is 1). Over one rank that autograd Function returns its input
as it is, and the expert MLP then adds its bias, scaled by the routing probability, to that output
in place: autograd refuses the in-place change of a custom Function's view, so every MoE model with
`add_bias_linear: true` stopped at its first forward at `ep: 1`. Over one rank the reduction is the
identity, so such a layer takes the path megatron-core's expert-parallel layers take: no
communication, the output as the matrix product left it (the same numbers, also with sequence
parallelism, whose reduce-scatter over one rank is the identity too).
"""

from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.utils import get_pg_size


class ExpertRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True
