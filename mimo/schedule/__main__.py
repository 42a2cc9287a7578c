"""`python -m mimo.schedule show FILE.yaml [--rank R] [--json] [--set a.b=v ...]`: one step's plan.

Prints every action of every rank (or of rank R) in execution order, one per
line, without starting any process; `--json` prints one JSON object per
action. The plan is checked first: a plan that would deadlock is an error.
"""

import argparse
import os
import sys

from mimo.config import ConfigError, load_config

from .check import check_plan
from .plan import PlanError, build_plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimo.schedule")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the step plan of a config without starting any process")
    show.add_argument("file")
    show.add_argument("--rank", type=int, default=None, help="only this rank's actions")
    show.add_argument("--json", action="store_true", help="one JSON object per action")
    show.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a field, e.g. training.global_batch_size=16")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.file, args.set)
        plan = build_plan(cfg)
        check_plan(plan)
    except ConfigError as exc:  # already one `error: path: reason` line per problem
        print(str(exc), file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.rank is not None and not 0 <= args.rank < plan.world_size:
        print(f"error: --rank {args.rank} is outside the config's ranks [0, {plan.world_size})", file=sys.stderr)
        return 2
    lines = plan.json_lines(args.rank) if args.json else plan.lines(args.rank)
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error of the plan
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush is quiet
    return 0


if __name__ == "__main__":
    sys.exit(main())
