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
                       help="also check that the layout fills exactly this many ranks")
    check.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                       help="override a field, e.g. training.lr=1e-4")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size: must be at least 1, got {args.world_size}")
    try:
        load_config(args.file, args.set, world_size=args.world_size)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
