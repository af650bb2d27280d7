"""The `grpolab` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def cmd_train(args: argparse.Namespace) -> int:
    from grpolab.selfcheck import run_core_selfcheck

    # Until the trainer lands, the main job runs the core's own checks on a tiny model.
    return run_core_selfcheck()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpolab", description="GRPO training whose every intermediate quantity is checked."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GRPO training (no arguments: the CPU demo)")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
