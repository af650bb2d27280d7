"""`grpolab drill`: init a workspace, check it once, or run the interactive session."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpolab.commands.drill.texts import LANGS, msg, pick_lang
from grpolab.commands.jsonout import print_json

DEFAULT_DIR = "grpo-drill"
ACTIONS = ("init", "check")


def resolve_dir(given: str | None) -> Path:
    """DIR, else the current directory when it holds my_grpo.py, else grpo-drill."""
    from grpolab.commands.drill.template import IMPL_FILE

    if given:
        return Path(given)
    return Path(".") if Path(IMPL_FILE).is_file() else Path(DEFAULT_DIR)


def cmd_init(directory: Path, lang: str) -> int:
    from grpolab.commands.drill.template import IMPL_FILE, init_workspace

    written, kept = init_workspace(directory)
    for path in written:
        print(msg("init_written", lang, path=path))
    for path in kept:
        print(msg("init_kept", lang, path=path))
    print(msg("init_next", lang, path=directory / IMPL_FILE, dir=directory))
    return 0


def cmd_check(directory: Path, lang: str, as_json: bool) -> int:
    """Exit 0 when all seven goals pass, 1 otherwise, 2 when there is no workspace."""
    from grpolab.commands.drill import render
    from grpolab.commands.drill.runner import Workbench
    from grpolab.commands.drill.state import load_state, save_state
    from grpolab.commands.drill.template import IMPL_FILE, train_command

    path = directory / IMPL_FILE
    if not path.is_file():
        print(msg("no_workspace", lang, path=path, dir=directory), file=sys.stderr)
        return 2
    report = Workbench().check(path)
    state = load_state(directory)
    state.record(report)
    save_state(directory, state)
    if as_json:
        print_json(json.dumps(report.to_json(), indent=2, default=str))
    else:
        paint = render.Painter.for_stream(sys.stdout)
        shell = render.Shell(str(directory), train_command(directory))
        print("\n".join(render.report_lines(report, lang, paint, shell)))
    return 0 if report.all_pass else 1


def cmd_drill(args: argparse.Namespace) -> int:
    lang = pick_lang(args.lang)
    words = list(args.words)
    action = words.pop(0) if words and words[0] in ACTIONS else None
    if len(words) > 1:
        print(msg("bad_arguments", lang, args=words[1:]), file=sys.stderr)
        return 2
    given = words[0] if words else None
    if action == "init":
        return cmd_init(Path(given or DEFAULT_DIR), lang)
    directory = resolve_dir(given)
    if action == "check":
        return cmd_check(directory, lang, args.json)
    from grpolab.commands.drill.session import run_session
    from grpolab.commands.drill.template import IMPL_FILE

    if not (directory / IMPL_FILE).is_file():
        print(msg("no_workspace", lang, path=directory / IMPL_FILE, dir=directory))
        return 2
    return run_session(directory, lang, continue_hints=args.continue_hints)


def add_drill_parser(sub) -> None:
    p = sub.add_parser(
        "drill",
        help="write GRPO's core yourself, check it goal by goal, then train with it",
        description="grpolab drill init DIR | grpolab drill check DIR [--json] | "
        "grpolab drill [DIR] [--continue] (interactive: goals, check, hint [N], show N, train, "
        "quit)",
    )
    p.add_argument("words", nargs="*", metavar="[init|check] DIR")
    p.add_argument("--lang", choices=LANGS, help="en or zh (default: from LANG / LC_ALL)")
    p.add_argument("--json", action="store_true", help="drill check: print the report as JSON")
    p.add_argument(
        "--continue",
        dest="continue_hints",
        action="store_true",
        help="interactive drill: go on from the hints seen in earlier sessions (each session "
        "starts at hint 1 otherwise)",
    )
    p.set_defaults(func=cmd_drill)
