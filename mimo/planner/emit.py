"""Turn a chosen candidate into a complete config (the config schema)."""

from __future__ import annotations

import copy
from typing import Any, Mapping

import yaml

from mimo.planner.search import Candidate

TRAINING_DEFAULTS = {"train_iters": 10, "optimizer": "adam", "lr": 1.0e-4, "seed": 1234}


def parallelism_section(cand: Candidate, order: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in order:
        plan = cand.plans[name]
        lay = plan.layout
        entry: dict[str, Any] = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": 1, "etp": 1,
                                 "rank_offset": lay.rank_offset}
        if lay.pp > 1:
            entry["stage_layers"] = list(plan.stage_layers)
        out[name] = entry
    return out


def build_config(raw: Mapping[str, Any], cand: Candidate, order: list[str], seq_length: int,
                 global_batch: int, micro_batch: int, precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": copy.deepcopy(dict(raw["model"]))}
    cfg["parallelism"] = parallelism_section(cand, order)
    if cfg["parallelism"].get("language", {}).get("cp", 1) > 1:
        # Context parallelism runs on the bitfield attention kernel only.
        cfg["model"].setdefault("language", {})["attention"] = "bitfield"
    data = dict(raw.get("data") or {})
    data.setdefault("kind", "mock")
    data.setdefault("seq_length", seq_length)
    cfg["data"] = data
    training = {**TRAINING_DEFAULTS, **dict(raw.get("training") or {})}
    training["global_batch_size"] = global_batch
    training["micro_batch_size"] = micro_batch
    training.setdefault("precision", precision)
    cfg["training"] = training
    return cfg


def to_yaml(cfg: Mapping[str, Any]) -> str:
    # flow style for the short per-module parallelism maps keeps them one line,
    # the way the config reference writes them
    class _Dumper(yaml.SafeDumper):
        pass

    def repr_dict(dumper, data):
        flow = all(not isinstance(v, (dict,)) for v in data.values()) and "tp" in data
        return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow)

    _Dumper.add_representer(dict, repr_dict)
    return yaml.dump(dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
