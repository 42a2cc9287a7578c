"""Export a (trained) mimo model to a Hugging Face directory.

Streaming: the module stages take turns (a world barrier between turns); in
each turn the TP ranks of one stage (DP rank 0) gather one parameter at a
time and the TP-rank-0 rank converts it to HF tensors in host memory and
writes the stage's safetensors file. No rank ever holds more than one stage
of one module, and the device never holds more than one full parameter. An
MoE LLM's routed experts are written, after each stage's dense tensors, by the
EP ranks that hold them (one file per EP rank, under global expert indices).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch.distributed as dist
from safetensors.torch import save_file

from mimo.config import LANGUAGE, MimoConfig, load_config
from mimo.config.outputs import output_problem
from mimo.hf.convert import finish_directory, split_entry
from mimo.model.reference_init import expert_shard, global_name, is_expert
from mimo.model.stages import stage_layer_counts
from mimo.runtime import run_on_ranks, select_runtime

from .state import unshard


def out_dir_problem(cfg: MimoConfig, out_dir: str) -> str:
    """Why `out_dir` cannot receive an export ('' when it can): checked before any rank starts,
    since an export writes shards beside whatever the directory holds, and transformers would
    load a stale model.safetensors left there instead of the new index."""
    if not out_dir:
        return "an empty path; name the directory to write"
    problem = output_problem(out_dir, "directory")
    if problem:
        return problem
    sources = [(path, d) for path, d in [("model.hf", cfg.model.hf), ("model.language.hf", cfg.model.language.hf)]
               + [(f"model.encoders.{n}.hf", e.hf) for n, e in cfg.model.encoders.items()] if d]
    for path, d in sources:
        if os.path.isdir(out_dir) and os.path.isdir(d) and os.path.samefile(out_dir, d):
            return f"{out_dir} is the source directory {path}; export into a new directory"
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        return f"{out_dir} is not empty; export into a new or empty directory"
    return ""


def export_problems(cfg: MimoConfig, hf_modules: Dict) -> str:
    """Why the model cannot be written as one HF directory ('' when it can)."""
    dirs = {m.directory for m in hf_modules.values()}
    if set(hf_modules) != set(cfg.modules) or not all(m.complete for m in hf_modules.values()) or len(dirs) != 1:
        return ("model.hf: export writes one HF directory, so every module must come from model.hf "
                "(or, for a text-only model, from model.language.hf)")
    return ""


def export_hf(trainer, out_dir: str) -> None:
    """Collective over all ranks of the trainer's world: write `out_dir`."""
    cfg = trainer.cfg
    mods = trainer.hf_modules
    problem = export_problems(cfg, mods)
    if problem:
        raise ValueError(problem)
    src = next(iter(trainer.hf_sources.values()))
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    written = []
    for name in cfg.modules:
        grid = trainer.topo.grid(name)
        by_name = {e.mimo: e for e in mods[name].entries}
        experts = expert_shard(cfg.model.language, grid) if name == LANGUAGE else None
        for stage in range(grid.layout.pp):
            fname = f"model-{name}-{stage:03d}.safetensors"
            written.append(fname)
            c = grid.coords if grid.is_member else None
            if c is not None and c["pp"] == stage and c["dp"] == 0 and c.get("cp", 0) == 0:
                part, tp = trainer.parts[name], grid.groups["tp"]
                tensors = {}
                for pname, p in part.named_parameters():
                    if experts is not None and is_expert(pname):
                        continue  # routed experts: their EP ranks write them below
                    if getattr(p, "tied_copy", False):
                        # A last pipeline stage's copy of the tied embedding (equal to it): transformers
                        # ties lm_head to embed_tokens, which the first stage writes.
                        continue
                    full = unshard(p, p, tp).cpu()
                    if c["tp"] == 0:
                        entry = by_name[global_name(pname, trainer.layer_offsets[name])]
                        tensors.update(split_entry(entry, full, src))
                if c["tp"] == 0:
                    save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
                del tensors
            dist.barrier()
            if name == LANGUAGE and cfg.model.language.is_moe:  # on every rank alike (a barrier inside)
                written += _export_experts(trainer, name, stage, by_name, src, out_dir, experts)
    if dist.get_rank() == 0:
        tied = cfg.model.language.tie_embeddings
        finish_directory(out_dir, src, written, skip_extra=lambda k: tied and k.endswith("lm_head.weight"))
    dist.barrier()


def _export_experts(trainer, name: str, stage: int, by_name: Dict, src, out_dir: str, experts) -> List[str]:
    """One stage's routed experts (collective over the module's ranks): each EP rank of expert-DP
    rank 0 gathers its experts over expert TP, and its expert-TP rank 0 writes them under their
    global indices, one file per EP rank. Returns every file name (the same on all ranks)."""
    grid = trainer.topo.grid(name)
    lang = trainer.cfg.model.language
    counts = stage_layer_counts(lang.num_layers, trainer.cfg.parallelism[name])
    if not any(lang.moe_layers()[sum(counts[:stage]):sum(counts[:stage + 1])]):
        return []  # a stage of dense layers only (e.g. Qwen2-MoE's mlp_only_layers)
    files = [f"model-{name}-{stage:03d}-experts-{e:03d}.safetensors" for e in range(grid.layout.ep)]
    ec = grid.expert_coords if experts is not None else None  # None: not one of the module's ranks
    if ec is not None and ec["pp"] == stage and ec["edp"] == 0:
        tensors = {}
        for pname, p in trainer.parts[name].named_parameters():
            if not is_expert(pname):
                continue
            full = unshard(p, p, experts.tp_group).cpu()
            if ec["etp"] == 0:
                gname = global_name(pname, trainer.layer_offsets[name], experts.offset)
                tensors.update(split_entry(by_name[gname], full, src))
        if ec["etp"] == 0:
            save_file(tensors, os.path.join(out_dir, files[ec["ep"]]), metadata={"format": "pt"})
    dist.barrier()
    return files


def _rank_export(raw: Dict, out_dir: str) -> str:
    """One rank's part of `export_config`: '' when written, else the checkpoint's error line."""
    from .trainer import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    if cfg.training.load is not None:
        from mimo.checkpoint import CheckpointError, checkpointer

        try:
            checkpointer(cfg, trainer, None).resume()  # weights only (load_optimizer: false)
        except CheckpointError as exc:
            # resume() agrees on its verdict over all ranks before raising, so every rank
            # returns here together and none is left inside a collective.
            return str(exc)
    export_hf(trainer, out_dir)
    return ""


# The fields that only mean something with training.save (mimo.config.validate refuses them without it).
SAVE_FIELDS = ("save", "save_interval", "keep_last", "async_save", "exit_signal_handler", "exit_duration_minutes")


def checkpoint_export_config(raw: Dict, ckpt_dir: str) -> Dict:
    """`raw` set up to restore the weights of `ckpt_dir` (DIR with `latest`, or DIR/iter_NNNNNNN)
    at its own layout, the equivalent of `training.load=ckpt_dir` + `training.load_optimizer=false`;
    nothing is saved."""
    raw = dict(raw)
    training = {k: v for k, v in (raw.get("training") or {}).items()
                if k not in SAVE_FIELDS}
    training.update(load=ckpt_dir, load_optimizer=False)
    raw["training"] = training
    return raw


def export_config(raw: Dict, out_dir: str, load: Optional[str] = None,
                  timeout_s: float = 1800.0) -> Optional[str]:
    """Build the config's model on its ranks and export it: weights from its HF directory, or from
    the mimo checkpoint `load` (the HF directory then only supplies the names and the non-weight
    files). Returns the checkpoint directory exported (None without `load`). Raises CheckpointError
    for a checkpoint that is missing, damaged or of another model."""
    if load is not None:
        from mimo.checkpoint import CheckpointError, preflight
        from mimo.checkpoint.paths import resolve

        # `latest` read once, here: a training run still saving into `load` could otherwise move it
        # between two ranks' reads, and they would load shards of different steps.
        raw = checkpoint_export_config(raw, resolve(load))
    cfg = load_config(raw)
    from mimo.hf import hf_modules

    problem = export_problems(cfg, hf_modules(cfg))
    if problem:
        raise ValueError(problem)
    problem = out_dir_problem(cfg, out_dir)
    if problem:
        raise ValueError(f"--out: {problem}")
    if load is not None:
        preflight(cfg)  # the manifest's files and sizes
    errors = [e for e in run_on_ranks(_rank_export, cfg.world_size, raw, out_dir, timeout_s=timeout_s,
                                      daemon=load is None) if e]
    if errors:
        raise CheckpointError(errors[0])
    return raw["training"]["load"] if load is not None else None
