"""The `grpolab` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _fail(message: str) -> int:
    print(f"grpolab: error: {message}", file=sys.stderr)
    return 2


def cmd_train(args: argparse.Namespace) -> int:
    from grpolab.config import ConfigError, load_config
    from grpolab.preflight import PreflightFailed
    from grpolab.trainer import MonitorStop, NonFiniteError, train

    try:
        cfg = load_config(args.config, args.overrides)
        core = impl_core(args.impl, cfg.trainer) if args.impl else None
        train(
            cfg,
            resume=args.resume,
            overwrite=args.overwrite,
            core=core,
            skip_preflight=args.skip_preflight,
        )
    except PreflightFailed as e:
        _fail(str(e))
        return 1
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        return _fail(str(e))
    except NonFiniteError as e:
        _fail(str(e))
        return 3
    except MonitorStop as e:
        _fail(str(e))
        return 4
    return 0


def impl_core(path: str, trainer_cfg):
    """The trainer's core with the functions a user's file defines; the rest stay grpolab's."""
    from grpolab.checks import ImplLoadError, load_impl
    from grpolab.trainer import default_core

    try:
        impl = load_impl(path)
    except ImplLoadError as e:
        raise ValueError(str(e)) from None
    fns = default_core(trainer_cfg.logprobs, trainer_cfg.shared_prefix)
    for name, source in impl.source.items():
        if source != "grpolab":
            setattr(fns, name, getattr(impl, name))
            fns.source[name] = source
    fns.path = impl.path
    return fns


def cmd_eval(args: argparse.Namespace) -> int:
    from grpolab.config import ConfigError, load_config
    from grpolab.trainer import run_eval

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.task:
        overrides.append(f"task.name={args.task}")
    try:
        cfg = load_config(args.config, overrides)
        run_eval(cfg, args.examples, args.pass_at_k, args.samples, args.temperature)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from grpolab.report import write_report

    try:
        write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from grpolab.warmup import WarmupConfig, warmup

    warmup(args.output, WarmupConfig(steps=args.steps, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpolab", description="GRPO training whose every intermediate quantity is checked."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GRPO training (no arguments: the CPU demo)")
    train.add_argument("--config", help="YAML config file (default: the built-in CPU demo)")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="continue from the latest checkpoint in output_dir, or from PATH",
    )
    train.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in output_dir"
    )
    train.add_argument(
        "--skip-preflight",
        action="store_true",
        help="start without the preflight checks (a warning goes to the log and run directory)",
    )
    train.add_argument(
        "--impl",
        metavar="FILE",
        help="a Python file defining any of the core functions to train with instead",
    )
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. trainer.learning_rate=1e-6"
    )
    train.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="held-out accuracy (and pass@k) of a model")
    ev.add_argument("--model", help="model directory or hub id (default: the demo model)")
    ev.add_argument("--task", help="task name (default: arithmetic)")
    ev.add_argument("--config", help="YAML config file for the task/rollout sections")
    ev.add_argument("--examples", type=int, default=None, help="held-out problems (default all)")
    ev.add_argument("--pass-at-k", type=int, default=None, metavar="K", help="also pass@K")
    ev.add_argument("--samples", type=int, default=None, help="samples per problem for pass@k")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ev.set_defaults(func=cmd_eval)

    rep = sub.add_parser("report", help="plots and a one-page summary of a run directory")
    rep.add_argument("run_dir")
    rep.set_defaults(func=cmd_report)

    wu = sub.add_parser("warmup", help="regenerate the demo's warm-up model (supervised)")
    wu.add_argument("--output", default="src/grpolab/data/demo-warmup")
    wu.add_argument("--steps", type=int, default=120)
    wu.add_argument("--seed", type=int, default=0)
    wu.set_defaults(func=cmd_warmup)

    from grpolab.drill.cli import add_drill_parser
    from grpolab.preflight import add_preflight_parser
    from grpolab.rollout_cli import add_rollout_parser

    add_rollout_parser(sub)
    add_preflight_parser(sub)
    add_drill_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from grpolab.jsonout import json_stdout
    from grpolab.memory import limit_heap_retention

    limit_heap_retention()
    args = build_parser().parse_args(argv)
    with json_stdout(getattr(args, "json", False)):  # --json: stdout holds the JSON alone
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
