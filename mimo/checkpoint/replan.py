"""Elastic re-plan (`training.replan: auto`): resume a checkpoint on however many ranks are left.

A checkpoint loads on any layout (docs/checkpoints.md), so a job that lost (or gained) ranks only
needs a layout for the ranks it has. This module chooses it before any process group exists:

* at a start on the configured world size, rank 0 plans the layouts for the smaller world sizes
  the job may shrink to (`template_sizes`) and stores them in `<home>/templates.json`, keyed by
  GPU kind and world size, so a restart reads its layout instead of searching;
* at a start on another world size, every rank takes the stored template for that size and GPU
  kind if the config check accepts it, else the planner's search (the same result on every
  rank: the search is deterministic); rank 0 writes the complete config to
  `<home>/layout_<N>.yaml` and prints one `replanned for N ranks:` line. The trainer then
  resumes `training.load` resharded onto it.

`<home>` is `training.save` (validate.py requires it with `replan: auto`). Every problem is a
ConfigError, so the CLI reports it as one `error:` line and exits 2 before any collective.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from mimo.config import ConfigError, MimoConfig, apply_overrides, load_config, read_yaml
from mimo.config.schema import LANGUAGE, ParallelConfig
from mimo.config.validate import offload_problem
from mimo.planner.hardware import gpu_kind

from .paths import _ITER, complete_steps, iter_dir, read_latest

_PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}
TEMPLATES = "templates.json"
PATH = "training.replan"


def layout_file(home: str, world: int) -> str:
    return os.path.join(home, f"layout_{world}.yaml")


def _no_profile(device_name: str) -> str:
    from mimo.planner.hardware import GPUS

    return (f"the planner has no profile for the GPU {device_name!r} (known: "
            f"{', '.join(k for k in GPUS if k != 'cpu')}, each at its own memory size)")


def template_sizes(configured: int, min_ranks: Optional[int], per_node: int) -> List[int]:
    """World sizes below the configured one to plan ahead, largest first.

    Several nodes: a lost node takes `per_node` ranks with it, so step by that. One node
    (per_node >= configured): a lost GPU takes one rank, so step by 1. The floor defaults to
    half the configured ranks."""
    floor = min_ranks if min_ranks is not None else max(1, configured // 2)
    step = per_node if 0 < per_node < configured else 1
    return [n for n in range(configured - step, floor - 1, -step) if n >= 1]


@functools.lru_cache(maxsize=1)
def _planner_code() -> str:
    """The planner's own source: a template planned by another version of it is planned again.
    Read once per process (the code does not change under a running job)."""
    import mimo.planner

    h = hashlib.sha256()
    folder = os.path.dirname(mimo.planner.__file__)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def fingerprint(cfg: MimoConfig) -> str:
    """What a layout was planned for besides the world size: the model, the batch arithmetic, the
    settings the planner costs and the planner itself. A template planned otherwise is refused."""
    tr = cfg.training
    what = {"model": repr(cfg.model), "seq_length": cfg.data.seq_length, "global_batch_size": tr.global_batch_size,
            "micro_batch_size": tr.micro_batch_size, "precision": tr.precision,
            "use_distributed_optimizer": tr.use_distributed_optimizer,
            "grad_reduce_in_fp32": tr.grad_reduce_in_fp32, "planner": _planner_code()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read_templates(home: str) -> Tuple[Dict[str, Any], str]:
    """(the stored templates, "") or, for a file that cannot be used, ({}, why): the file is only a
    cache of the planner's deterministic search, so a damaged one is planned afresh (and replaced
    at the next start on the configured size), never a reason not to start."""
    path = os.path.join(home, TEMPLATES)
    if not os.path.exists(path):
        return {}, ""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        return {}, f"{path} cannot be read ({exc}); ignored"
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        return {}, f"{path} is not a mapping of GPU kind -> world size -> layout; ignored"
    return data, ""


def write_atomic(path: str, text: str) -> None:
    """Rank 0 only; atomic and durable (synced before and after the rename, so a node that crashes
    leaves the old file or the new one, never an empty one). A directory that cannot be written
    is one error line, not a traceback."""
    try:
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError([(PATH, f"cannot write {path}: {exc.strerror}")]) from None


def write_templates(home: str, data: Dict[str, Any]) -> None:
    write_atomic(os.path.join(home, TEMPLATES), json.dumps(data, indent=1, sort_keys=True))


def with_layout(raw: Dict[str, Any], parallelism: Dict[str, Any], micro: int) -> Dict[str, Any]:
    """The user's config with another layout: everything else (model, data, training) as written."""
    out = copy.deepcopy(raw)
    out["parallelism"] = copy.deepcopy(parallelism)
    out.setdefault("training", {})["micro_batch_size"] = micro
    # It bounds the sizes planned ahead at a start on the configured layout, which this is not; kept,
    # it would refuse every layout for fewer ranks than it names.
    out["training"].pop("replan_min_ranks", None)
    if out["training"].get("offload_encoders"):
        # Kept where this layout has the phase it works in (colocated encoders idle while the LLM runs).
        pars = {n: ParallelConfig(**{k: v for k, v in p.items() if k in _PARALLEL_FIELDS})
                for n, p in parallelism.items()}
        if offload_problem(pars, [n for n in pars if n != LANGUAGE]):
            out["training"]["offload_encoders"] = False
    return out


def _check(raw: Dict[str, Any], world: int) -> Tuple[Optional[MimoConfig], str]:
    """The config check on `world` ranks: (config, "") or (None, its first problem)."""
    try:
        return load_config(raw, world_size=world), ""
    except ConfigError as exc:
        path, reason = exc.problems[0]
        return None, f"{path}: {reason}"


def search(raw: Dict[str, Any], cfg: MimoConfig, world: int, kind: str) -> Tuple[Dict[str, Any], int]:
    """The planner's best layout on `world` ranks that the config check accepts: (parallelism, micro batch).

    The global batch is kept; the micro batch is the largest (up to the configured one, dividing
    the global batch) for which a layout exists, since the LLM's DP must divide global / micro."""
    from mimo.planner.best import planned_config, searcher

    g, configured = cfg.training.global_batch_size, cfg.training.micro_batch_size
    tr = cfg.training
    problem = ""
    for micro in [m for m in range(configured, 0, -1) if g % m == 0]:
        plan_raw = copy.deepcopy(raw)
        # Cost the layout with the trainer's own settings (the planner's defaults differ on a GPU).
        plan_raw["training"] = {**plan_raw.get("training", {}), "micro_batch_size": micro,
                                "precision": tr.precision, "use_distributed_optimizer": tr.use_distributed_optimizer,
                                "grad_reduce_in_fp32": tr.grad_reduce_in_fp32}
        try:
            s, spec = searcher(plan_raw, kind, None)
            if cfg.model.language.attention != "bitfield":
                # Context parallelism runs on the bitfield kernel only, and a re-plan keeps the model
                # as configured: no CP layouts (the planner's own configs would switch the kernel).
                s.max_cp = 1
            found = s.search(world)
        except ValueError as exc:  # the planner's own one-line reason (no layout fits, none divides)
            problem = str(exc)
            continue
        order = [m.name for m in spec.modules]
        for planned in found:
            if planned.estimate.placement == "homogeneous":
                continue  # Megatron's baseline: encoders inside the LLM's stage, which a config cannot express
            par = planned_config(plan_raw, s, planned, order)["parallelism"]
            ok, why = _check(with_layout(raw, par, micro), world)
            if ok:
                return par, micro
            problem = problem or f"the planned layout fails the config check: {why}"
    raise ConfigError([(PATH, f"no layout for {world} ranks of {kind}: {problem or 'the planner found none'}")])


def template(raw: Dict[str, Any], cfg: MimoConfig, world: int, kind: str,
             templates: Dict[str, Any]) -> Tuple[Optional[Tuple[Dict[str, Any], int]], str]:
    """The stored layout for (kind, world) if it still fits: ((parallelism, micro), "") or (None, why not)."""
    entry = templates.get(kind, {}).get(str(world)) if isinstance(templates.get(kind), dict) else None
    if not isinstance(entry, dict):
        return None, f"no template for {world} ranks of {kind}"
    if entry.get("fingerprint") != fingerprint(cfg):
        return None, f"the template for {world} ranks was planned for another model or batch"
    par, micro = entry.get("parallelism"), entry.get("micro_batch_size")
    if not isinstance(par, dict) or not isinstance(micro, int) or isinstance(micro, bool):
        return None, f"the template for {world} ranks is malformed"
    ok, why = _check(with_layout(raw, par, micro), world)
    if not ok:
        return None, f"the template for {world} ranks is refused ({why})"
    return (par, micro), ""


def degrees(cfg: MimoConfig) -> str:
    """`language tp1 cp1 pp1 dp4 [0-3], images tp1 dp4 [0-3]`: each module's degrees and ranks."""
    out = []
    for name in cfg.modules:
        p = cfg.parallelism[name]
        cp = f" cp{p.cp}" if name == LANGUAGE else ""
        out.append(f"{name} tp{p.tp}{cp} pp{p.pp} dp{p.dp} [{p.ranks.start}-{p.ranks.stop - 1}]")
    return ", ".join(out)


def _resumable(tr, world: int, configured: int) -> None:
    """A re-plan resumes a checkpoint; without one there is nothing to carry over."""
    why = f"auto on {world} ranks (the layout uses {configured}) resumes training.load, but "
    if tr.load is None:
        raise ConfigError([(PATH, why + "training.load is unset")])
    if read_latest(tr.load) is None and not _ITER.match(os.path.basename(os.path.normpath(tr.load))):
        steps = complete_steps(tr.load)
        if steps:  # a save renamed into place, then the run died before `latest` named it
            newest = iter_dir(tr.load, steps[-1])
            raise ConfigError([(PATH, why + f"{tr.load} holds no `latest` file, only step directories (newest "
                                f"{os.path.basename(newest)}): resume it with training.load: {newest}")])
        raise ConfigError([(PATH, why + f"{tr.load} holds no checkpoint yet; start on {configured} ranks")])


def store_templates(raw: Dict[str, Any], cfg: MimoConfig, kind: str, per_node: int) -> str:
    """At a start on the configured layout (rank 0): plan the smaller world sizes not yet stored.
    Returns a line for the log ("" when nothing was planned)."""
    tr, home = cfg.training, cfg.training.save
    sizes = template_sizes(cfg.world_size, tr.replan_min_ranks, per_node)
    templates, damaged = read_templates(home)
    if damaged:
        print(f"warning: {PATH}: {damaged}; its templates are planned again", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    planned, failed = [], []
    for n in sizes:
        if template(raw, cfg, n, kind, templates)[0] is not None:
            continue
        try:
            par, micro = search(raw, cfg, n, kind)
        except ConfigError:
            failed.append(n)  # no layout fits n ranks: a restart on n finds the same, and says why
            continue
        templates.setdefault(kind, {})[str(n)] = {"fingerprint": fingerprint(cfg), "parallelism": par,
                                                  "micro_batch_size": micro}
        planned.append(n)
    if not planned and not damaged:
        return ""
    write_templates(home, templates)  # a damaged file is replaced even when no size was planned
    none = f"; none fits {', '.join(map(str, failed))}" if failed else ""
    what = f"templates for {', '.join(map(str, planned))} ranks of {kind}" if planned else "no templates"
    return f"replan: {what} stored in {os.path.join(home, TEMPLATES)} ({time.perf_counter() - t0:.2f} s{none})"


def replan(raw: Dict[str, Any], cfg: MimoConfig, world: int, kind: str) -> Tuple[MimoConfig, Dict[str, Any], str]:
    """The config for `world` ranks: (config, its raw dict, how it was found)."""
    _resumable(cfg.training, world, cfg.world_size)
    templates, damaged = read_templates(cfg.training.save)
    found, why = template(raw, cfg, world, kind, templates)
    source = f"the template in {os.path.join(cfg.training.save, TEMPLATES)}"
    if found is None:
        found = search(raw, cfg, world, kind)
        source = f"a fresh search ({damaged or why})"
    new_raw = with_layout(raw, *found)
    return load_config(new_raw, world_size=world), new_raw, source


def load_for_world(path: str, overrides, world: int, device_name: str, rank: int,
                   per_node: int, check: bool = False) -> MimoConfig:
    """`load_config` for a job on `world` ranks, re-planning under `training.replan: auto`.

    With replan off (the default) this is `load_config(path, overrides, world_size=world)`.
    `check`: the same decisions, but nothing is written and nothing printed (a launcher's check
    before it starts the ranks)."""
    raw = apply_overrides(read_yaml(path), list(overrides))
    cfg = load_config(raw)  # every problem except the world size
    if cfg.training.replan != "auto":
        return load_config(raw, world_size=world)
    kind = gpu_kind(device_name)
    if world == cfg.world_size:
        cfg = load_config(raw, world_size=world)
        if rank == 0 and not check:
            if kind is None:  # nothing to re-plan now; only a later restart on other sizes would need it
                print(f"warning: {PATH}: {_no_profile(device_name)}: no layouts are planned ahead, and a "
                      "restart on another number of ranks will stop", file=sys.stderr, flush=True)
            else:
                line = store_templates(raw, cfg, kind, per_node)
                if line:
                    print(line, flush=True)
        return cfg
    if kind is None:
        raise ConfigError([(PATH, _no_profile(device_name))])
    before = cfg.training.micro_batch_size
    cfg, new_raw, source = replan(raw, cfg, world, kind)
    if rank == 0 and not check:
        from mimo.planner.emit import to_yaml

        out = layout_file(cfg.training.save, world)
        write_atomic(out, to_yaml(new_raw))
        micro = cfg.training.micro_batch_size
        mb = f"micro_batch_size {micro}" + (f" (was {before})" if micro != before else "")
        print(f"replanned for {world} ranks: {degrees(cfg)}; {mb}; layout from {source}; wrote {out}", flush=True)
    return cfg
