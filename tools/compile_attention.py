#!/usr/bin/env python
"""Compile bitfield attention's Triton kernels for an NVIDIA GPU without one, and report what each needs.

    python tools/compile_attention.py                              # sm_90 (H100 / H200), head_dim 128, bf16
    python tools/compile_attention.py --arch 80 --head-dim 64,128,256 --dtype bf16,fp32
    python tools/compile_attention.py --config '{"bwd_num_warps": 8}' --kernels dkdv   # a setting to try

Every kernel variant the runtime can launch for a head dim and dtype (forward, split merge, dK/dV,
dQ, the one-launch backward where the config sets `fused_backward`, the backward's delta, tile
classification; with and without document ids; sequence lengths that divide the tiles and lengths
that do not) is compiled by Triton to a cubin for the chosen architecture with the launch
settings `KernelConfig` resolves to, exactly as `mimo.attention.function` launches it. Triton and its
bundled `ptxas` do this on any x86-64 machine; no GPU or CUDA driver is needed.

One JSON line per variant: kernel, arch, head_dim, dtype, has_doc (has_dlse for the delta kernel), even, tiles (queries x keys; the
one-launch backward: the dK/dV tiles, then the dQ tiles; the delta kernel: rows x padded head dim), num_warps,
num_stages, shared_bytes (shared memory per program), registers (per thread), spill_bytes (spill
stores + loads reported by ptxas), fits, and error where the compile failed; then one summary line.
Exit status 1 when a variant fails to compile or needs more shared memory or registers per program
than the architecture gives one program; 0 otherwise. Spills are reported, not failures: what they
cost shows only on a GPU (`tools/tune_attention.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Shared memory one program (thread block) may opt into, by compute capability (CUDA C
# Programming Guide, "Technical Specifications per Compute Capability"), and registers per SM.
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
REGISTERS_PER_SM = 65536

ACTIVATIONS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}   # the run's dtype
FP32 = {"LSE", "DELTA", "DLSE", "PART_O", "PART_LSE"}
MASKS = {"QM", "QP", "QD", "KM", "KP", "KD"}                  # int64 [b, s]
PLAN = {"ITEM_ROW", "ITEM_START", "ITEM_LEN", "ITEM_SLOT", "KV_IDX", "KV_NPART", "KV_CNT", "COLS", "Q_IDX",
        "Q_NPART", "Q_CNT", "ROWS", "AGG_ROW", "AGG_SLOT", "AGG_LEN"}  # int32 block-plan lists
DTYPES = ("bf16", "fp16", "fp32")  # Triton's names too
KERNELS = {"fwd": "fwd_kernel", "merge": "merge_kernel", "dkdv": "bwd_dkdv_kernel", "dq": "bwd_dq_kernel",
           "fused": "bwd_kernel", "delta": "bwd_delta_kernel", "classify": "classify_kernel"}

# A representative launch: batch 1, 16 query heads over 4 kv heads (GQA), contiguous [b, s, h, d]
# tensors; 16384 tokens divide every tile, 16389 divide none.
HEADS, KV_HEADS = 16, 4
EVEN_TOKENS, UNEVEN_TOKENS = 16384, 16389


def _scalar_values(fn, head_dim: int, tokens: int, block_m: int, block_n: int, dq_tiles=None) -> dict:
    """The integer arguments a launch of this shape passes (Triton specialises on their divisibility);
    `dq_tiles`: the dQ plan's tiles of the one-launch backward (default: the same tiles)."""
    def strides(heads):
        return tokens * heads * head_dim, heads * head_dim, head_dim

    q, kv = strides(HEADS), strides(KV_HEADS)
    dq_m, dq_n = dq_tiles or (block_m, block_n)
    values = dict(s_q=tokens, s_k=tokens, n_qb=-(-tokens // block_m), n_kb=-(-tokens // block_n), hq=HEADS,
                  group=HEADS // KV_HEADS, dq_n_qb=-(-tokens // dq_m), dq_n_kb=-(-tokens // dq_n),
                  n_cols=-(-tokens // block_n))
    for prefix, s in (("sq", q), ("sk", kv), ("sv", kv), ("so", q), ("sdo", q), ("sdq", q), ("sdk", kv),
                      ("sdv", kv)):
        values.update({prefix + "b": s[0], prefix + "s": s[1], prefix + "h": s[2]})
    return {name: values[name] for name in fn.arg_names if name in values}


def signature(fn, constants: dict, dtype: str, scalars: dict):
    """Triton's signature and divisibility attributes for `fn`, from its argument names; an argument
    this table does not know is an error (a kernel changed: teach the table its type)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            sig[name] = "constexpr"
            continue
        if name in ACTIVATIONS:
            sig[name] = "*" + dtype
        elif name in FP32:
            sig[name] = "*fp32"
        elif name in MASKS:
            sig[name] = "*i64"
        elif name in PLAN:
            sig[name] = "*i32"
        elif name == "STATUS":
            sig[name] = "*i8"
        elif name in ("scale", "scale_log2"):
            sig[name] = "fp32"
            continue
        elif name in scalars:
            sig[name] = "i32"
            if scalars[name] % 16:
                continue
        else:
            raise KeyError(f"{fn.__name__}: no type known for argument {name!r}")
        attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
    return sig, attrs


def variants(kern, cfg, head_dim: int, dtype: str):
    """(kernel name, fn, tiles, has_doc, even, constants, launch options) the runtime can launch."""
    from mimo.attention.function import (  # what function.py passes
        DELTA_LAUNCH, _delta_constants, _fused_constants, _launch_opts, _shape_constants,
    )

    launches = (("fwd_kernel", "fwd", cfg.block_m, cfg.block_n), ("bwd_dkdv_kernel", "dkdv", cfg.bwd_block_m,
                cfg.bwd_block_n), ("bwd_dq_kernel", "dq", cfg.dq_block_m, cfg.dq_block_n))
    for name, kind, bm, bn in launches:
        for has_doc in (False, True):
            for even in (True, False):
                tokens = EVEN_TOKENS if even else UNEVEN_TOKENS
                # As function.py: fp32 inputs run the exact-product dots, compiled kernels never upcast.
                constants = dict(HAS_DOC=has_doc, IEEE=dtype == "fp32", UPCAST=False, HEADS_FASTEST=cfg.heads_fastest,
                                 **_shape_constants(bm, bn, head_dim, tokens, tokens))
                yield name, getattr(kern, name), (bm, bn), has_doc, even, constants, _launch_opts(cfg, False, kind)
    kv_tiles, dq_tiles = (cfg.bwd_block_m, cfg.bwd_block_n), (cfg.dq_block_m, cfg.dq_block_n)
    for has_doc in (False, True) if cfg.fused_backward else ():
        for even in (True, False):
            tokens = EVEN_TOKENS if even else UNEVEN_TOKENS
            constants = dict(HAS_DOC=has_doc, IEEE=dtype == "fp32", UPCAST=False, HEADS_FASTEST=cfg.heads_fastest,
                             **_fused_constants(kv_tiles, dq_tiles, head_dim, tokens, tokens))
            yield ("bwd_kernel", kern.bwd_kernel, kv_tiles + dq_tiles, has_doc, even, constants,
                   _launch_opts(cfg, False, "dkdv"))
    for even in (True, False):
        tokens = EVEN_TOKENS if even else UNEVEN_TOKENS
        for has_dlse in (False, True):
            constants = dict(HAS_DLSE=has_dlse, **_delta_constants(head_dim, tokens))
            yield ("bwd_delta_kernel", kern.bwd_delta_kernel, (constants["BLOCK_M"], constants["BLOCK_D"]), False, even,
                   constants, DELTA_LAUNCH)
    shape = _shape_constants(cfg.block_m, cfg.block_n, head_dim, EVEN_TOKENS, EVEN_TOKENS)
    yield ("merge_kernel", kern.merge_kernel, (cfg.block_m, cfg.block_n), False, True,
           dict(BLOCK_M=cfg.block_m, BLOCK_D=shape["BLOCK_D"], HEAD_DIM=head_dim), _launch_opts(cfg, False, "fwd"))
    for tiles in dict.fromkeys(((cfg.block_m, cfg.block_n), (cfg.bwd_block_m, cfg.bwd_block_n),
                                (cfg.dq_block_m, cfg.dq_block_n))):
        for has_doc in (False, True):
            yield ("classify_kernel", kern.classify_kernel, tiles, has_doc, True,
                   dict(HAS_DOC=has_doc, BLOCK_M=tiles[0], BLOCK_N=tiles[1]), {})


def compile_one(fn, constants, opts, dtype, arch, scalars) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = signature(fn, constants, dtype, scalars)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # Triton prints ptxas -v's report when dump_ptxas_log is set
        compiled = triton.compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=opts)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    if regs is None:
        raise RuntimeError(f"no ptxas report in Triton's output: {text[-300:]!r}")
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return {"shared_bytes": int(compiled.metadata.shared), "registers": int(regs.group(1)), "spill_bytes": spills}


def _launches(kern, head_dims, dtypes, overrides: dict, names):
    """(head_dim, dtype, variant) for each distinct variant among `names` (kernel function names)."""
    from mimo.config.kernel import KernelConfig

    seen = set()
    for head_dim in head_dims:
        cfg = KernelConfig(**overrides).resolve(head_dim)
        for dtype in dtypes:
            for variant in variants(kern, cfg, head_dim, dtype):
                name, _, _, _, _, constants, opts = variant
                # The tile classification reads only masks: one compile per tiles, not per head dim or dtype.
                key = (name, tuple(sorted(constants.items())), tuple(sorted(opts.items())),
                       None if name == "classify_kernel" else dtype)
                if name in names and key not in seen:
                    seen.add(key)
                    yield head_dim, dtype, variant


def _problems(row: dict, arch: int) -> list:
    """Why a launch of this compiled variant would be refused on `arch` (empty: it fits)."""
    problems = []
    if row["shared_bytes"] > SHARED_LIMIT[arch]:
        problems.append(f"shared memory {row['shared_bytes']} B > {SHARED_LIMIT[arch]} B")
    threads = row["num_warps"] * 32
    if row["registers"] * threads > REGISTERS_PER_SM:
        problems.append(f"{row['registers']} registers x {threads} threads > {REGISTERS_PER_SM}")
    return problems


def check(arch: int, head_dims, dtypes, overrides: dict, names=tuple(KERNELS.values())):
    """One row per variant, in order; compiles run in this process, serially."""
    import triton.knobs as knobs

    from mimo.attention.kernel_loader import kernels

    kern = kernels(False)
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.compilation.scope(), \
            knobs.nvidia.scope():
        # Always compile, into a private cache: a kernel served from a cache runs no ptxas, so
        # prints no report, and the user's own cache is left alone.
        knobs.cache.dir = cache
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        for head_dim, dtype, (name, fn, tiles, has_doc, even, constants, opts) in _launches(
                kern, head_dims, dtypes, overrides, names):
            row = dict(kernel=name, arch=f"sm_{arch}", head_dim=head_dim, dtype=dtype, has_doc=has_doc, even=even,
                       tiles=list(tiles), num_warps=opts.get("num_warps", 4), num_stages=opts.get("num_stages", 3))
            if "HAS_DLSE" in constants:
                row["has_dlse"] = constants["HAS_DLSE"]
            tokens = EVEN_TOKENS if even else UNEVEN_TOKENS
            try:
                row.update(compile_one(fn, constants, opts, dtype, arch,
                                       _scalar_values(fn, head_dim, tokens, *tiles[:2], tiles[2:] or None)))
            except Exception as exc:  # a variant that does not build is the finding, not a crash
                row.update(fits=False, error=f"{type(exc).__name__}: {str(exc).strip()[:400]}")
                yield row
                continue
            problems = _problems(row, arch)
            row["fits"] = not problems
            if problems:
                row["error"] = "; ".join(problems)
            yield row


def _int_list(text: str):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--head-dim {text!r}: expected comma-separated integers") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT),
                   help="compute capability x10 (80 A100, 89 L40S, 90 H100/H200, 100 B200; default 90)")
    p.add_argument("--head-dim", default="128", help="comma-separated head dims (default 128)")
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32 (default bf16)")
    p.add_argument("--config", default="{}", help="KernelConfig fields as JSON, e.g. '{\"bwd_num_warps\": 8}'")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma-separated, of {', '.join(KERNELS)} (default all)")
    args = p.parse_args(argv)
    from mimo.config.kernel import field_problems, resolve_problem

    try:
        head_dims = _int_list(args.head_dim)
        dtypes = [x.strip() for x in args.dtype.split(",") if x.strip()]
        try:
            overrides = json.loads(args.config)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"--config: not JSON ({exc})") from None
        problems = field_problems(overrides)
        if problems:
            key, reason = problems[0]
            raise ValueError(f"--config: {key + ': ' if key else ''}{reason}")
        kernel_names = [x.strip() for x in args.kernels.split(",") if x.strip()]
        unknown = [k for k in kernel_names if k not in KERNELS]
        if unknown or not kernel_names:
            raise ValueError(f"--kernels {args.kernels!r}: expected names from {', '.join(KERNELS)}")
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"--dtype {unknown[0]!r}: expected one of {', '.join(DTYPES)}")
        if not head_dims or any(d < 1 or d > 256 for d in head_dims):
            raise ValueError("--head-dim: each head dim must be 1..256")
        if not dtypes:
            raise ValueError(f"--dtype {args.dtype!r}: expected names from {', '.join(DTYPES)}")
        for d in head_dims:
            problem = resolve_problem(overrides, d)
            if problem:
                raise ValueError(f"--config: {problem[0]}: {problem[1]}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import triton.knobs as knobs

    if knobs.runtime.interpret:
        # Triton decorates its own library functions (reductions, cdiv, ...) for the interpreter
        # when it is imported with TRITON_INTERPRET on; such a process cannot generate GPU code.
        print("error: Triton was imported with TRITON_INTERPRET on; run this tool as its own process",
              file=sys.stderr)
        return 2
    ptxas = knobs.nvidia.ptxas_blackwell if args.arch >= 100 else knobs.nvidia.ptxas  # as Triton picks it
    if not os.path.exists(ptxas.path or ""):
        print(json.dumps({"summary": True, "ok": True, "compiled": 0,
                          "message": "no ptxas in this Triton install (it ships with the x86-64 Linux wheels): "
                                     "nothing compiled"}))
        return 0
    rows = []
    for row in check(args.arch, head_dims, dtypes, overrides, [KERNELS[k] for k in kernel_names]):
        rows.append(row)
        print(json.dumps(row), flush=True)
    failed = [r for r in rows if not r["fits"]]
    spilling = sorted({r["kernel"] for r in rows if r.get("spill_bytes")})
    print(json.dumps({"summary": True, "ok": not failed, "arch": f"sm_{args.arch}", "compiled": len(rows),
                      "failed": len(failed), "max_shared_bytes": max((r.get("shared_bytes", 0) for r in rows),
                                                                     default=0),
                      "shared_limit_bytes": SHARED_LIMIT[args.arch], "spilling_kernels": spilling}))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # this tool compiles; it never interprets (see main)
    sys.exit(main())
