"""A checkpoint read whole in one process: full unsharded weights (`convert`) and a summary (`inspect`)."""

from __future__ import annotations

import os
from typing import Dict

import torch

from .checks import read_checked
from .manifest import read_manifest, verify
from .optimizer_state import PREFIX
from .paths import resolve


def _one_process_group() -> None:
    """megatron-core's loader runs collectives; a one-rank gloo group makes it work standalone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from mimo.runtime.launch import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def full_weights(path: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """`{module: {parameter: full tensor}}` of the checkpoint at `path` (DIR or DIR/iter_NNNNNNN)."""
    from megatron.core import dist_checkpointing

    ckpt = resolve(path)
    verify(ckpt)
    read_checked(ckpt)  # refuses files that would run code when megatron-core reads them
    _one_process_group()
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in plain.items():
        if key.startswith(PREFIX) or not torch.is_tensor(t):  # optimizer state; the common record
            continue
        module, name = key.split(".", 1)
        out.setdefault(module, {})[name] = t
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return ""


def summary(path: str) -> str:
    from megatron.core import dist_checkpointing

    ckpt = resolve(path)
    meta = read_checked(ckpt)
    files = read_manifest(ckpt)
    saved = dist_checkpointing.load_tensors_metadata(ckpt)
    lines = [f"checkpoint {ckpt}", f"step {meta['step']}",
             f"saved on {meta['world_size']} ranks, {len(files)} files, "
             f"{_size(sum(f['bytes'] for f in files.values()))}"]
    lines.append("layout:")
    for name, lay in meta["layout"].items():
        lines.append(f"  {name:10s} " + " ".join(f"{k}={v}" for k, v in lay.items()))
    lines.append("modules:")
    modules: Dict[str, list] = {}
    for key, st in saved.items():
        optimizer = key.startswith(PREFIX)
        module = key[len(PREFIX):].split(".", 1)[0] if optimizer else key.split(".", 1)[0]
        numel = 1
        for d in st.global_shape:
            numel *= d
        entry = modules.setdefault(module, [0, 0, 0])
        entry[2 if optimizer else 0] += numel * st.dtype.itemsize
        if not optimizer:
            entry[1] += numel
    for module, (weight_bytes, numel, opt_bytes) in modules.items():
        lines.append(f"  {module:10s} {numel:,} parameters ({_size(weight_bytes)}), optimizer state {_size(opt_bytes)}")
    data = meta.get("data")
    if data is not None:
        lines.append(f"data position: {data}")
    lines.append(f"config: {os.path.join(ckpt, 'common.pt')} (training.optimizer {meta['config']['training']['optimizer']})")
    return "\n".join(lines)
