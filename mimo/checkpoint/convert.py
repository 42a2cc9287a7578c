"""A checkpoint read whole in one process: full unsharded weights (`convert`) and a summary (`inspect`)."""

from __future__ import annotations

import os
import re
from typing import Dict

import torch

from .checks import read_checked
from .manifest import read_manifest, verify
from .optimizer_state import PREFIX
from .paths import resolve
from .safe_load import load_sharded


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
    # Only the weights' tensors are requested: with Adam the optimizer state is several times their size.
    request = {k: v for k, v in dist_checkpointing.load_tensors_metadata(ckpt).items() if not k.startswith(PREFIX)}
    plain = load_sharded(request, ckpt)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in plain.items():
        if not torch.is_tensor(t):  # the common record
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


_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def _experts(meta: dict, saved: Dict) -> list:
    """An MoE LLM's routed experts: how many, the layout they were saved at, and their tensors (stored by
    global expert index, so any `ep` loads them), one line per tensor name with its expert indices."""
    lang = meta["config"]["model"]["language"]
    if not lang.get("num_moe_experts"):
        return []
    lay = meta["layout"].get("language", {})
    lines = [f"experts: {lang['num_moe_experts']} (saved at ep={lay.get('ep', 1)}, etp={lay.get('etp', 1)}), "
             "stored by global expert index:"]
    groups: Dict[tuple, list] = {}
    for key, st in saved.items():
        m = _EXPERT.match(key)
        if m and not key.startswith(PREFIX):
            groups.setdefault((m.group(1), m.group(3)), []).append((int(m.group(2)), tuple(st.global_shape)))
    for (head, tail), found in sorted(groups.items()):
        found.sort()
        idx = [i for i, _ in found]
        span = f"{idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else ",".join(map(str, idx))
        shapes = sorted({shape for _, shape in found})
        lines.append(f"  {head}<{span}>{tail}  {len(idx)} x {list(shapes[0]) if len(shapes) == 1 else shapes}")
    return lines


def summary(path: str, checksums: bool = False) -> str:
    """What `inspect` prints, after checking that every file is there with the manifest's size (and,
    with `checksums`, its CRC32: every byte read, as `convert` does)."""
    from megatron.core import dist_checkpointing

    ckpt = resolve(path)
    meta = read_checked(ckpt)
    files = read_manifest(ckpt)
    verify(ckpt, checksums)
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
    lines += _experts(meta, saved)
    data = meta.get("data")
    if data is not None:
        lines.append(f"data position: {data}")
    lines.append(f"config: {os.path.join(ckpt, 'common.pt')} (training.optimizer {meta['config']['training']['optimizer']})")
    return "\n".join(lines)
