"""The module graph as a graph of pipeline-stage nodes, and 1F1B over one node.

Every encoder stage and every LLM stage is a node; edges run stage to stage
inside a module and from each encoder's last stage into the LLM's first stage.
The LLM's last stage is the sink. A node's 1F1B warm-up is its distance to the
sink, so the whole graph runs like one pipeline as deep as its longest path,
and every node sees exactly one fewer warm-up forward than its producer.

The engine is port-based: a node talks to its producers through an
*upstream* port and to its consumer through a *downstream* port. The combined
steady-state ops name both halves because their order matters on edges whose
halves block (boundary communicators): with producer warm-up `w + 1` and
consumer warm-up `w`, the consumer's edge sequence is F_w, B_0, F_{w+1}, B_1,
..., so the producer must receive backward i before sending forward w+1+i.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from mimo.config import LANGUAGE


@dataclass(frozen=True)
class Node:
    module: str
    stage: int
    num_stages: int


def stage_nodes(pp_of: Dict[str, int], encoders: List[str]) -> Dict[Node, int]:
    """Every stage node with its distance (in edges) to the sink, the LLM's last stage."""
    pl = pp_of[LANGUAGE]
    out = {Node(LANGUAGE, s, pl): pl - 1 - s for s in range(pl)}
    for name in encoders:
        pe = pp_of[name]
        for s in range(pe):
            out[Node(name, s, pe)] = (pe - 1 - s) + 1 + (pl - 1)
    return out


def pipeline_depth(pp_of: Dict[str, int], encoders: List[str]) -> int:
    """Stages on the longest path: the depth the graph behaves like."""
    return 1 + max(stage_nodes(pp_of, encoders).values())


class Upstream:
    """How a node gets its inputs and returns their gradients (override what applies)."""

    def recv_forward(self, mb: int) -> Any:
        raise NotImplementedError

    def send_backward(self, mb: int, grad: Any) -> None:
        raise NotImplementedError

    def send_backward_recv_forward(self, mb_b: int, grad: Any, mb_f: int) -> Any:
        # Backward first: a consumer's steady step hands back B_i before it takes F_{w+1+i}.
        self.send_backward(mb_b, grad)
        return self.recv_forward(mb_f)


class Downstream:
    def send_forward(self, mb: int, out: Any) -> None:
        raise NotImplementedError

    def recv_backward(self, mb: int) -> Any:
        raise NotImplementedError

    def send_forward_recv_backward(self, mb_f: int, out: Any, mb_b: int) -> Any:
        # Mirror of Upstream: receive B_i, then send F_{w+1+i} (see the module docstring).
        grad = self.recv_backward(mb_b)
        self.send_forward(mb_f, out)
        return grad


class UpstreamUnion(Upstream):
    """Several upstream ports feeding one node, each owning some of the input names.

    The LLM's first stage takes colocated encoders' boundary tensors from phase 1
    of the three-phase schedule and non-colocated encoders' from their live
    boundary communicators in the same microbatch: inputs are merged into one
    dict, gradients handed back to the port that owns the name, in port order.
    """

    def __init__(self, ports: List[Tuple[List[str], Upstream]]):
        self.ports = ports

    def recv_forward(self, mb):
        out = {}
        for _, port in self.ports:
            out.update(port.recv_forward(mb))
        return out

    def send_backward(self, mb, grads):
        for names, port in self.ports:
            port.send_backward(mb, {n: g for n, g in grads.items() if n in names})


def run_node(num_microbatches: int, warmup: int, up: Optional[Upstream], down: Optional[Downstream],
             forward_step: Callable[[int, Any], Any], backward_step: Callable[[int, Any, Any, Any], Any],
             with_backward: bool = True) -> None:
    """1F1B over one stage node.

    forward_step(mb, inputs) -> output (the sink returns its scalar loss);
    backward_step(mb, inputs, output, grad_of_output) -> gradient of inputs
    (grad is None at the sink). A node without backward (a frozen encoder,
    nothing trainable upstream of its consumer) runs all forwards in order.
    """
    M = num_microbatches
    if not with_backward:
        for mb in range(M):
            y = forward_step(mb, up.recv_forward(mb) if up else None)
            if down is not None:
                down.send_forward(mb, y)
        return
    warmup = min(warmup, M)
    if warmup and down is None:
        raise ValueError("only a node with a consumer can run warm-up forwards")
    in_flight = deque()
    for mb in range(warmup):
        x = up.recv_forward(mb) if up else None
        y = forward_step(mb, x)
        down.send_forward(mb, y)
        in_flight.append((x, y))
    steady = M - warmup
    x = up.recv_forward(warmup) if (up and steady > 0) else None
    for i in range(steady):
        mb = warmup + i
        y = forward_step(mb, x)
        g = down.send_forward_recv_backward(mb, y, i) if down else None
        in_flight.append((x, y))
        x0, y0 = in_flight.popleft()
        gx = backward_step(i, x0, y0, g)
        x = None
        if up is not None:
            if i == steady - 1:
                up.send_backward(i, gx)
            else:
                x = up.send_backward_recv_forward(i, gx, mb + 1)
    for i in range(steady, M):
        x0, y0 = in_flight.popleft()
        gx = backward_step(i, x0, y0, down.recv_backward(i))
        if up is not None:
            up.send_backward(i, gx)
