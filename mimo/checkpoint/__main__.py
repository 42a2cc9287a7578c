"""Checkpoint tools (one process, no GPU).

    python -m mimo.checkpoint inspect DIR [--checksums]           # DIR or DIR/iter_NNNNNNN
    python -m mimo.checkpoint convert DIR/iter_NNNNNNN --to-torch OUT.pt

`convert` writes `{module: {parameter: full tensor}}` (unsharded, layout-independent
names) after checking every file's CRC32; `inspect` checks that every file is there
with its size (`--checksums`: also its CRC32) and prints the step, the layout the
checkpoint was saved with and each module's parameters and sizes. Bad input or a
damaged file: one `error:` line, exit 2
(`MIMO_DEBUG=1` adds the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from .paths import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimo.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print step, layout, modules and sizes")
    ins.add_argument("path", help="a checkpoint directory (DIR, via its latest) or DIR/iter_NNNNNNN")
    ins.add_argument("--checksums", action="store_true",
                     help="also read every file and check its CRC32 (by default only presence and size)")
    conv = sub.add_parser("convert", help="write the full, unsharded weights as one torch file")
    conv.add_argument("path", help="DIR/iter_NNNNNNN (or DIR, via its latest)")
    conv.add_argument("--to-torch", required=True, metavar="OUT.pt")
    args = p.parse_args(argv)
    from .convert import full_weights, summary

    try:
        if args.command == "inspect":
            print(summary(args.path, args.checksums))
        else:
            import torch

            from mimo.config.outputs import output_problem

            if not os.path.basename(args.to_torch):
                raise CheckpointError(f"--to-torch: {args.to_torch or repr('')} is a directory; name the file to write")
            problem = output_problem(args.to_torch, "file")
            if problem:
                raise CheckpointError(f"--to-torch: {problem}")
            weights = full_weights(args.path)
            try:
                os.makedirs(os.path.dirname(os.path.abspath(args.to_torch)), exist_ok=True)
                torch.save(weights, args.to_torch)
            except (OSError, RuntimeError) as exc:  # the disk, not the input: torch reports a failed write as RuntimeError
                print(f"error: --to-torch: writing {args.to_torch} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 1
            n = sum(t.numel() for m in weights.values() for t in m.values())
            print(f"wrote {args.to_torch}: {len(weights)} modules, {n:,} parameters")
        return 0
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if os.environ.get("MIMO_DEBUG"):
            traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
