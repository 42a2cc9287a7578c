#!/usr/bin/env python
"""Context-parallel workload balance of multimodal masks, per assignment policy.

    python tools/cp_balance.py                       # prefix/embedded/packed at 32k and 64k, cp 2/4/8
    python tools/cp_balance.py --seq 131072 --cp 4 --block 128
    python tools/cp_balance.py --time                # CUDA only: also time each rank's CP attention

The workload of a rank is the number of non-empty block x block attention tiles
of its query blocks (``mimo.attention.balance.block_workloads``; pure CPU
computation). ``imbal`` is max/mean - 1 over the ranks; ``tok`` the same for
the ranks' token counts (what the linear layers see). With ``--time`` (CUDA
only) each rank's attention (forward + backward of its local queries against
all keys, the compute part of all-gather CP) is timed on the one local GPU and
the slowest rank is reported per policy.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mimo.attention import build_bitfield_mask
from mimo.attention.balance import assign_from_workloads, block_workloads, imbalance, rank_workloads

PAD, TXT, IMG, AUD = 0, 5, 1, 2
PLACEHOLDERS = {IMG: 1, AUD: 2}
PATTERNS = ("prefix", "embedded", "packed")
POLICY_ORDER = ("contiguous", "zigzag", "random", "lpt", "lpt_free")


def make_mask(pattern: str, s: int, seed: int = 0):
    """(bits [1, s], document ids or None) of a synthetic multimodal sequence.

    prefix:   images first (a quarter of the sequence: 4 images), then causal text that sees them.
    embedded: text with 6 images and 4 audio clips at random places (text sees both).
    packed:   documents of random length (s/8..s/3) packed back to back, each an image prefix
              followed by text with an embedded audio clip; the last document may be cut.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((s,), TXT, dtype=torch.int64)
    docs = None
    if pattern == "prefix":
        ids[: s // 4] = IMG
    elif pattern == "embedded":
        img, aud = s // 32, s // 64
        for kind, n, length in ((IMG, 6, img), (AUD, 4, aud)):
            for _ in range(n):
                start = int(torch.randint(0, s - length, (1,), generator=g))
                ids[start:start + length] = kind
    elif pattern == "packed":
        docs = torch.zeros(s, dtype=torch.int64)
        pos, d = 0, 0
        while pos < s:
            length = int(torch.randint(s // 8, s // 3, (1,), generator=g))
            end = min(s, pos + length)
            n_img = int(length * 0.3)
            ids[pos:min(end, pos + n_img)] = IMG
            a0 = pos + n_img + int(torch.randint(0, max(1, length - n_img - s // 64), (1,), generator=g))
            ids[a0:min(end, a0 + s // 64)] = AUD
            docs[pos:end] = d
            pos, d = end, d + 1
        docs = docs[None]
    else:
        raise ValueError(pattern)
    return build_bitfield_mask(ids[None], PLACEHOLDERS, pad_id=PAD), docs


def fmt_k(x: int) -> str:
    return f"{x / 1024:.0f}k" if x % 1024 == 0 else str(x)


def balance_rows(seqs, cps, block, policies, seed, show_ranks):
    rows = []
    for s in seqs:
        for pattern in PATTERNS:
            mask, docs = make_mask(pattern, s, seed)
            t_work = float("inf")
            for _ in range(3):  # best of 3: the first call pays numpy/torch warm-up
                t0 = time.perf_counter()
                work = block_workloads(mask, block, docs)
                t_work = min(t_work, time.perf_counter() - t0)
            for cp in cps:
                for policy in policies:
                    t_assign = float("inf")
                    for _ in range(3):  # best of 3, as for the workloads
                        t1 = time.perf_counter()
                        assignment = assign_from_workloads(work, cp, policy, seed)  # workloads computed once
                        t_assign = min(t_assign, time.perf_counter() - t1)
                    loads = rank_workloads(assignment, work)
                    tokens = [sum(min(block, s - i * block) for i in a) for a in assignment]
                    rows.append(dict(seq=s, pattern=pattern, cp=cp, policy=policy, loads=loads,
                                     imbal=imbalance(loads), tok_imbal=imbalance(tokens),
                                     t_work=t_work, t_assign=t_assign, assignment=assignment))
    if show_ranks:
        print("| seq | pattern | cp | policy | max/mean-1 (tiles) | max/mean-1 (tokens) | per-rank tiles |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {fmt_k(r['seq'])} | {r['pattern']} | {r['cp']} | {r['policy']} | {100 * r['imbal']:.2f}% | "
                  f"{100 * r['tok_imbal']:.2f}% | " + " ".join(str(x) for x in r["loads"]) + " |")
    else:
        # One line per (seq, pattern, cp): tile imbalance of each policy, then the token
        # imbalance of each policy that is not token-balanced by construction.
        free = [p for p in policies if p == "lpt_free"]
        print("| seq | pattern | cp | mean tiles/rank | " + " | ".join(policies) + " | "
              + " | ".join(f"{p} tokens" for p in free) + (" |" if free else "|"))
        print("|---|---|---|---|" + "---|" * (len(policies) + len(free)))
        keyed = {}
        for r in rows:
            keyed.setdefault((r["seq"], r["pattern"], r["cp"]), {})[r["policy"]] = r
        for (s, pattern, cp), by in keyed.items():
            mean = sum(next(iter(by.values()))["loads"]) / cp
            cells = [f"{100 * by[p]['imbal']:.2f}%" for p in policies]
            cells += [f"{100 * by[p]['tok_imbal']:.2f}%" for p in free]
            print(f"| {fmt_k(s)} | {pattern} | {cp} | {mean:.0f} | " + " | ".join(cells) + " |")
    t_work = max(r["t_work"] for r in rows)
    t_lpt = max((r["t_assign"] for r in rows if r["policy"] == "lpt"), default=0.0)
    t_plan = max((r["t_work"] + r["t_assign"] for r in rows if r["policy"] == "lpt"), default=0.0)
    print(f"\nblock {block}; slowest block_workloads {t_work * 1e3:.1f} ms, slowest LPT step {t_lpt * 1e3:.1f} ms, "
          f"slowest block planning (workloads + LPT) {t_plan * 1e3:.1f} ms")
    return rows


def time_policies(rows, block, heads, head_dim, iters):
    if not torch.cuda.is_available():
        print("error: --time needs a CUDA GPU (the workload table above is CPU-only and complete)", file=sys.stderr)
        return 2
    from mimo.attention import bitfield_attention_general
    from mimo.attention.context_parallel import ContextParallelMask
    from mimo.attention.cp_permute import permute_to_local, slots_from_assignment

    dev = torch.device("cuda")
    print("\n| seq | pattern | cp | policy | slowest rank fwd+bwd (ms) | mean rank (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mask, docs = make_mask(r["pattern"], r["seq"], 0)
        mask, docs = mask.to(dev), None if docs is None else docs.to(dev)
        slots = slots_from_assignment(r["assignment"], r["seq"], block, device=dev)
        g = torch.Generator(device=dev).manual_seed(0)
        s = r["seq"]
        full = [torch.randn(1, s, heads, head_dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)]
        times = []
        for rank in range(r["cp"]):
            cpm = ContextParallelMask(mask, slots, rank, docs, validate=False)
            args = cpm.attention_args()
            q = permute_to_local(full[0], slots, rank).requires_grad_()
            # Keys in the all-gathered (flattened slots) order, as on a real CP rank.
            k, v = (torch.cat([permute_to_local(t, slots, j) for j in range(r["cp"])], 1).requires_grad_()
                    for t in full[1:])

            def step():
                out = bitfield_attention_general(q, k, v, **args)
                out.backward(torch.ones_like(out))

            step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        print(f"| {fmt_k(s)} | {r['pattern']} | {r['cp']} | {r['policy']} | {max(times):.2f} | "
              f"{sum(times) / len(times):.2f} |")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--policies", nargs="+", default=list(POLICY_ORDER), choices=POLICY_ORDER)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", action="store_true", help="also print each rank's tile count")
    p.add_argument("--time", action="store_true", help="CUDA only: time each rank's attention per policy")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args(argv)
    if a.time and not torch.cuda.is_available():
        print("error: --time needs a CUDA GPU; run without --time for the CPU-only workload table",
              file=sys.stderr)
        return 2
    rows = balance_rows(a.seq, a.cp, a.block, a.policies, a.seed, a.ranks)
    if a.time:
        return time_policies(rows, a.block, a.heads, a.head_dim, a.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
