"""Context parallelism with activation recompute reads nothing back from the device during the step.

A recomputing GPTModel gets its attention mask in packed tensor form (megatron's checkpoint saves
only tensors; `mimo.model.sequence_parallel.tensor_masks_when_recomputing`), in forward and again in
the backward's recomputed forward. Its header (b, s, cp, L, rank) is host knowledge from when the
microbatch was made; the mask object is found again by the packed tensor's storage, never by
reading the tensor. Here every Python-level read of a tensor's value (`item`, `tolist`, `int()`,
`float()`, `bool()`, `__index__`) raises during the forwards and backwards of more microbatches in
flight than the old unpack cache held (8), on 2 CP ranks, with `selective` and `full` recompute. The
only read allowed is megatron-core's own `attn_mask_type.item()` in selective recompute, of a tensor
it makes on the host (`torch.tensor([value])`, no device). Negative controls: the guard catches a
plain read, and with the registry turned off the header IS read (and caught).
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from host_reads import on_host_reads

from mimo.runtime import run_on_ranks

IMG = 61
MICROBATCHES = 10  # in flight at once: more than the old 8-entry unpack cache held
# megatron-core's selective recompute packs the mask type into a host tensor and reads it back
# (megatron/core/transformer/attention.py, `_checkpointed_attention_forward.custom_forward`).
ALLOWED = {("attention.py", "custom_forward")}


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads(log):
    """Every Python-level read of a tensor's value raises HostRead (and is logged), except ALLOWED."""
    def refuse(name, tensor, caller):
        where = (caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_code.co_name)
        if where in ALLOWED and not tensor.is_cuda:
            return
        msg = f"{name}() of a {tuple(tensor.shape)} tensor at {caller.f_code.co_filename}:{caller.f_lineno}"
        log.append(msg)
        raise HostRead(msg)

    with on_host_reads(refuse):
        yield


def _batch(b, s, seed):
    from mimo.attention import build_bitfield_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (b, s), generator=g)
    start = int(torch.randint(0, 30, (1,), generator=g))
    ids[0, start:start + 16] = IMG
    docs = torch.zeros(b, s, dtype=torch.int64)
    docs[1, 40 + seed % 20:] = 1
    bits = build_bitfield_mask(ids, {IMG: 1}, text_sees={1}, pad_id=0)
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = ((bits & 1) != 0).float()
    loss_mask[:, -1] = 0
    return ids, bits, docs, labels, loss_mask


def _model(layout, pgc, recompute):
    from megatron.core.models.gpt import GPTModel

    from mimo.attention.context_parallel import enable_context_parallel_rope
    from mimo.model.sequence_parallel import tensor_masks_when_recomputing
    from mimo.model.specs import llm_layer_spec
    from mimo.model.transformer_config import transformer_config

    cfg = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=64)
    par = SimpleNamespace(sp=False, recompute=recompute)
    model = GPTModel(config=transformer_config(cfg, layout, "fp32", par=par),
                     transformer_layer_spec=llm_layer_spec("bitfield"), vocab_size=64, max_sequence_length=128,
                     pre_process=True, post_process=True, parallel_output=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", pg_collection=pgc)
    # As mimo builds its LLM (`build_llm`, then the trainer's CP RoPE).
    return enable_context_parallel_rope(tensor_masks_when_recomputing(model))


def _microbatches(cp):
    """Each microbatch as the trainer's `llm_microbatch` leaves it, before the step: the slots planned
    and checked on the host."""
    from mimo.attention import plan_context_parallel
    from mimo.attention.context_parallel import check_slots

    out = []
    for k in range(MICROBATCHES):
        ids, bits, docs, labels, loss_mask = _batch(2, 75, seed=k)
        slots = plan_context_parallel(bits, cp, 16, "lpt", docs)
        check_slots(slots, bits.shape[1])
        out.append(dict(input_ids=ids, bits=bits, document_ids=docs, labels=labels, loss_mask=loss_mask,
                        position_ids=torch.arange(75).expand(2, 75), cp_slots=slots))
    return out


def _step(model, batches, cp_rank, log):
    """Every microbatch's forward, then every backward (all in flight at once), guarded, from this CP
    rank's cut of each microbatch (`shard_microbatch(..., validate=False)`, as `RankStep._cp_slice`)."""
    from mimo.attention import shard_microbatch
    from mimo.attention.context_parallel import masks_in_flight

    with no_host_reads(log):
        losses = []
        for b in batches:
            mb = shard_microbatch(b["cp_slots"], cp_rank, bits=b["bits"], document_ids=b["document_ids"],
                                  input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                                  loss_mask=b["loss_mask"], validate=False)
            per_token = model(mb["input_ids"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])
            losses.append((per_token * mb["loss_mask"]).sum())
        in_flight = masks_in_flight()
        for loss in reversed(losses):
            loss.backward()
    return in_flight, torch.stack([l.detach() for l in losses])


def _worker():
    from mimo.attention import context_parallel
    from mimo.runtime import megatron_scope, select_runtime
    from mimo.topology import Layout, build_module_grid

    layout = Layout(cp=2)
    pgc = build_module_grid("llm_cp2_recompute", layout).pg_collection()
    cp_rank = dist.get_rank(pgc.cp)
    out = {}
    with megatron_scope(select_runtime("cpu")):
        torch.manual_seed(7)
        reference = _model(layout, pgc, "none")
        batches = _microbatches(2)
        _step(reference, batches, cp_rank, [])
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        for kind in ("selective", "full"):
            model = _model(layout, pgc, kind)
            model.load_state_dict(reference.state_dict())
            log = []
            in_flight, losses = _step(model, batches, cp_rank, log)
            same = all(torch.allclose(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6)
                       for n, p in model.named_parameters())
            out[kind] = dict(reads=log, in_flight=in_flight, after=context_parallel.masks_in_flight(),
                             grads_match=same)

        # Negative controls. The guard catches a read:
        log = []
        with pytest.raises(HostRead), no_host_reads(log):
            torch.ones(1).item()
        out["guard"] = log
        # Without the registry the recomputed layers must decode the header, from the device.
        model = _model(layout, pgc, "full")
        original = context_parallel.registered_mask
        context_parallel.registered_mask = lambda t: None
        log = []
        try:
            with pytest.raises(HostRead):
                _step(model, batches[:1], cp_rank, log)
        finally:
            context_parallel.registered_mask = original
        out["no_registry"] = log
    return out


def test_cp_recompute_forward_backward_reads_nothing_from_the_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the dense reference inside bitfield attention (CPU)
    for r in run_on_ranks(_worker, 2, timeout_s=600):
        for kind in ("selective", "full"):
            got = r[kind]
            assert got["reads"] == [], got["reads"]
            assert got["grads_match"], f"{kind}: recomputed gradients differ from the run without recompute"
            # Every microbatch's packed mask was alive at once, and none outlives its backward.
            assert got["in_flight"] >= MICROBATCHES and got["after"] == 0, got
        assert len(r["guard"]) == 1
        assert r["no_registry"] and any("context_parallel.py" in m for m in r["no_registry"]), r["no_registry"]


def test_packed_mask_registry_lives_with_the_packed_tensor():
    """to_tensor registers the packed form with its mask: found again from any alias without a read,
    gone when the packed tensor is; an in-place change, or a tensor made elsewhere (a copy), is
    decoded from its header instead, and a decoded mask kept on a foreign tensor does not keep it alive."""
    import weakref

    from mimo.attention import causal_mask, plan_context_parallel, shard_microbatch
    from mimo.attention.context_parallel import as_context_parallel_mask, masks_in_flight

    before = masks_in_flight()
    bits = causal_mask(2, 40)
    mask = shard_microbatch(plan_context_parallel(bits, 2, 8), 1, bits=bits)["attention_mask"]
    packed = mask.to_tensor()
    log = []
    with no_host_reads(log):
        assert as_context_parallel_mask(packed) is mask and as_context_parallel_mask(packed.detach()) is mask
        assert as_context_parallel_mask(bits) is None  # a BitfieldMask's tensor form: 2-D, no read either
    assert log == [] and masks_in_flight() == before + 1
    foreign = packed.clone()
    with pytest.raises(HostRead), no_host_reads(log):  # negative control: not registered, so decoded
        as_context_parallel_mask(foreign)
    decoded = as_context_parallel_mask(foreign)
    assert decoded is not mask and as_context_parallel_mask(foreign) is decoded
    assert torch.equal(decoded.bits, mask.bits) and torch.equal(decoded.slots, mask.slots) and decoded.cp_rank == 1
    freed = []
    weakref.finalize(foreign.untyped_storage(), freed.append, True)
    del decoded, foreign
    assert freed == [True]
    packed.add_(0)  # an in-place change: the registered mask no longer describes it
    assert as_context_parallel_mask(packed) is not mask
    del packed
    assert masks_in_flight() == before
