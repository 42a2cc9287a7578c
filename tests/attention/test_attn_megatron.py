"""BitfieldCoreAttention inside a tiny megatron-core GPTModel on CPU (1 rank, gloo)."""

import pytest
import torch
import torch.distributed as dist

from mimo.attention import BitfieldMask, KernelConfig, build_bitfield_mask
from mimo.attention.core_attention import BitfieldCoreAttention, bitfield_layer_spec


@pytest.fixture
def model_parallel(tmp_path):
    from megatron.core import parallel_state as ps

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.fail("this test needs a single-rank process group")
    owned = not ps.model_parallel_is_initialized()
    if owned:
        ps.initialize_model_parallel(1, 1)
    yield
    if owned:
        ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def _model(spec):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    # learned_absolute: megatron's RoPE moves its buffer to torch.cuda.current_device().
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=64,
                    position_embedding_type="learned_absolute")


def test_gpt_model_matches_reference_dense_path(model_parallel):
    tiles = KernelConfig(16, 16, 16, 16, split_tiles=1)
    kernel_model = _model(bitfield_layer_spec(kernel_config=tiles))
    dense_model = _model(bitfield_layer_spec(use_reference=True))
    assert isinstance(kernel_model.decoder.layers[0].self_attention.core_attention, BitfieldCoreAttention)

    b, s = 2, 40
    ids = torch.randint(0, 60, (b, s), generator=torch.Generator().manual_seed(3))
    ids[:, 4:14] = 61
    ids[1, 25:33] = 62
    docs = torch.zeros(b, s, dtype=torch.int64)
    docs[1, 20:] = 1
    positions = torch.arange(s).expand(b, s)
    masks = [BitfieldMask(build_bitfield_mask(ids, {61: 1, 62: 2}, text_sees={1}), docs), None]
    for mask in masks:
        outs = []
        for model in (kernel_model, dense_model):
            model.zero_grad()
            logits = model(ids, positions, mask)
            (logits.square().mean()).backward()
            outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (lk, gk), (ld, gd) = outs
        torch.testing.assert_close(lk, ld, atol=1e-5, rtol=1e-5)
        for name in gd:
            torch.testing.assert_close(gk[name], gd[name], atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    # The tensor form (needed under megatron's activation recomputation) gives the same logits.
    mask = masks[0]
    torch.testing.assert_close(kernel_model(ids, positions, mask.to_tensor()), kernel_model(ids, positions, mask))


def test_rejects_unsupported_settings(model_parallel):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="attention_dropout"):
        BitfieldCoreAttention(config, 1, AttnMaskType.causal, "self")
    core = BitfieldCoreAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.0)
    x = torch.zeros(8, 1, 2, 8)
    with pytest.raises(TypeError, match="boolean"):
        core(x, x, x, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        core(x, x, x, BitfieldMask(torch.ones(1, 7, dtype=torch.int64)))
