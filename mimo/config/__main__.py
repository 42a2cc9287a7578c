"""`python -m mimo.config check FILE.yaml [--world-size N] [--set a.b=v ...]`."""

import argparse
import shlex
import sys

from . import ConfigError, load_config
from .load import apply_overrides, read_yaml


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
        raw = apply_overrides(read_yaml(args.file), list(args.set))
        # Under training.replan: auto a job of another size re-plans the layout, which this check cannot do:
        # the layout is checked on its own (its span is the world size it fills), then compared with N.
        training = raw.get("training")
        replan = isinstance(training, dict) and training.get("replan") == "auto"
        cfg = load_config(raw, world_size=None if replan else args.world_size)
        if replan and args.world_size not in (None, cfg.world_size):
            raise ConfigError([("--world-size", _replan_note(args, cfg.world_size))])
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print("ok")
    return 0


def _replan_note(args, layout_ranks: int) -> str:
    """Under training.replan: auto a job of another size re-plans the layout at start, which needs the
    planner and the checkpoint: the training script's --check decides that, with the same overrides."""
    sets = "".join(f" --set {shlex.quote(s)}" for s in args.set)
    return (f"the layout is for {layout_ranks} ranks, not {args.world_size}; under training.replan: auto a job on "
            f"{args.world_size} ranks re-plans it at start, which this check cannot do: `WORLD_SIZE={args.world_size} "
            f"python examples/pretrain_mimo.py --config {shlex.quote(args.file)}{sets} --check` checks that")

if __name__ == "__main__":
    sys.exit(main())
