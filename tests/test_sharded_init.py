"""`training.init: sharded`: a part's initial weights do not depend on the layout.

Oracle: the 1-rank (TP 1, PP 1) sharded-initialised module. A TP2 / PP2 part
must hold exactly the TP slice of the same global parameter of it. Parts of
several layouts are built in one gloo rank: megatron's constructors only ask
their TP group for its size and rank, so a stand-in group gives each TP rank's
shapes without any collective. The distribution is checked against the
modules' own initialisation (megatron's and torch's, `init: local`).
"""

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo.config import ConfigError, LANGUAGE, load_config
from mimo.model import build_encoder, build_llm
from mimo.model.encoder_stages import build_encoder_stage
from mimo.model.reference_init import global_name, tp_slice
from mimo.model.sharded_init import init_kind, init_sharded
from mimo.model.stages import build_llm_stage, stage_layer_offset
from mimo.runtime import run_on_ranks
from mimo.topology import Layout
from tiny import tiny

MODULES = (LANGUAGE, "images", "audio")
# (tp, pp) layouts compared with the 1-rank module.
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


class _TPGroup:
    """Stands in for a TP group of `size` ranks at construction time (size and rank are all megatron asks)."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _raw(tp=1, pp=1, init="sharded"):
    raw = tiny(tp=tp, pp=pp)
    # Strided gated-MLP shards, RMSNorm without bias, CLIP's class token and pre-norm, Whisper's conv front-end.
    raw["model"]["language"].update(activation="swiglu", normalization="RMSNorm")
    raw["model"]["encoders"]["images"].update(num_layers=2, class_token=True, pre_norm=True)
    raw["model"]["encoders"]["audio"].update(num_layers=2, frontend="conv", frames_per_token=2)
    raw["training"]["init"] = init
    return raw


def _groups(tp, tp_rank):
    me = dist.group.WORLD
    pgs = ProcessGroupCollection()
    for key in ("tp", "cp", "pp", "dp", "ep", "tp_cp", "dp_cp", "tp_dp_cp", "mp", "embd", "pos_embd", "expt_tp",
                "tp_ep", "expt_dp"):
        setattr(pgs, key, me)
    group = _TPGroup(tp, tp_rank)
    for key in ("tp", "tp_cp", "mp", "expt_tp", "tp_ep"):
        setattr(pgs, key, group)
    return pgs


def _part(cfg, name, tp_rank, stage):
    """One rank's part of module `name` and the global index of its first layer."""
    par = cfg.parallelism[name]
    layout, pgs = Layout(tp=par.tp, pp=par.pp), _groups(par.tp, tp_rank)
    num_layers = (cfg.model.language if name == LANGUAGE else cfg.model.encoders[name]).num_layers
    offset = stage_layer_offset(num_layers, par, stage)
    if name == LANGUAGE:
        part = (build_llm(cfg, layout, pgs) if par.pp == 1
                else build_llm_stage(cfg, par, layout, stage, pgs, dist.group.WORLD))
    else:
        part = (build_encoder(cfg, name, layout, pgs) if par.pp == 1
                else build_encoder_stage(cfg, name, par, layout, stage, pgs, dist.group.WORLD))
    return part, offset


def _sharded_state(cfg, name, tp_rank, stage, offset=None):
    """{global name: (tensor, TP attributes)} of one sharded-initialised part."""
    part, own_offset = _part(cfg, name, tp_rank, stage)
    offset = own_offset if offset is None else offset
    init_sharded(part, cfg, name, offset, tp_rank, cfg.parallelism[name].tp)
    return {global_name(k, own_offset): (p.detach().clone(), _tp_attrs(p)) for k, p in part.named_parameters()}


def _tp_attrs(p):
    return dict(tensor_model_parallel=getattr(p, "tensor_model_parallel", False),
                partition_dim=getattr(p, "partition_dim", -1), partition_stride=getattr(p, "partition_stride", 1))


def _all_parts():
    """Every (module, layout, tp rank, stage) part, the 1-rank modules, a part initialised with a wrong
    layer offset, and the modules under megatron's / torch's own initialisation."""
    full_cfg = load_config(_raw())
    full = {name: _sharded_state(full_cfg, name, 0, 0) for name in MODULES}
    parts = {}
    for tp, pp in LAYOUTS:
        cfg = load_config(_raw(tp=tp, pp=pp))
        for name in MODULES:
            for tp_rank in range(tp):
                for stage in range(pp):
                    parts[(name, tp, pp, tp_rank, stage)] = _sharded_state(cfg, name, tp_rank, stage)
    cfg = load_config(_raw(pp=2))
    shifted = _sharded_state(cfg, LANGUAGE, 0, 1, offset=0)  # stage 1's layers drawn as if they were layers 0..
    torch.manual_seed(0)
    local_cfg = load_config(_raw(init="local"))
    local = {name: {k: p.detach().clone() for k, p in _part(local_cfg, name, 0, 0)[0].named_parameters()}
             for name in MODULES}
    return dict(full=full, parts=parts, shifted=shifted, local=local)


@pytest.fixture(scope="module")
def built():
    return run_on_ranks(_all_parts, 1)[0]


class _Param:
    def __init__(self, attrs):
        self.__dict__.update(attrs)


def _expected(full, key, attrs, tp_rank, tp):
    return tp_slice(full[key][0], _Param(attrs), tp_rank, tp)


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}_pp{pp}" for tp, pp in LAYOUTS])
@pytest.mark.parametrize("name", MODULES)
def test_part_is_the_slice_of_the_one_rank_module(built, name, tp, pp):
    full = built["full"][name]
    seen = set()
    for tp_rank in range(tp):
        for stage in range(pp):
            for key, (value, attrs) in built["parts"][(name, tp, pp, tp_rank, stage)].items():
                assert key in full, f"{key} is not a parameter of the 1-rank module"
                assert torch.equal(value, _expected(full, key, attrs, tp_rank, tp)), f"{name} {key} tp rank {tp_rank}"
                seen.add(key)
    assert seen == set(full)  # the parts cover the whole module


@pytest.mark.parametrize("name", MODULES)
def test_a_shard_checked_at_the_wrong_tp_rank_differs(built, name):
    """Negative control: the comparison above would notice a rank holding its neighbour's slice."""
    full = built["full"][name]
    drawn = [(k, v, a) for k, (v, a) in built["parts"][(name, 2, 1, 1, 0)].items()
             if a["tensor_model_parallel"] and v.std() > 0]  # random TP-split tensors (not zero biases)
    split = [(k, v, a) for k, v, a in drawn if a["partition_stride"] == 1]
    strided = [(k, v, a) for k, v, a in drawn if a["partition_stride"] != 1]
    assert split
    for key, value, attrs in split + strided:
        assert not torch.equal(value, _expected(full, key, attrs, 0, 2)), key
        if attrs["partition_stride"] != 1:  # a plain chunk is not the strided gated-MLP shard
            assert not torch.equal(value, _expected(full, key, {**attrs, "partition_stride": 1}, 1, 2)), key
    assert strided or name != LANGUAGE


def test_a_stage_drawn_without_its_layer_offset_differs(built):
    """Negative control: layer names must be made global before seeding."""
    full = built["full"][LANGUAGE]
    layer_weights = [k for k, (v, a) in built["shifted"].items() if ".layers." in k and k.endswith("linear_qkv.weight")]
    assert layer_weights
    for key in layer_weights:
        assert not torch.equal(built["shifted"][key][0], full[key][0]), key


@pytest.mark.parametrize("name", MODULES)
def test_distribution_matches_the_modules_own_initialisation(built, name):
    """Per parameter: constants are identical, random tensors have the same mean and spread (within sampling
    error) as megatron's / torch's own initialisation of the same module."""
    sharded, local = built["full"][name], built["local"][name]
    assert set(sharded) == set(local)
    for key, (value, _) in sharded.items():
        ref = local[key]
        if ref.numel() > 1 and ref.std() == 0:  # zeros / ones
            assert torch.equal(value, ref), key
            continue
        n = value.numel()
        tol = 6 * ref.std().item() / math.sqrt(n)
        assert abs(value.mean().item() - ref.mean().item()) < tol, key
        assert abs(value.std().item() - ref.std().item()) < tol, key
        assert value.abs().max() > 0, key


def test_large_weight_has_init_method_std():
    torch.manual_seed(0)
    cfg = load_config(_raw())
    cfg.model.language.num_layers = 8  # the output-layer scaling uses the whole module's depth
    weight = torch.nn.Parameter(torch.empty(512, 1024))
    fc2 = torch.nn.Parameter(torch.empty(512, 1024))
    holder = torch.nn.Module()
    holder.word_embeddings, holder.linear_fc2 = torch.nn.Module(), torch.nn.Module()
    holder.word_embeddings.weight, holder.linear_fc2.weight = weight, fc2
    init_sharded(holder, cfg, LANGUAGE, 0, 0, 1)
    assert abs(weight.std().item() - 0.02) < 0.02 * 0.01
    assert abs(weight.mean().item()) < 1e-4
    assert abs(fc2.std().item() - 0.02 / math.sqrt(16)) < 0.005 * 0.01


def test_unknown_parameter_is_an_error():
    with pytest.raises(ValueError, match="no rule for parameter 'encoder.mystery.weight'"):
        init_kind("encoder.mystery.weight")
    holder = torch.nn.Module()
    holder.register_parameter("gamma", torch.nn.Parameter(torch.empty(3)))
    with pytest.raises(ValueError, match="'gamma'"):
        init_sharded(holder, load_config(_raw()), LANGUAGE, 0, 0, 1)


def test_sharded_is_the_default_and_an_unknown_mode_names_the_field():
    assert load_config(tiny()).training.init == "sharded"
    raw = tiny()
    raw["training"]["init"] = "lazy"
    with pytest.raises(ConfigError, match=r"training\.init: must be one of sharded, reference, local, got 'lazy'"):
        load_config(raw)
