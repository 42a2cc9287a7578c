"""All-gather context parallelism for bitfield attention (Cornstarch §6.2, Llama-3 style).

Each rank of a context-parallel (CP) group holds some query blocks of the
sequence (chosen by ``mimo.attention.balance``), concatenated in ascending
block order and padded to a common local length ``L``. The layout of the
whole group is one int64 tensor, ``slots`` [cp, L]: ``slots[r, i]`` is the
global token index held at local position ``i`` of rank ``r``, or -1 for a
padding slot. Attention then needs:

* queries: this rank's L tokens; their bits/doc ids are the full-sequence ones
  gathered at ``slots[r]``, their positions are the global token indices;
* keys/values: all-gathered over the CP group, giving cp*L keys in the
  flattened ``slots`` order; their bits/positions/doc ids are looked up the
  same way from the full-sequence mask every rank holds. Padding slots get
  bits 0, so they attend nothing and are seen by nothing (the contract's
  padding rule); no un-permutation of K/V is ever needed.

Backward of the all-gather is a reduce-scatter of dK/dV (``reduce_scatter_single``,
which NCCL and gloo both provide).

``ContextParallelMask`` carries bits, document ids and ``slots`` (per
microbatch, shared by every layer and pipeline stage); ``to_tensor()`` packs it
into one 1-D int64 tensor so it can go wherever megatron expects tensors
(activation recomputation, pipeline hand-off).

No device read in the step: a mask's header (b, s, cp, L, rank) is known on the
host, where the microbatch was made. ``to_tensor()`` registers the packed tensor
with the mask it came from, keyed by the tensor's storage, so layers handed the
packed form (recomputed layers in forward and again in backward, whose
checkpoint saved it and hands back a detached alias) find the same mask object
(its derived tensors, hence the attention plans) without reading the header
back. An entry lives exactly as long as its packed tensor's storage, i.e. while
its microbatch is in flight (autograd keeps the saved tensor until the
backward), so nothing is evicted however many microbatches are in flight, and
nothing outlives them. Only a packed tensor made elsewhere (another process)
is decoded from its header (``from_tensor``), which reads it from the device.

Overlap: with ``head_chunks > 1`` the K/V all-gathers of all head chunks are
started asynchronously up front and attention runs chunk by chunk as each
gather completes, so transfers of later chunks overlap the attention of
earlier ones (forward only; the backward reduce-scatters are synchronous).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .function import bitfield_attention_general
from .reference import reference_attention_general

_MAGIC = 0x4D494D4F43500001  # "MIMOCP" + version; first element of the packed tensor form
_HEADER = 7                  # magic, b, s, cp, L, rank, has_doc


class ContextParallelMask:
    """The attention mask of one CP rank: full-sequence bits + the group's token layout.

    bits: int64 [b, s]; document_ids: optional [b, s]; slots: int64 [cp, L]
    (global token index per local slot, -1 = padding); cp_rank: this rank.
    Derived tensors are built once and cached, so every layer sees the same
    tensor objects (the attention block-plan cache is keyed on them).
    """

    def __init__(self, bits: torch.Tensor, slots: torch.Tensor, cp_rank: int,
                 document_ids: Optional[torch.Tensor] = None, validate: bool = True):
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.int64 or bits.dim() != 2:
            raise TypeError("ContextParallelMask.bits must be an int64 tensor [b, s]")
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 2:
            raise TypeError("ContextParallelMask.slots must be an int64 tensor [cp, L]")
        if document_ids is not None and tuple(document_ids.shape) != tuple(bits.shape):
            raise ValueError(f"document_ids shape {tuple(document_ids.shape)} differs from bits {tuple(bits.shape)}")
        if not 0 <= int(cp_rank) < slots.shape[0]:
            raise ValueError(f"cp_rank {cp_rank} out of range for {slots.shape[0]} ranks")
        if validate:
            check_slots(slots, bits.shape[1])
        self.bits = bits
        self.document_ids = None if document_ids is None else document_ids.to(torch.int64)
        self.slots = slots.to(bits.device)
        self.cp_rank = int(cp_rank)
        self._cache: dict = {}
        self._lock = threading.Lock()

    # -- shapes ---------------------------------------------------------------------------
    @property
    def cp_size(self) -> int:
        return self.slots.shape[0]

    @property
    def local_len(self) -> int:
        return self.slots.shape[1]

    @property
    def seq_len(self) -> int:
        return self.bits.shape[1]

    @property
    def batch(self) -> int:
        return self.bits.shape[0]

    # -- derived tensors ------------------------------------------------------------------
    def _derived(self):
        with self._lock:
            if not self._cache:
                local = self.slots[self.cp_rank]
                flat = self.slots.reshape(-1)
                self._cache.update(
                    q_positions=local.clamp(min=0), k_positions=flat.clamp(min=0),
                    q_bits=gather_tokens(self.bits, local, 0), k_bits=gather_tokens(self.bits, flat, 0),
                    q_document_ids=None if self.document_ids is None else gather_tokens(self.document_ids, local, -1),
                    k_document_ids=None if self.document_ids is None else gather_tokens(self.document_ids, flat, -1),
                )
            return self._cache

    @property
    def q_positions(self) -> torch.Tensor:
        """Global token index of each local slot (0 for padding), int64 [L]."""
        return self._derived()["q_positions"]

    def attention_args(self) -> dict:
        """Keyword arguments of ``bitfield_attention_general`` (masks, positions, document ids)."""
        d = self._derived()
        return dict(q_mask=d["q_bits"], k_mask=d["k_bits"], q_positions=d["q_positions"],
                    k_positions=d["k_positions"], q_document_ids=d["q_document_ids"],
                    k_document_ids=d["k_document_ids"])

    # -- tensor form ------------------------------------------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """One 1-D int64 tensor: header, bits, [document ids], slots (see ``from_tensor``), registered
        with this mask (``as_context_parallel_mask`` finds the mask again without reading it)."""
        b, s = self.bits.shape
        has_doc = self.document_ids is not None
        header = _to_device([_MAGIC, b, s, self.cp_size, self.local_len, self.cp_rank, int(has_doc)],
                            self.bits.device)
        parts = [header, self.bits.reshape(-1)]
        if has_doc:
            parts.append(self.document_ids.reshape(-1))
        parts.append(self.slots.reshape(-1))
        packed = torch.cat(parts)
        _register(packed, self)
        return packed

    @staticmethod
    def is_tensor_form(t) -> bool:
        """Whether ``t`` is a packed mask: shape and dtype, then the magic number, READ FROM THE DEVICE
        (``as_context_parallel_mask`` asks the registry first)."""
        return (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1
                and t.numel() >= _HEADER and int(t[0]) == _MAGIC)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "ContextParallelMask":
        """The mask of a packed tensor: the registered one, else decoded from the header (a device read;
        only for packed tensors made in another process)."""
        mask = registered_mask(t)
        if mask is not None:
            return mask
        if not ContextParallelMask.is_tensor_form(t):
            raise ValueError("not a packed ContextParallelMask tensor")
        _, b, s, cp, L, rank, has_doc = (int(x) for x in t[:_HEADER].tolist())
        o = _HEADER
        bits = t[o:o + b * s].reshape(b, s)
        o += b * s
        docs = None
        if has_doc:
            docs = t[o:o + b * s].reshape(b, s)
            o += b * s
        slots = t[o:o + cp * L].reshape(cp, L)
        if o + cp * L != t.numel():
            raise ValueError("packed ContextParallelMask tensor has the wrong length")
        return ContextParallelMask(bits, slots, rank, docs, validate=False)


def _to_device(values, device) -> torch.Tensor:
    """A small int64 host list on `device` without waiting for it: a blocking host-to-device copy
    synchronises the CUDA stream; from pinned memory the copy is queued."""
    t = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# Packed tensor -> the mask it packs, for as long as the tensor's storage lives (see the module
# docstring). Keyed by the storage (a detached alias, as megatron's recompute hands its saved inputs
# back, shares it), its offset and length; the entry keeps a weak reference to the storage, checked
# on each hit, and a finalizer on the storage removes it.
_registry: dict = {}
_registry_lock = threading.RLock()  # re-entrant: a finalizer may run while this thread holds it


def _storage_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), str(t.device))


def _forget(key) -> None:
    with _registry_lock:
        _registry.pop(key, None)


def _register(packed: torch.Tensor, mask: "ContextParallelMask") -> None:
    storage = packed.untyped_storage()
    key = _storage_key(packed)
    with _registry_lock:
        _registry[key] = (weakref.ref(storage), packed._version, mask)
    weakref.finalize(storage, _forget, key)


def registered_mask(t) -> Optional["ContextParallelMask"]:
    """The mask a packed tensor (or an alias of it: aliases share the storage and the version counter)
    was made from by ``to_tensor``, else None (also after an in-place change of it). Host metadata
    only: no device read."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
        return None
    key = _storage_key(t)
    with _registry_lock:
        hit = _registry.get(key)
    if hit is None or hit[0]() is not t.untyped_storage() or hit[1] != t._version:
        return None
    return hit[2]


def masks_in_flight() -> int:
    """Registered packed masks still alive (their microbatches' forward or backward is pending)."""
    with _registry_lock:
        return len(_registry)


def as_context_parallel_mask(attention_mask) -> Optional[ContextParallelMask]:
    """The ContextParallelMask in ``attention_mask`` (object or packed tensor), else None.

    A packed tensor made by ``to_tensor`` in this process (every layer's, recomputed ones included)
    is found in the registry without reading it; only a foreign one is decoded from the device."""
    if isinstance(attention_mask, ContextParallelMask):
        return attention_mask
    mask = registered_mask(attention_mask)
    if mask is not None:
        return mask
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 1:
        return None  # a BitfieldMask's tensor form is 2-D or 3-D: decided without a read
    # A foreign packed tensor: decoded once per tensor object (every layer of a forward gets the same
    # one) and kept on the object itself, so it goes when the tensor does. The kept mask owns copies:
    # views would keep the tensor alive through their base, a cycle the garbage collector cannot see.
    version, mask = getattr(attention_mask, "_mimo_cp_mask", (None, None))
    if version != attention_mask._version:
        mask = None
        if ContextParallelMask.is_tensor_form(attention_mask):
            m = ContextParallelMask.from_tensor(attention_mask)
            mask = ContextParallelMask(m.bits.clone(), m.slots.clone(), m.cp_rank,
                                       None if m.document_ids is None else m.document_ids.clone(), validate=False)
            attention_mask._mimo_cp_mask = (attention_mask._version, mask)
    return mask


def check_slots(slots: torch.Tensor, seq_len: int) -> None:
    """Raise unless ``slots`` holds every index 0..seq_len-1 exactly once (rest -1)."""
    flat = slots.reshape(-1)
    valid = flat[flat >= 0]
    if bool((flat < -1).any()) or valid.numel() != seq_len or (valid.numel() and int(valid.max()) >= seq_len):
        raise ValueError(f"slots must hold each token index 0..{seq_len - 1} exactly once (padding -1)")
    if valid.numel() and not torch.equal(torch.sort(valid).values, torch.arange(seq_len, device=valid.device)):
        raise ValueError(f"slots must hold each token index 0..{seq_len - 1} exactly once (padding -1)")


def gather_tokens(x: torch.Tensor, index: torch.Tensor, pad_value=0, dim: int = 1) -> torch.Tensor:
    """``x`` gathered along ``dim`` at ``index`` (1-D, -1 = padding filled with ``pad_value``)."""
    index = index.to(x.device)
    valid = index >= 0
    out = torch.index_select(x, dim, index.clamp(min=0))
    shape = [1] * out.dim()
    shape[dim] = index.numel()
    return torch.where(valid.reshape(shape), out, torch.full_like(out, pad_value))


# ---------------------------------------------------------------------------------------------
# Collectives


def _reduce_scatter_dim0(grad: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    grad = grad.contiguous()
    out = torch.empty((grad.shape[0] // world, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_single(out, grad, group=group)
    return out


class _GatherStart(torch.autograd.Function):
    """All-gather along dim 0 (async start); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, pending: list, async_op: bool):
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_gather_single(out, x, group=group, async_op=async_op)
        pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None, None, None


class _GatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending: list):
        work = pending.pop(0)
        if work is not None:
            work.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------------------------
# Attention


def _attend_fn(use_reference: bool, kernel_config) -> Callable:
    if use_reference:
        return reference_attention_general
    return lambda *a, **k: bitfield_attention_general(*a, kernel_config=kernel_config, **k)


def context_parallel_attention_sbhd(query, key, value, mask: ContextParallelMask, group=None,
                                    softmax_scale=None, use_reference: bool = False, kernel_config=None,
                                    head_chunks: int = 1) -> torch.Tensor:
    """Megatron layout: query [L, b, hq, d], key/value [L, b, hkv, d] (local) -> [L, b, hq, d].

    ``group`` is the CP process group (its size must equal ``mask.cp_size``; None only when
    cp_size is 1). The causal test uses global token positions.
    """
    cp = mask.cp_size
    if cp > 1:
        if group is None:
            raise ValueError("context-parallel attention with cp_size > 1 needs the CP process group")
        if dist.get_world_size(group) != cp:
            raise ValueError(f"CP group has {dist.get_world_size(group)} ranks but the mask was planned for {cp}")
        if dist.get_rank(group) != mask.cp_rank:
            raise ValueError(f"mask is for CP rank {mask.cp_rank} but this is CP rank {dist.get_rank(group)}")
    L, b, hq, d = query.shape
    hkv = key.shape[2]
    if (L, b) != (mask.local_len, mask.batch):
        raise ValueError(f"local q has [s={L}, b={b}] but the CP mask expects [s={mask.local_len}, b={mask.batch}]")
    if head_chunks < 1 or hkv % head_chunks:
        raise ValueError(f"head_chunks ({head_chunks}) must divide the key/value heads ({hkv})")
    attend = _attend_fn(use_reference, kernel_config)
    args = mask.attention_args()
    if cp == 1:
        out = attend(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                     softmax_scale=softmax_scale, **args)
        return out.transpose(0, 1)
    # Start every chunk's K and V gathers now; consume them in order.
    kv_chunk, q_chunk = hkv // head_chunks, hq // head_chunks
    pending: list = []
    started = []
    for c in range(head_chunks):
        sl = slice(c * kv_chunk, (c + 1) * kv_chunk)
        started.append((_GatherStart.apply(key[:, :, sl], group, pending, True),
                        _GatherStart.apply(value[:, :, sl], group, pending, True)))
    outs = []
    for c, (k_all, v_all) in enumerate(started):
        k_all = _GatherWait.apply(k_all, pending)
        v_all = _GatherWait.apply(v_all, pending)
        q = query[:, :, c * q_chunk:(c + 1) * q_chunk]
        o = attend(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
                   softmax_scale=softmax_scale, **args)
        outs.append(o.transpose(0, 1))
    return outs[0] if head_chunks == 1 else torch.cat(outs, dim=2)


def context_parallel_attention(q, k, v, mask: ContextParallelMask, group=None, softmax_scale=None,
                               use_reference: bool = False, kernel_config=None, head_chunks: int = 1):
    """Batch-major form: q [b, L, hq, d], k/v [b, L, hkv, d] (this rank's tokens) -> [b, L, hq, d]."""
    out = context_parallel_attention_sbhd(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, group,
                                          softmax_scale, use_reference, kernel_config, head_chunks)
    return out.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# RoPE at global positions for megatron's GPTModel


class GlobalPositionRotaryEmbedding(torch.nn.Module):
    """Wraps megatron's RotaryEmbedding: under a ContextParallelMask, the table rows of the
    local tokens' global positions; otherwise the wrapped module's own result.

    megatron's GPTModel builds RoPE from the local sequence length (times cp, then its
    zigzag slice), which is wrong for a balanced permutation. RotaryEmbedding holds no
    parameters or buffers, so wrapping it changes no state-dict key.
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.current: Optional[ContextParallelMask] = None

    def forward(self, max_seq_len, offset: int = 0, packed_seq: bool = False, cp_group=None):
        mask = self.current
        if mask is None:
            return self.inner(max_seq_len, offset, packed_seq, cp_group)
        emb = self.inner.get_emb(mask.seq_len, offset)               # [s, 1, 1, dim]
        return emb[mask.q_positions.to(emb.device)]                  # [L, 1, 1, dim]

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def get_cos_sin(self, *args, **kwargs):
        return self.inner.get_cos_sin(*args, **kwargs)

    def get_emb(self, *args, **kwargs):
        return self.inner.get_emb(*args, **kwargs)


def enable_context_parallel_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Make a megatron GPTModel use global positions for RoPE when called with a CP mask.

    Replaces ``model.rotary_pos_emb`` by ``GlobalPositionRotaryEmbedding`` and adds
    forward hooks that read ``attention_mask`` (keyword or 3rd positional argument)
    of each call. Idempotent; a model without RoPE, or with M-RoPE, is returned unchanged.
    """
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or isinstance(rope, GlobalPositionRotaryEmbedding):
        return model
    if getattr(model, "position_embedding_type", None) == "mrope":
        # M-RoPE reads each token's positions from `position_ids`, which `shard_microbatch` already
        # cut to this rank's slots: the table is right as megatron builds it.
        return model
    wrapper = GlobalPositionRotaryEmbedding(rope)
    model.rotary_pos_emb = wrapper

    def pre_hook(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        wrapper.current = as_context_parallel_mask(mask)

    def post_hook(module, args, kwargs, output):
        wrapper.current = None

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
    return model
