"""Layout validity rules shared by the search and its tests.

They mirror what the config validator enforces, so every emitted candidate
passes ``python -m mimo.config check``.
"""

from __future__ import annotations

from typing import Mapping

from mimo.planner.spec import ModelSpec, ModuleSpec
from mimo.planner.stages import Layout


def divisors_up_to(n: int, limit: int) -> list[int]:
    """Divisors of ``n`` that are at most ``limit``."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_ok(module: ModuleSpec, tp: int) -> bool:
    # The LLM's vocabulary is split over TP too (vocab-parallel embedding and output layer).
    return all(x % tp == 0 for x in (module.num_attention_heads, module.num_query_groups,
                                     module.hidden_size, module.ffn_hidden_size, module.vocab_size))


def sp_ok(module: ModuleSpec, tp: int, cp: int, seq_length: int) -> bool:
    """Sequence parallelism cuts each sequence into tp equal shards: the
    LLM's CP share of a sample, an encoder's item (class token included)."""
    if module.is_language:
        return seq_length % (tp * cp) == 0
    return (module.tokens_per_item + module.class_token) % tp == 0


def cp_ok(module: ModuleSpec, cp: int, seq_length: int) -> bool:
    if not module.is_language:
        return cp == 1
    # Load-balanced causal CP splits the sequence into 2*cp chunks.
    return cp == 1 or seq_length % (2 * cp) == 0


def dp_pair_ok(d_enc: int, d_llm: int, global_batch: int, micro_batch: int, colocated: bool) -> bool:
    """Encoder DP divides items (images, clips), not samples (README,
    "Encoder data parallelism over items"): any encoder DP pairs with any
    LLM DP; only the LLM's own batch rule remains (``layout_errors``)."""
    return d_enc >= 1 and d_llm >= 1


def layout_errors(spec: ModelSpec, layouts: Mapping[str, Layout], world_size: int,
                  global_batch: int, micro_batch: int, seq_length: int) -> list[str]:
    """Every broken rule, as 'module: reason' strings (empty when valid)."""
    errors = []
    if set(layouts) != {m.name for m in spec.modules}:
        errors.append(f"layouts for {sorted(layouts)} but model has {[m.name for m in spec.modules]}")
        return errors
    for m in spec.modules:
        lay = layouts[m.name]
        if min(lay.tp, lay.cp, lay.pp, lay.dp) < 1 or lay.rank_offset < 0:
            errors.append(f"{m.name}: degrees must be >= 1")
            continue
        if lay.rank_offset + lay.size > world_size:
            errors.append(f"{m.name}: ranks exceed world size {world_size}")
        if not tp_ok(m, lay.tp):
            errors.append(f"{m.name}: tp {lay.tp} does not divide heads/groups/hidden/ffn")
        if not cp_ok(m, lay.cp, seq_length):
            errors.append(f"{m.name}: cp {lay.cp} not allowed")
        if lay.pp > m.num_layers:
            errors.append(f"{m.name}: pp {lay.pp} > num_layers {m.num_layers}")
    names = [m.name for m in spec.modules]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = layouts[a].ranks, layouts[b].ranks
            same = ra == rb
            disjoint = ra.stop <= rb.start or rb.stop <= ra.start
            if not (same or disjoint):
                errors.append(f"{a}/{b}: rank ranges partially overlap")
    llm = layouts["language"]
    if global_batch % (micro_batch * llm.dp):
        errors.append("language: global batch not divisible by micro_batch * dp")
    for e in spec.encoders:
        lay = layouts[e.name]
        colocated = lay.ranks == llm.ranks
        if not dp_pair_ok(lay.dp, llm.dp, global_batch, micro_batch, colocated):
            errors.append(f"{e.name}: dp {lay.dp} incompatible with language dp {llm.dp}")
    return errors
