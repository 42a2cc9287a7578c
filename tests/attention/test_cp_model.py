"""A tiny megatron GPTModel with balanced context parallelism equals the CP=1 run.

4-rank launches: CP=2 (layout tp1 cp2 dp2: CP groups {0,1}, {2,3}) and
TP2 x CP2 (CP groups {0,2}, {1,3}). Each rank also builds the CP=1 model with
the same TP (CP ranks re-labelled as DP), loads the CP model's weights into it
and runs the full sequence: the reference. The CP run sees only its permuted
local tokens (RoPE at global positions), sums its masked per-token losses over
the global token count, and all-reduces the loss and the parameter gradients
over the CP group (parameters are replicated across CP ranks).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mimo.runtime import run_on_ranks

TOL = dict(atol=1e-5, rtol=1e-4)
IMG, AUD = 61, 62


def _batch(b, s, seed):
    from mimo.attention import build_bitfield_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (b, s), generator=g)
    ids[0, 3:19] = IMG
    ids[0, 40:51] = AUD
    ids[1, 20:45] = IMG
    docs = torch.zeros(b, s, dtype=torch.int64)
    docs[1, 50:] = 1
    ids[1, 70:] = 0  # padding at the end of sample 1
    bits = build_bitfield_mask(ids, {IMG: 1, AUD: 2}, text_sees={1, 2}, pad_id=0)
    labels = torch.roll(ids, -1, dims=1)  # shifted before the permutation
    loss_mask = ((bits & 1) != 0).float()
    loss_mask[:, -1] = 0
    return ids, bits, docs, labels, loss_mask


def _model(layout, pgc):
    from megatron.core.models.gpt import GPTModel

    from mimo.model.specs import llm_layer_spec
    from mimo.model.transformer_config import transformer_config

    cfg = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=64)
    return GPTModel(config=transformer_config(cfg, layout, "fp32"), transformer_layer_spec=llm_layer_spec("bitfield"),
                    vocab_size=64, max_sequence_length=128, pre_process=True, post_process=True,
                    parallel_output=True, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", pg_collection=pgc)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _case(tp, cp, policy, block, packed_mask=False):
    from mimo.attention import BitfieldMask
    from mimo.attention.context_parallel import enable_context_parallel_rope
    from mimo.attention.cp_permute import plan_context_parallel, shard_microbatch, unpermute
    from mimo.topology import Layout, build_module_grid

    world = dist.get_world_size()
    layout = Layout(tp=tp, cp=cp, dp=world // (tp * cp))
    ref_layout = Layout(tp=tp, cp=1, dp=world // tp)
    grid = build_module_grid(f"llm_tp{tp}_cp{cp}", layout)
    ref_grid = build_module_grid(f"ref_tp{tp}", ref_layout)
    pgc, ref_pgc = grid.pg_collection(), ref_grid.pg_collection()
    cp_group = pgc.cp
    cp_rank = dist.get_rank(cp_group)

    torch.manual_seed(1234)
    model = enable_context_parallel_rope(_model(layout, pgc))
    with torch.no_grad():
        # Sharpen attention (init std 0.02 makes it nearly uniform), so that a wrong
        # position or mask shows up clearly in the losses.
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.weight.mul_(40.0)
    ref = _model(ref_layout, ref_pgc)
    ref.load_state_dict(model.state_dict())

    b, s = 2, 75  # not a multiple of the block size
    ids, bits, docs, labels, loss_mask = _batch(b, s, seed=5)
    positions = torch.arange(s).expand(b, s)
    n_tokens = loss_mask.sum()

    # Reference: the whole sequence on one CP rank.
    per_token_ref = ref(ids, positions, BitfieldMask(bits, docs), labels=labels)
    loss_ref = (per_token_ref * loss_mask).sum() / n_tokens
    loss_ref.backward()
    grads_ref = _grads(ref)

    # Context parallel: this rank's permuted tokens only.
    slots = plan_context_parallel(bits, cp, block, policy, docs)
    local = shard_microbatch(slots, cp_rank, bits=bits, document_ids=docs, input_ids=ids, position_ids=positions,
                             labels=labels, loss_mask=loss_mask)
    # The packed tensor form is what activation recomputation / pipeline hand-off carry.
    attention_mask = local["attention_mask"].to_tensor() if packed_mask else local["attention_mask"]
    per_token = model(local["input_ids"], local["position_ids"], attention_mask, labels=local["labels"])
    loss_local = (per_token * local["loss_mask"]).sum() / n_tokens
    loss_local.backward()
    loss = loss_local.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    tag = f"tp{tp} cp{cp} {policy}"
    torch.testing.assert_close(loss, loss_ref.detach(), **TOL, msg=lambda m: f"{tag} loss: {m}")

    # Per-token losses, gathered over CP and un-permuted, equal the reference's.
    gathered = [torch.empty_like(per_token) for _ in range(cp)]
    dist.all_gather(gathered, per_token.detach().contiguous(), group=cp_group)
    full = unpermute(gathered, slots)
    torch.testing.assert_close(full, per_token_ref.detach(), **TOL, msg=lambda m: f"{tag} per-token loss: {m}")
    wrong = plan_context_parallel(bits, cp, block, "contiguous", docs)
    assert not torch.equal(wrong, slots)
    assert wrong.shape != slots.shape or not torch.allclose(unpermute(gathered, wrong), per_token_ref, **TOL), \
        f"{tag}: un-permuting with the wrong layout passed"

    # Gradients: each CP rank holds a partial sum; the CP all-reduce completes it.
    grads = _grads(model)
    assert grads.keys() == grads_ref.keys()
    partial_differs = any(not torch.allclose(grads[n], grads_ref[n], **TOL) for n in grads)
    for n in grads:
        dist.all_reduce(grads[n], group=cp_group)
        torch.testing.assert_close(grads[n], grads_ref[n], **TOL, msg=lambda m, n=n: f"{tag} grad {n}: {m}")
    assert partial_differs, f"{tag}: gradients matched before the CP reduction (test would not see a missing sum)"
    return tag, float(loss)


def _model_worker(cases):
    from mimo.runtime import megatron_scope, select_runtime

    with megatron_scope(select_runtime("cpu")):  # megatron-core's CPU adaptation, as the trainer scopes it
        return [_case(*c) for c in cases]


# The default run keeps the TP2 x CP2 case with the packed mask (it covers the CP1 comparison, TP x CP and
# the tensor-form mask); the CP-only cases run with -m slow. CP-only training with the default (lpt) and
# zigzag policies stays in the default run through tests/test_pipeline_parity.py
# (test_context_parallel_training_equals_cp1[cp2], test_context_parallel_policies_agree[zigzag]).
@pytest.mark.parametrize("cases", [
    [(2, 2, "lpt", 16, True)],
    pytest.param([(1, 2, "lpt", 16), (1, 2, "zigzag", 16)], marks=pytest.mark.slow),
], ids=["tp2xcp2-packed", "cp2-policies"])
def test_gpt_model_cp_matches_cp1(monkeypatch, cases):
    # Dense reference backend inside bitfield attention (fast on CPU); same semantics as the kernels.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    results = run_on_ranks(_model_worker, 4, cases, timeout_s=600)
    for rank_result in results:
        assert [t for t, _ in rank_result] == [f"tp{c[0]} cp{c[1]} {c[2]}" for c in cases]
    # Every rank of a run reports the same (global) loss.
    for i in range(len(cases)):
        losses = {round(r[i][1], 6) for r in results}
        assert len(losses) == 1, losses
