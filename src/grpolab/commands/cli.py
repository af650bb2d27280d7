"""The `grpolab` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import traceback

# A config override: a dotted key, "=", a value (e.g. optim.learning_rate=1e-6).
OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")


def _fail(message: str) -> int:
    print(f"grpolab: error: {one_line(message)}", file=sys.stderr)
    return 2


def one_line(message: str) -> str:
    """A message on one line: libraries' multi-line errors folded with "; "."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def cmd_train(args: argparse.Namespace) -> int:
    from grpolab.config import ConfigError, load_config
    from grpolab.train.loop import Interrupted, RewardsFailing, train
    from grpolab.train.monitors import MonitorStop, NonFiniteError
    from grpolab.train.preflight import PreflightFailed

    try:
        cfg = load_config(args.config, with_strict(args))
        functions = chosen_functions(cfg, args.impl)
        train(
            cfg,
            resume=args.resume,
            overwrite=args.overwrite,
            functions=functions,
            skip_preflight=args.skip_preflight,
            allow_config_change=args.allow_config_change,
            recheck=args.recheck,
        )
    except (PreflightFailed, RewardsFailing) as e:
        _fail(str(e))
        return 1
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        return _fail(str(e))
    except NonFiniteError as e:
        _fail(str(e))
        return 3
    except MonitorStop as e:
        _fail(str(e))
        return 4
    except Interrupted as e:
        print(f"grpolab: {one_line(str(e))}", file=sys.stderr)
        return 130
    return 0


def with_strict(args: argparse.Namespace) -> list[str]:
    """The overrides, with strict=true under --strict (keys without effect refused)."""
    return [*args.overrides, "strict=true"] if getattr(args, "strict", False) else args.overrides


def chosen_functions(cfg, impl_path: str | None):
    """The core functions the run uses: the trainer's as configured, with those a user's
    file (--impl) defines in their place."""
    from grpolab.functions import ImplLoadError, core_functions, load_impl

    try:
        user = load_impl(impl_path) if impl_path else None
    except ImplLoadError as e:
        raise ValueError(str(e)) from None
    return core_functions(cfg.runtime.logprobs, cfg.runtime.shared_prefix, user)


def cmd_preflight(args: argparse.Namespace) -> int:
    """Exit 0 when every check passes, 1 when any fails, 2 on a usage or config error."""
    from rich.console import Console
    from rich.markup import escape

    from grpolab.commands.jsonout import print_json
    from grpolab.config import ConfigError, load_config, load_notes, load_warnings
    from grpolab.train.preflight import preflight, print_results, results_json

    console = Console(stderr=args.json)  # with --json, stdout holds the JSON alone
    if not console.is_terminal:
        console.width = 160  # a log file or a pipe: no reason to wrap at 80
    try:
        cfg = load_config(args.config, with_strict(args))
        functions = chosen_functions(cfg, args.impl)
        episode_functions = None
        if args.impl:  # a file may also define episode functions (rollout.tools runs)
            from grpolab.functions import load_episode_impl

            episode_functions = load_episode_impl(args.impl)
        for note in load_notes(cfg):
            console.print(f"note: {escape(note)}")
        for warning in load_warnings(cfg):
            console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
        results = preflight(cfg, functions, episode_functions, console)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"grpolab preflight: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print_json(results_json(results, functions, load_warnings(cfg)))
    else:
        print_results(results, console, functions)
    return 0 if all(r.passed for r in results) else 1


def cmd_eval(args: argparse.Namespace) -> int:
    """A checkpoint of a run is evaluated on the run's own task and config (its config.yaml,
    under --config, --task and the overrides)."""
    from grpolab.config import ConfigError, load_config, load_notes
    from grpolab.train.loop import run_eval

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.task:
        overrides.append(f"task.name={args.task}")
    try:
        run_config = trained_with(args.model)
        cfg = load_config(args.config, overrides, base=run_config)
        if run_config is not None:
            print(f"evaluating {args.model} with the config it was trained with ({run_config})")
        for note in load_notes(cfg):
            print(f"note: {note}")
        run_eval(cfg, args.examples, args.pass_at_k, args.samples, args.temperature)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    return 0


def trained_with(model: str | None):
    """The config a grpolab checkpoint was trained with: its own config.yaml, else its run
    directory's; None for any other model."""
    from pathlib import Path

    from grpolab.train.checkpoint import COMPLETE, RUN_CONFIG

    if not model or not (Path(model) / COMPLETE).is_file():
        return None
    for path in (Path(model) / RUN_CONFIG, Path(model).parent / "config.yaml"):
        if path.is_file():
            return path
    return None


def cmd_report(args: argparse.Namespace) -> int:
    from grpolab.commands.report import write_reports

    try:
        write_reports([args.run_dir, *args.more_runs], args.output)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from grpolab.commands.warmup import ToolWarmupConfig, WarmupConfig, tool_warmup, warmup

    if args.task == "tool-calculator":
        output = args.output or "src/grpolab/data/tool-warmup"
        tool_warmup(output, ToolWarmupConfig(steps=args.steps or 800, seed=args.seed))
        return 0
    output = args.output or "src/grpolab/data/demo-warmup"
    warmup(output, WarmupConfig(steps=args.steps or 120, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpolab", description="GRPO training whose every intermediate quantity is checked."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_eval_parser(sub)

    rep = sub.add_parser(
        "report", help="plots and a one-page summary of a run directory, or of runs compared"
    )
    rep.add_argument("run_dir")
    rep.add_argument(
        "more_runs", nargs="*", metavar="RUN_DIR", help="more runs: their curves overlaid"
    )
    rep.add_argument(
        "--output",
        metavar="DIR",
        help="where to write (default: RUN_DIR itself; runs compared: compare-<names> beside "
        "the first)",
    )
    rep.set_defaults(func=cmd_report)

    wu = sub.add_parser("warmup", help="regenerate a shipped warm-up model (supervised)")
    wu.add_argument(
        "--task",
        choices=["arithmetic", "tool-calculator"],
        default="arithmetic",
        help="the demo's model, or the tool example's (examples/tool-calculator.yaml)",
    )
    wu.add_argument("--output", default=None, help="default: the package's data directory")
    wu.add_argument("--steps", type=int, default=None, help="default: 120 / 800")
    wu.add_argument("--seed", type=int, default=0)
    wu.set_defaults(func=cmd_warmup)

    from grpolab.commands.drill.cli import add_drill_parser
    from grpolab.commands.rollout import add_rollout_parser

    add_rollout_parser(sub)
    add_preflight_parser(sub)
    add_drill_parser(sub)
    return parser


def add_train_parser(sub) -> None:
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
        "--allow-config-change",
        action="store_true",
        help="with --resume: apply config values that differ from the checkpoint's (learning "
        "rate, objective, ...) instead of refusing; config.yaml records them",
    )
    train.add_argument(
        "--skip-preflight",
        action="store_true",
        help="start without the preflight checks (a warning goes to the log and run directory)",
    )
    train.add_argument(
        "--recheck",
        action="store_true",
        help="run the preflight even when a pass of the same model, functions, task and "
        "config is remembered",
    )
    train.add_argument(
        "--strict",
        action="store_true",
        help="refuse a key that has no effect under the rest of the config (default: a warning)",
    )
    train.add_argument(
        "--impl",
        metavar="FILE",
        help="a Python file defining any of the core functions to train with instead",
    )
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optim.learning_rate=1e-6"
    )
    train.set_defaults(func=cmd_train)


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="held-out accuracy (and pass@k) of a model")
    ev.add_argument("--model", help="model directory or hub id (default: the demo model)")
    ev.add_argument("--task", help="task name (default: a checkpoint's own run's, else arithmetic)")
    ev.add_argument(
        "--config",
        help="YAML config file for the task/rollout sections (over a checkpoint's own run's)",
    )
    ev.add_argument("--examples", type=int, default=None, help="held-out problems (default all)")
    ev.add_argument("--pass-at-k", type=int, default=None, metavar="K", help="also pass@K")
    ev.add_argument("--samples", type=int, default=None, help="samples per problem for pass@k")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ev.set_defaults(func=cmd_eval)


def add_preflight_parser(sub) -> None:
    pre = sub.add_parser(
        "preflight", help="check every intermediate GRPO quantity on the configured model"
    )
    pre.add_argument("--config", help="YAML config file (default: the built-in CPU demo)")
    pre.add_argument(
        "--impl", help="a Python file defining any of the core functions to check instead"
    )
    pre.add_argument("--json", action="store_true", help="print the results as JSON")
    pre.add_argument(
        "--strict", action="store_true", help="refuse a key that has no effect (default: a warning)"
    )
    pre.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    pre.set_defaults(func=cmd_preflight)


def overrides_last(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Flags and KEY=VALUE overrides in any order: for a subcommand that takes overrides,
    every positional word moves behind "--", so an option with an optional value (--resume
    [PATH]) never swallows an override, and flags after overrides are still flags.

    `--resume` takes the next word only when it is neither an option nor an override."""
    sub = _subcommand_parser(parser, argv[0]) if argv else None
    if sub is None or not any(a.dest == "overrides" for a in sub._actions):
        return argv
    nargs = {name: a.nargs for a in sub._actions for name in a.option_strings}
    flags, positional, i = [argv[0]], [], 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            positional += argv[i + 1 :]
            break
        if word.startswith("-") and len(word) > 1:
            flags.append(word)
            arity = nargs.get(word, 0)  # an unknown option is argparse's to report
            if i + 1 < len(argv) and "=" not in word:
                nxt = argv[i + 1]
                optional_value = not nxt.startswith("-") and not OVERRIDE.match(nxt)
                if arity is None or (arity == "?" and optional_value):
                    flags.append(nxt)
                    i += 1
        else:
            positional.append(word)
        i += 1
    return flags + (["--", *positional] if positional else [])


def _subcommand_parser(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


# Set by the first Ctrl-C. Some libraries turn a KeyboardInterrupt raised inside their
# imports into another error (transformers' lazy modules raise ModuleNotFoundError "from" it),
# so whether the user interrupted is remembered here rather than read from the exception.
_interrupted = False
# True until the command starts: while the CLI imports its modules nothing has begun, and a
# KeyboardInterrupt raised inside a native extension's import can abort the process (a C++
# terminate, exit -6) instead of unwinding, so a Ctrl-C then ends the process at once.
_starting = True


def _on_interrupt(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    if _starting:
        exit_interrupted()
    raise KeyboardInterrupt


def _caused_by_interrupt(err: BaseException | None) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C at any moment, imports and model loading included, ends in one line (130)."""
    previous = signal.getsignal(signal.SIGINT)
    remember = previous is signal.default_int_handler and threading.current_thread() is (
        threading.main_thread()  # only the main thread may set a handler
    )
    if remember:
        signal.signal(signal.SIGINT, _on_interrupt)
    try:
        return _main(argv)
    except BaseException as err:
        if not (_interrupted or _caused_by_interrupt(err)) or isinstance(err, SystemExit):
            raise
        exit_interrupted()
    finally:
        if remember:
            signal.signal(signal.SIGINT, previous)


def exit_interrupted() -> None:
    """One line and exit 130 at once: a half-finished import (torch's, interrupted) can make
    the interpreter's own shutdown end the process by SIGINT instead, so it is skipped; there
    is nothing left to write (checkpoints are written atomically before this point)."""
    print("grpolab: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _main(argv: list[str] | None) -> int:
    global _starting
    from grpolab.commands.jsonout import json_stdout
    from grpolab.model.memory import fix_malloc_thresholds

    fix_malloc_thresholds()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(overrides_last(argv, parser))
    _starting = False  # the command begins: from here an interrupt unwinds
    try:
        with json_stdout(getattr(args, "json", False)):  # --json: stdout holds the JSON alone
            return args.func(args)
    except Exception as err:  # a failure no command anticipated: one line, not a traceback
        if os.environ.get("GRPOLAB_TRACEBACK") or _interrupted or _caused_by_interrupt(err):
            raise
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return _fail(
            f"{type(err).__name__}: {err} (at {os.path.basename(frame.filename)}:"
            f"{frame.lineno}; GRPOLAB_TRACEBACK=1 shows the traceback)"
        )


if __name__ == "__main__":
    sys.exit(main())
