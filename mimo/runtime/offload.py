"""Parameter offload to host memory between the three phases of the colocated schedule.

Encoder weights are needed in phase 1 (forward) and phase 3 (backward) but not
while the LLM runs in phase 2, so their device storage can be released for
the LLM's activations. On CUDA the copy to pinned host memory runs on a side
stream, overlapping phase 2's first microbatches; the copy back waits for it.
On a CPU run the "device" already is the host: the storage is still swapped
out and restored, so the mechanism is exercised (and tested) everywhere.

Autograd keeps referring to the parameter objects, whose data is restored in
place before phase 3, so the backward sees exactly the original weights.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from .device import Runtime


class ParameterOffload:
    def __init__(self, params: Iterable[torch.nn.Parameter], runtime: Runtime):
        self.params: List[torch.nn.Parameter] = list(params)
        self.runtime = runtime
        self.host: Optional[List[torch.Tensor]] = None
        self._stream = torch.cuda.Stream(device=runtime.device) if runtime.is_cuda else None
        self.offloaded_numel = 0  # parameters' elements currently held on the host

    def to_host(self) -> None:
        if self.host is not None:
            raise RuntimeError("parameters are already offloaded")
        if self._stream is None:
            self.host = [p.data.clone() for p in self.params]
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.runtime.device))
            with torch.cuda.stream(self._stream):
                self.host = []
                for p in self.params:
                    h = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                    h.copy_(p.data, non_blocking=True)
                    # The caching allocator must not hand the storage out before the copy ran.
                    p.data.record_stream(self._stream)
                    self.host.append(h)
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.offloaded_numel = sum(h.numel() for h in self.host)

    def to_device(self) -> None:
        if self.host is None:
            raise RuntimeError("parameters are not offloaded")
        if self._stream is not None:
            torch.cuda.current_stream(self.runtime.device).wait_stream(self._stream)
        for p, h in zip(self.params, self.host):
            p.data = h.to(self.runtime.device, non_blocking=True)
        self.host = None
        self.offloaded_numel = 0
