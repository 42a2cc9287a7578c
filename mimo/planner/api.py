"""One call from a (possibly parallelism-less) config to ranked layouts and a
complete config for the best one."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml

from mimo.config.hf_arch import resolve_hf
from mimo.config.load import yaml_problem, load_yaml
from mimo.planner.cost_model import Calibration, Workload
from mimo.planner.emit import build_config
from mimo.planner.hardware import get_gpu
from mimo.planner.profiling import ProfileResult, Sample, mean_items, stable_profiling_batch
from mimo.planner.search import Candidate, Planner, SearchSettings
from mimo.planner.spec import MAX_SIZE, ModelSpec, max_sequence_length, read_model

DEFAULT_GLOBAL_BATCH = 64


@dataclass
class PlanResult:
    candidates: list[Candidate]
    config: dict[str, Any]
    spec: ModelSpec
    settings: SearchSettings
    planner: Planner
    profile: ProfileResult | None = None


def load_raw(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    try:
        with open(config) as fh:
            raw = load_yaml(fh)
    except OSError as exc:
        raise ValueError(f"cannot read {config}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{config}: invalid YAML ({yaml_problem(exc)})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{config}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{config}: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config}: expected a mapping at top level")
    return raw


def with_hf_architecture(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` in which every module that names a Hugging Face
    directory (``hf:``) has its architecture filled in from that directory's
    config.json, as the trainer builds it. ``raw`` itself stays as written,
    so a config emitted from it keeps its ``hf:`` form."""
    resolved = copy.deepcopy(raw)
    problems = resolve_hf(resolved)
    if problems:
        field, reason = problems[0]
        raise ValueError(f"{field}: {reason}")
    return resolved


def section(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A top-level section (``data``, ``training``) as a dict; absent is empty."""
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: expected a mapping, got {value!r}")
    return dict(value)


def sequence_length(model: Any, data: Mapping[str, Any]) -> int:
    """``data.seq_length`` (else the LLM's max_sequence_length), checked against that maximum."""
    limit = max_sequence_length(model)
    seq = data.get("seq_length", limit)
    if seq is None:
        raise ValueError("data.seq_length: required (or model.language.max_sequence_length)")
    seq = positive_int(seq, "data.seq_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and seq > limit:
        raise ValueError(f"data.seq_length: {seq} exceeds model.language.max_sequence_length {limit}")
    return seq


def positive_int(value: Any, path: str) -> int:
    """A count from the config or the command line, up to what the planner costs."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: expected a positive integer, got {value!r}")
    if value > MAX_SIZE:
        raise ValueError(f"{path}: {value} is beyond what the planner costs (at most {MAX_SIZE})")
    return value


def make_plan(config: str | os.PathLike | Mapping[str, Any], gpus: int, gpu: str = "h100",
              samples: Sequence[Sample] | None = None, global_batch: int | None = None,
              micro_batch: int | None = None, calibration: Calibration | None = None,
              frozen_aware: bool = True) -> PlanResult:
    raw = load_raw(config)
    model = with_hf_architecture(raw).get("model")
    spec = read_model(model)
    hw = get_gpu(gpu)
    gpus = positive_int(gpus, "gpus")
    data, training = section(raw, "data"), section(raw, "training")
    seq = sequence_length(model, data)
    g = positive_int(global_batch or training.get("global_batch_size", DEFAULT_GLOBAL_BATCH),
                      "training.global_batch_size")
    m = positive_int(micro_batch or training.get("micro_batch_size", 1), "training.micro_batch_size")
    if g % m:
        raise ValueError("training.global_batch_size: not divisible by micro_batch_size")
    precision = training.get("precision", "fp32" if hw.name == "cpu" else "bf16")
    optimizer = training.get("optimizer", "adam")
    profile = None
    items = {}
    if samples:
        settings0 = SearchSettings(gpus, g, m, Workload(seq), precision, optimizer)
        profile = stable_profiling_batch(samples, spec, Planner(spec, hw, settings0, calibration).cm, gpus)
        items = mean_items(samples, spec)
    settings = SearchSettings(gpus, g, m, Workload(seq, items), precision, optimizer, frozen_aware)
    planner = Planner(spec, hw, settings, calibration)
    cands = planner.search()
    order = [mod.name for mod in spec.modules]
    cfg = build_config(raw, cands[0], order, seq, g, m, precision)
    return PlanResult(cands, cfg, spec, settings, planner, profile)
