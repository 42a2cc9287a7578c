"""What the actions of a step plan do on one rank: `RankStep`, the trainer's side of the executor.

The executor (`mimo.schedule.executor`) walks the rank's actions; `RankStep`
holds the step's tensors between them, keyed by (module, microbatch) — a rank
holds at most one stage of each module:

* `x`: a stage's input (a received activation; on the LLM's first stage, the
  modality tokens of every encoder by name),
* `y`: its output (the LLM's last stage: the microbatch's normalised loss),
* `gy`: the gradient of the output (received, or from a boundary communicator),
* `gx`: the gradient of the input, waiting to be sent back.

A colocated encoder's boundary moves the whole step at once (microbatch
`None` in the plan); a pipelined one streams it as one chunk per LLM
microbatch. Boundary communicators are called as the plan's `boundary`
collectives. The step's reductions are megatron-core's (`ModelOptimizer`).

Deferral (`data.balance: entrain`, `mimo.training.windows`): a non-colocated
encoder's microbatch k also encodes the items whose LLM work runs in LLM
microbatch k + 1. They are a separate forward through every stage (`late_x`,
`late_y`, ...: keyed by the microbatch that encoded them), so the encoder's
backward splits: its backward action k runs the kept rows of microbatch k and
the deferred rows of k - 1, whose gradients arrived with LLM microbatch k.
Between encoder stages both halves travel in one message, kept items first.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from mimo.attention import shard_microbatch
from mimo.config import LANGUAGE, MimoConfig
from mimo.data.items import grid_patches, is_native
from mimo.model import assemble_embeddings, encode, llm_loss
from mimo.model.multimodal import embed_text
from mimo.model.sequence_parallel import llm_input_layout, shard_len, shard_sequence
from mimo.schedule.plan import (ACTIVATION, BOUNDARY, GRAD_NORM, GRAD_SYNC, LOSS, LOSS_TOKENS, OFFLOAD, OPTIMIZER,
                                RELOAD, Action)
from mimo.schedule.plan_build import stage_backward, stage_input_grad, trainable_edge

from .step_data import StepData
from .windows import DEFERRED, KEPT, microbatch_offsets


# The slots of the step's loss all-reduce (one world sum, `RankStep.loss`): the loss sum, the
# bad-media count, the stop flag (mimo.training.stop), the count of media that failed to decode under
# `on_bad_record: error`, then an MoE LLM's metrics (moe_metrics).
LOSS_SLOT, BAD_MEDIA_SLOT, STOP_SLOT, MEDIA_ERROR_SLOT, MOE_SLOTS = 0, 1, 2, 3, 4


class RankStep:
    """One step of one rank. `trainer`: its long-lived parts (model parts, optimizer, communicators, timer)."""

    def __init__(self, trainer, data: StepData):
        self.trainer, self.data = trainer, data
        cfg: MimoConfig = trainer.cfg
        self.cfg = cfg
        self.device, self.dtype = trainer.runtime.device, trainer.dtype
        self.x: Dict = {}
        self.y: Dict = {}
        self.gy: Dict = {}
        self.gx: Dict = {}
        # Non-colocated encoders under deferral: the deferred rows' x, y, gy, gx.
        self.late_x: Dict = {}
        self.late_y: Dict = {}
        self.late_gy: Dict = {}
        self.late_gx: Dict = {}
        self.received: Dict[str, torch.Tensor] = {}        # colocated: the step's boundary tensor
        self.offsets: Dict[str, List[int]] = {}
        self.boundary_grad: Dict[str, torch.Tensor] = {}   # colocated: its accumulated gradient
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss: Optional[torch.Tensor] = None
        self.grad_norm: Optional[torch.Tensor] = None
        self.trainable = {n: trainable_edge(cfg, n) for n in cfg.model.encoders}
        self.views: Dict[int, Dict] = {}
        self.comm_calls = {n: 0 for n in cfg.model.encoders}  # timeline span ids, per edge
        self.moe_metrics = getattr(trainer, "moe_metrics", None)
        if self.moe_metrics is not None:
            self.moe_metrics.reset()  # this step's expert loads and aux losses only

    # -- inputs --------------------------------------------------------------------------------

    def _llm_view(self, mb: int) -> Dict:
        """LLM microbatch mb as this rank's LLM stage sees it: its mask, and under CP its balanced slots
        (the same plan on every stage); `full` keeps the whole microbatch for the first stage."""
        if mb not in self.views:
            b = self.data.llm_batches[mb]
            if self.trainer.topo.grid(LANGUAGE).layout.cp > 1:
                b = {**self._cp_slice(b), "full": b}
            self.views[mb] = b
        return self.views[mb]

    def _cp_slice(self, b, decoder_input=None):
        """This CP rank's balanced slots of a microbatch (planned and checked on the host,
        `llm_microbatch`; context parallelism needs bitfield attention)."""
        mask = b["attention_mask"]
        return shard_microbatch(b["cp_slots"], self.trainer.topo.grid(LANGUAGE).coords["cp"], bits=mask.bits,
                                document_ids=mask.document_ids, input_ids=b["input_ids"],
                                position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"],
                                decoder_input=decoder_input, validate=False)

    def _items(self, name: str, mb: Optional[int], part: str = KEPT) -> Optional[torch.Tensor]:
        """Raw inputs (pixels, features) of this rank's items of encoder `name` for unit mb."""
        if self.data.windows is None:  # homogeneous: the microbatch's own items
            return self.data.llm_batches[mb].get(name)
        return self.data.step_batch[name].take(self._item_ids(name, mb, part))

    def _item_ids(self, name: str, mb: Optional[int], part: str = KEPT) -> List[int]:
        g = self.trainer.topo.grid(name)
        if name not in self.trainer.colocated:
            return self.data.windows.encoder_item_ids(name, g.coords["dp"], mb, part)
        ids = self.data.windows.encoder_item_ids(name, g.coords["dp"])
        if mb is None:
            return ids
        # A pipelined colocated encoder: one chunk per LLM microbatch (some may be empty); every
        # stage holds the same items, so all of them cut the same chunks.
        M = self.trainer.num_microbatches
        cuts = [(c * len(ids)) // M for c in range(M + 1)]
        return ids[cuts[mb]:cuts[mb + 1]]

    def _unit_counts(self, name: str, ids: List[int]) -> torch.Tensor:
        """Per-item token counts of a packed boundary tensor of the step items `ids`; made on the host
        (from each item's size, `StepWindows.tokens`), where the communicator checks them without
        waiting for the device."""
        return torch.tensor(self.data.windows.tokens(name, ids), dtype=torch.int64)

    # -- compute -------------------------------------------------------------------------------

    def forward(self, a: Action) -> None:
        with self.trainer.timer.span(a.module, "F", a.mb or 0):
            if a.module == LANGUAGE:
                self._llm_forward(a.stage, a.mb)
            else:
                self._encoder_forward(a.module, a.stage, a.mb)

    def _encoder_forward(self, name: str, stage: int, mb: Optional[int]) -> None:
        self._encoder_stage(name, stage, mb, KEPT, self.x, self.y)
        if self._defers(name, mb):
            self._encoder_stage(name, stage, mb, DEFERRED, self.late_x, self.late_y)

    def _defers(self, name: str, mb: Optional[int]) -> bool:
        """Whether encoder microbatch mb of `name` has deferred rows (decided by the step's data)."""
        return (name != LANGUAGE and mb is not None and mb >= 0 and self.data.windows is not None
                and self.data.windows.has_deferred(name, mb))

    def _rows_dim(self, name: str) -> int:
        """The dimension of an encoder's stage activation [tokens, items, hidden] along which the kept
        and the deferred rows of a microbatch are joined between stages: the items, or for a native
        ViT, whose items are one packed sequence each half, the tokens (each half is its own
        sequence-parallel shard, so the halves stay apart on every rank)."""
        return 0 if is_native(self.cfg.model.encoders[name]) else 1

    def _encoder_stage(self, name: str, stage: int, mb: Optional[int], part: str, xs: Dict, ys: Dict) -> None:
        """One forward of an encoder stage over one half (kept or deferred rows) of microbatch mb."""
        model, g = self.trainer.parts[name], self.trainer.topo.grid(name)
        key = (name, mb)
        # A stage without backward (a frozen encoder's, before its projector) keeps no graph.
        with torch.set_grad_enabled(stage_backward(self.cfg, name, stage)):
            if g.layout.pp == 1:
                ys[key] = encode(model, self._items(name, mb, part))
                return
            items = self._items(name, mb, part) if stage == 0 else None
            ids = self._item_ids(name, mb, part)
            count = len(items) if items is not None else len(ids)
            if count == 0:  # nothing to encode: every stage skips, identically
                last = stage == g.layout.pp - 1
                ys[key] = (torch.zeros(0, self.cfg.model.language.hidden_size, dtype=self.dtype,
                                       device=self.device) if last else
                           torch.zeros(self._stage_shape(name, []), dtype=self.dtype, device=self.device))
                return
            if stage == 0:
                ys[key] = model(items)
                return
            # Its input is kept only for the gradient its backward hands to the stage before.
            x = xs[key] if stage_input_grad(self.cfg, name, stage) else xs.pop(key)
            # A native ViT's later stages make their masks and rotary table from the items' grids.
            ys[key] = model(x, self._grids(name, ids)) if is_native(self.cfg.model.encoders[name]) else model(x)

    def _grids(self, name: str, ids: List[int]) -> List:
        """Patch grids (t, h, w) of the given step items of native-resolution encoder `name` (host metadata)."""
        return [self.data.item_grids[name][i] for i in ids]

    def _stage_shape(self, name: str, ids: List[int]):
        """An encoder's activation between pipeline stages for the step items `ids`: this rank's
        sequence-parallel shard of each item's tokens (a vision class token travels with the patches;
        the last stage drops it). A native ViT's items are one packed sequence of their patches."""
        enc, config = self.cfg.model.encoders[name], self.trainer.parts[name].encoder.config
        if is_native(enc):
            patches = sum(grid_patches(g) for g in self._grids(name, ids))
            return (shard_len(patches, config), 1, enc.hidden_size)
        tokens = shard_len(enc.tokens_per_item + (1 if enc.class_token else 0), config)
        return (tokens, len(ids), enc.hidden_size)

    def _modality_tokens(self, mb: int) -> Dict[str, torch.Tensor]:
        """The LLM first stage's inputs from every encoder for microbatch mb."""
        out = {}
        for name in self.cfg.model.encoders:
            if self.data.windows is None:  # homogeneous: this rank's own encoder output
                y = self.y[(name, mb)]
                t = y.detach()
            elif name in self.trainer.colocated:
                a, b = self.offsets[name][mb], self.offsets[name][mb + 1]
                t = self.received[name][a:b].detach()
            else:
                t = self.x.pop((name, mb))
            out[name] = t.requires_grad_() if self.trainable[name] else t
        return out

    def _llm_forward(self, stage: int, mb: int) -> None:
        llm, g = self.trainer.parts[LANGUAGE], self.trainer.topo.grid(LANGUAGE)
        last = stage == g.layout.pp - 1
        b = self._llm_view(mb)
        labels = b["labels"] if last else None
        key = (LANGUAGE, mb)
        padding = self._router_padding(llm, b)
        if stage == 0 and not self.cfg.model.encoders:  # text only: megatron's own embedding path
            # ... except with a padding mask, which megatron-core would shard over its global TP group
            # rather than this model's: the embedding goes in as the decoder input instead.
            embedded = ({"decoder_input": llm.embedding(input_ids=b["input_ids"], position_ids=b["position_ids"])}
                        if padding else {})
            out = llm(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=b["attention_mask"],
                      labels=labels, **embedded, **padding)
        elif stage == 0:
            tokens = self._modality_tokens(mb)
            self.x[key] = tokens
            by_id = {self.cfg.placeholder_ids[n]: t for n, t in tokens.items()}
            if g.layout.cp > 1:
                # Assemble the whole fused sequence (every CP rank holds the whole boundary shard),
                # then keep this rank's slots of it.
                full = b["full"]
                text = embed_text(llm, full["input_ids"], full["position_ids"])
                fused = assemble_embeddings(text.transpose(0, 1), full["input_ids"], by_id,
                                            full["placeholder_counts"])
                local = self._cp_slice(full, fused.transpose(0, 1).contiguous())
                out = llm(input_ids=local["input_ids"], position_ids=local["position_ids"],
                          attention_mask=local["attention_mask"],
                          decoder_input=llm_input_layout(llm, local["decoder_input"]), labels=labels, **padding)
            else:
                out = llm_loss(llm, {**b, "labels": labels}, by_id)
        else:
            llm.set_input_tensor(self.x[key])
            out = llm(input_ids=None, position_ids=b["position_ids"], attention_mask=b.get("attention_mask"),
                      labels=labels, **padding)
        if last:
            # Normalised by the global batch's loss-token count: the DP sum of the gradients is
            # then exactly the single-rank per-token mean.
            out = (out.float() * b["loss_mask"]).sum() / self.data.n_tokens.clamp(min=1).float()
            self.loss_sum += out.detach().double()
            self.views.pop(mb, None)
        self.y[key] = out

    def _router_padding(self, llm, b: Dict) -> Dict:
        """Under CP an MoE LLM's router is told this rank's padding slots (`padding_mask`, [b, L] sharded
        like the layer inputs under SP), so that its load-balancing loss counts the real tokens
        only, as on one rank. Empty otherwise."""
        if "padding_mask" not in b or not self.cfg.model.language.is_moe:
            return {}
        mask = shard_sequence(b["padding_mask"].transpose(0, 1).contiguous(), llm.config, llm.pg_collection.tp)
        return {"padding_mask": mask.transpose(0, 1)}

    def backward(self, a: Action) -> None:
        key, mb = (a.module, a.mb), a.mb
        with self.trainer.timer.span(a.module, "B", mb or 0):
            y, x, g = self.y.pop(key), self.x.pop(key, None), self.gy.pop(key, None)
            if a.module == LANGUAGE:
                self._set_aux_loss_scale(mb)
                if self.cfg.model.language.frozen and not y.requires_grad:
                    pass  # a frozen LLM's first stage (or its loss, at pp 1) in a microbatch without any
                    # trainable encoder's tokens: nothing to differentiate
                elif g is None:  # the last stage: y is the loss
                    y.backward()
                else:
                    torch.autograd.backward(y, grad_tensors=g)
            elif y.requires_grad and y.numel() and g is not None:
                torch.autograd.backward(y, grad_tensors=g)
            late = (a.module, mb - 1 if mb else None)
            if a.module != LANGUAGE and late in self.late_y:
                # Split backward: the rows microbatch mb - 1 deferred, whose gradients came with mb.
                ly, lx, lg = self.late_y.pop(late), self.late_x.pop(late, None), self.late_gy.pop(late)
                if ly.requires_grad and ly.numel():
                    torch.autograd.backward(ly, grad_tensors=lg)
                if lx is not None:
                    self.late_gx[late] = lx.grad if lx.grad is not None else torch.zeros_like(lx)
            if a.module == LANGUAGE:
                self.views.pop(mb, None)
            if a.module == LANGUAGE and a.stage == 0:
                self._route_boundary_grads(mb, x or {})
            elif x is not None:  # a later stage whose input gradient goes to the stage before
                self.gx[key] = x.grad if x.grad is not None else torch.zeros_like(x)

    def _set_aux_loss_scale(self, mb: int) -> None:
        """The weight of microbatch mb's MoE load-balancing losses in this step's objective, set before
        its LLM backward as megatron-core's schedules set it after each forward (their
        `MoEAuxLossAutoScaler.set_loss_scale`; its backward reads one process-wide scale, so it is set
        per backward here, which also holds for microbatches whose backwards are interleaved).

        mimo's language loss is the global batch's per-token mean, and DP ranks sum their gradients.
        megatron-core's router computes each MoE layer's aux loss over one microbatch (its tokens on
        the TP x CP ranks) with `moe_aux_loss_coeff` folded in. The step's objective is the
        language loss plus the sample-weighted mean over the global batch's microbatches of those aux
        losses: weight = samples in microbatch mb / global_batch_size (1 / number of microbatches
        when they are equal, as megatron's own schedules average them over microbatches and DP
        ranks). Layout-independent: the same microbatches carry the same weights at any DP / EP."""
        if not self.cfg.model.language.is_moe:
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        samples = self.data.llm_batches[mb]["input_ids"].shape[0]
        weight = samples / self.cfg.training.global_batch_size
        MoEAuxLossAutoScaler.set_loss_scale(torch.full((), weight, dtype=torch.float32, device=self.device))

    def _route_boundary_grads(self, mb: int, tokens: Dict[str, torch.Tensor]) -> None:
        for name, t in tokens.items():
            if not self.trainable[name]:
                continue
            grad = t.grad if t.grad is not None else torch.zeros_like(t)
            if self.data.windows is None:
                self.gy[(name, mb)] = grad
            elif name in self.trainer.colocated:
                a, b = self.offsets[name][mb], self.offsets[name][mb + 1]
                self.boundary_grad[name][a:b] += grad
            else:
                self.gx[(name, mb)] = grad

    # -- point-to-point ------------------------------------------------------------------------

    def outgoing(self, a: Action) -> torch.Tensor:
        key = (a.module, a.mb)
        keep = stage_backward(self.cfg, a.module, a.stage)  # kept for this stage's backward
        if a.tensor == ACTIVATION:
            t = self.y[key] if keep else self.y.pop(key)
            if self._defers(a.module, a.mb):  # encoder stages: the deferred rows ride along, after the kept
                t = torch.cat([t, self.late_y[key] if keep else self.late_y.pop(key)], dim=self._rows_dim(a.module))
        else:
            t = self.gx.pop(key)
            if a.module != LANGUAGE and self._defers(a.module, a.mb - 1):
                t = torch.cat([t, self.late_gx.pop((a.module, a.mb - 1))], dim=self._rows_dim(a.module))
        return t.detach().contiguous()

    def incoming(self, a: Action) -> torch.Tensor:
        key = (a.module, a.mb)
        if a.tensor != ACTIVATION:  # the gradient of this stage's output
            shape = list(self.y[key].shape)
            if a.module != LANGUAGE and self._defers(a.module, a.mb - 1):
                d = self._rows_dim(a.module)
                shape[d] += self.late_y[(a.module, a.mb - 1)].shape[d]
        elif a.module == LANGUAGE:
            llm = self.trainer.parts[LANGUAGE]
            ids = self._llm_view(a.mb)["input_ids"]  # microbatches may differ in size (deferral)
            shape = (shard_len(ids.shape[1], llm.config), ids.shape[0], self.cfg.model.language.hidden_size)
        else:
            shape = list(self._stage_shape(a.module, self._item_ids(a.module, a.mb)))
            if self._defers(a.module, a.mb):
                d = self._rows_dim(a.module)
                shape[d] += self._stage_shape(a.module, self._item_ids(a.module, a.mb, DEFERRED))[d]
        return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)

    def arrived(self, a: Action, t: torch.Tensor) -> None:
        key = (a.module, a.mb)
        if a.tensor == ACTIVATION:
            grad = stage_input_grad(self.cfg, a.module, a.stage)
            if self._defers(a.module, a.mb):  # encoder stages: split the kept and the deferred rows
                d = self._rows_dim(a.module)
                n = self._stage_shape(a.module, self._item_ids(a.module, a.mb))[d]
                t, late = t.split([n, t.shape[d] - n], dim=d)
                self.late_x[key] = late.contiguous().requires_grad_(grad)
            self.x[key] = t.contiguous().requires_grad_(grad)
        else:
            if a.module != LANGUAGE and self._defers(a.module, a.mb - 1):
                d = self._rows_dim(a.module)
                n = self.y[key].shape[d]
                t, self.late_gy[(a.module, a.mb - 1)] = t.split([n, t.shape[d] - n], dim=d)
            self.gy[key] = t

    # -- collectives and local work ------------------------------------------------------------

    def collective(self, a: Action) -> None:
        if a.name.startswith(BOUNDARY):
            with self.trainer.timer.span(a.module, "comm", self.comm_calls[a.module]):
                self.comm_calls[a.module] += 1
                if a.tensor == ACTIVATION:
                    self._boundary_forward(a.module, a.mb)
                else:
                    self._boundary_backward(a.module, a.mb)
        elif a.name.startswith(LOSS_TOKENS):
            # No host check here (it would wait for the device mid-step); the trainer checks the
            # count after the step, and the loss divides by at least 1 meanwhile.
            dist.all_reduce(self.data.n_tokens, group=self.trainer.topo.grid(LANGUAGE).groups["dp"])
        elif a.name == LOSS:
            # Only the LLM's last-stage TP-rank-0 ranks hold loss; one world sum gives the global loss.
            g = self.trainer.topo.grid(LANGUAGE)
            last = g.is_member and g.is_last_stage and g.coords["tp"] == 0
            # The same sum carries the step's bad-media count (host ints, each counted on one rank),
            # whether any rank asked to stop after this step (mimo.training.stop) and how many items
            # failed to decode under on_bad_record: error (the trainer stops every rank on it): the
            # *_SLOT order.
            bad = torch.full((), float(self.data.bad_media), dtype=torch.float64, device=self.device)  # no copy
            stop = torch.full((), float(self.trainer.stop.requested()), dtype=torch.float64, device=self.device)
            failed = torch.full((), float(len(self.data.media_errors)), dtype=torch.float64, device=self.device)
            self.loss = torch.stack([self.loss_sum if last else torch.zeros_like(self.loss_sum), bad, stop, failed])
            if self.moe_metrics is not None:  # and an MoE LLM's metrics (mimo.training.moe_metrics)
                self.loss = torch.cat([self.loss, self.moe_metrics.slots()])
            dist.all_reduce(self.loss)
        elif a.name.startswith(GRAD_SYNC):
            self.trainer.optim.finish_grads(a.module)
        elif a.name == GRAD_NORM:
            self.grad_norm = self.trainer.optim.clip()
        else:
            raise ValueError(f"the executor does not know the collective {a.name!r}")

    def _boundary_forward(self, name: str, mb: Optional[int]) -> None:
        got = self._forward_window(name, mb, KEPT)
        windows = self.data.windows
        deferred = mb is not None and self._defers(name, mb - 1)
        if deferred:  # the rows encoder microbatch mb - 1 deferred to this LLM microbatch: a second call
            late = self._forward_window(name, mb - 1, DEFERRED)
            if got is not None:
                got = torch.cat([got, late])
        if got is None:
            return
        lg = self.trainer.topo.grid(LANGUAGE)
        tokens = windows.llm_tokens(name, lg.coords["dp"], mb or 0)
        if deferred:
            tokens += windows.llm_tokens(name, lg.coords["dp"], mb - 1, DEFERRED)
        # Every rank derives the windows from the same step data; a shape check (no host sync)
        # catches ranks that disagree on the window's total (not two items swapped within it).
        if got.shape[0] != tokens:
            raise RuntimeError(f"microbatch {mb}: boundary {name!r} delivered {got.shape[0]} tokens but the "
                               f"batch needs {tokens}")
        if mb is None:  # colocated: the step's tensor, sliced per LLM microbatch in phase 2
            mine = [i for m in windows.llm_indices(lg.coords["dp"]) for i in m]
            sample_tokens = windows.sample_tokens(name)
            per_sample = [sample_tokens[i] for i in mine]
            self.received[name] = got
            self.offsets[name] = microbatch_offsets(per_sample, windows.microbatch_sizes(lg.coords["dp"]))
            if self.trainable[name]:
                self.boundary_grad[name] = torch.zeros_like(got)
        else:
            self.x[(name, mb)] = got

    def _forward_window(self, name: str, mb: Optional[int], part: str) -> Optional[torch.Tensor]:
        """One communicator call: the encoder's rows of one window out, the LLM shard's rows in."""
        comm, g = self.trainer.comms[name], self.trainer.topo.grid(name)
        window = self.data.windows.window(name, mb or 0, part)[0]
        src = counts = None
        if g.is_member and g.is_last_stage:
            keep = self.trainable[name]  # kept for the encoder's backward
            if part == DEFERRED:
                src = self.late_y[(name, mb)] if keep else self.late_y.pop((name, mb))
            else:
                chunks = (list(range(self.trainer.num_microbatches)) if mb is None and g.layout.pp > 1 else [mb])
                ys = [self.y[(name, c)] if keep else self.y.pop((name, c)) for c in chunks]
                src = ys[0] if len(ys) == 1 else torch.cat(ys, dim=0)
            ids = self._item_ids(name, None if name in self.trainer.colocated else mb, part)
            src, counts = src.detach(), self._unit_counts(name, ids)
        return comm.forward(src, counts, window, backward=self.trainable[name])

    def _boundary_backward(self, name: str, mb: Optional[int]) -> None:
        lg, g = self.trainer.topo.grid(LANGUAGE), self.trainer.topo.grid(name)
        grad = late = None
        if lg.is_member and lg.coords["pp"] == 0:
            grad = self.boundary_grad.pop(name) if mb is None else self.gx.pop((name, mb))
        deferred = mb is not None and self._defers(name, mb - 1)
        if deferred and grad is not None:  # split where the kept window's rows end
            n = self.data.windows.llm_tokens(name, lg.coords["dp"], mb)
            grad, late = grad[:n], grad[n:]
        comm = self.trainer.comms[name]
        # Backward calls consume the edge's forwards in order: the kept window, then the deferred one.
        out = comm.backward(grad)
        late_out = comm.backward(late) if deferred else None
        if not (g.is_member and g.is_last_stage):
            return
        if late_out is not None:
            self.late_gy[(name, mb - 1)] = late_out
        if out is None:
            return
        if mb is not None or g.layout.pp == 1:
            self.gy[(name, mb)] = out
            return
        offset = 0  # a pipelined colocated encoder: the step's gradient, cut back into its chunks
        for c in range(self.trainer.num_microbatches):
            n = self.y[(name, c)].shape[0]
            self.gy[(name, c)] = out[offset:offset + n]
            offset += n

    def local(self, a: Action) -> None:
        if a.op == OPTIMIZER:
            self.trainer.optim.step_module(a.module)
        elif a.op == OFFLOAD:
            self.trainer.offload.to_host()
        elif a.op == RELOAD:
            self.trainer.offload.to_device()
        else:
            raise ValueError(f"the executor does not know the action {a.op!r}")
