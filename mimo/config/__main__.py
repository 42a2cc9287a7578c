"""`python -m mimo.config check FILE.yaml [--world-size N] [--set a.b=v ...]`."""

import argparse
import sys

from . import ConfigError, load_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimo.config")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a config without starting any process")
    check.add_argument("file")
    check.add_argument("--world-size", type=int, default=None,
                       help="also check that the layout fills exactly this many ranks (under "
                            "training.replan: auto, a job of another size re-plans the layout at start)")
    check.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                       help="override a field, e.g. training.lr=1e-4")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size: must be at least 1, got {args.world_size}")
    try:
        cfg = load_config(args.file, args.set, world_size=args.world_size)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.world_size is not None and args.world_size != cfg.world_size:  # only under training.replan: auto
        print(f"ok (the layout is for {cfg.world_size} ranks; under training.replan: auto a job on {args.world_size} "
              f"re-plans it at start: `WORLD_SIZE={args.world_size} python examples/pretrain_mimo.py --config "
              f"{args.file} --check` shows the layout it takes)")
        return 0
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
