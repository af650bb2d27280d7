"""`grpolab rollout`: sample a few groups from the configured policy, score them, show them.

    grpolab rollout                                   # demo model, arithmetic, 4 prompts
    grpolab rollout --config gsm8k.yaml --n-prompts 2 --json
    grpolab rollout task.name=gsm8k task.path=data.jsonl rollout.temperature=0.7

The quickest look at what the trainer will see: prompts, completions, per-function rewards,
truncation, and the reward metrics of the batch (reward_errors/<name> included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpolab.commands.jsonout import json_stdout, print_json
from grpolab.rollout.advice import sampling_advice


def add_rollout_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("rollout", help="sample, score and show a few groups (no training)")
    p.add_argument("--config", help="YAML config file (default: the built-in CPU demo)")
    p.add_argument("--n-prompts", type=int, default=4, metavar="N", help="prompts to sample")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. rollout.temperature=0.7")
    p.set_defaults(func=cmd_rollout)
    return p


def cmd_rollout(args: argparse.Namespace) -> int:
    # With --json, stdout carries the JSON object only; notes go to stderr.
    console = Console(stderr=args.json)
    try:
        report = run_rollout(args.config, args.overrides, args.n_prompts, console)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"grpolab: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print_json(json.dumps(report, allow_nan=False))
    else:
        print_report(report, console)
    return 0


def run_rollout(
    config: str | None, overrides: list[str], n_prompts: int, console: Console
) -> dict[str, Any]:
    from grpolab import seeds
    from grpolab.config import load_config, load_warnings
    from grpolab.rewards import load_rewards, score
    from grpolab.tasks import load_task
    from grpolab.train.setup import load_start_model, model_source, resolve_device, task_engine

    cfg = load_config(config, overrides)
    for warning in load_warnings(cfg):  # keys given that change nothing: said, as train does
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    G = cfg.batch.num_generations
    if n_prompts < 1:
        raise ValueError(f"--n-prompts={n_prompts}: expected an integer >= 1")
    task = load_task(cfg.task)
    console.print(task.describe_split())
    console.print(task.describe_answers())
    rewards = load_rewards(
        cfg.rewards, task=task, max_completion_length=cfg.rollout.max_completion_length
    )
    if cfg.runtime.num_threads:
        torch.set_num_threads(cfg.runtime.num_threads)
    model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
    # A separate engine (vLLM) reads the model from where the trainer did (a GGUF model's
    # converted directory); the demo model is saved for it.
    path = model_source(cfg) if cfg.model.name_or_path else None
    engine = task_engine(cfg, model, tokenizer, model_path=path)
    examples = task.sample(min(n_prompts, len(task.train)), seeds.prompt_order(cfg.seed))
    rollout = engine.generate([e.prompt for e in examples], G, cfg.rollout.sampling(cfg.seed))
    result = score(rollout, examples, rewards)
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    unread, warnings = unreadable(tokenizer, examples)
    templated, applied = tokenizer.chat_template is not None, cfg.task.chat_template
    warnings += sampling_advice(rollout.completions, result.total, templated, applied)
    samples = []
    for i in range(rollout.batch_size):
        samples.append(
            {
                "group": int(rollout.group_ids[i]),
                "prompt": rollout.prompts[i],
                # What the model read instead, where the tokenizer cannot write the prompt.
                **({"prompt_read": unread[p]} if (p := rollout.prompts[i]) in unread else {}),
                "completion": rollout.completions[i],
                "answer": examples[i // G].answer,
                "reward": _finite(result.total[i].item()),
                "rewards": {k: _finite(v[i].item()) for k, v in result.per_function.items()},
                "truncated": bool(rollout.truncated[i]),
                "length": int(lengths[i]),
                **({} if rollout.turns is None else {"turns": turn_json(rollout, i)}),
            }
        )
    return {
        "model": cfg.model.name_or_path or "the demo model",
        "task": cfg.task.name,
        "num_generations": G,
        "samples": samples,
        "metrics": {k: _finite(v) for k, v in result.metrics.items()},
        "warnings": warnings,
    }


# What a rollout says when the tokenizer cannot write the task's text (tokenizer.coverage).
CANNOT_WRITE = {
    "prompts": "the prompt column shows what the model reads",
    "reference answers": "the model can never write these answers",
}


def unreadable(tokenizer, examples) -> tuple[dict[str, str], list[str]]:
    """({prompt: what the model reads} for the prompts the tokenizer does not give back,
    warnings naming the characters of the prompts and answers it cannot write)."""
    from grpolab.tasks.coverage import round_trip

    warnings, read = [], {}
    texts = {
        "prompts": [e.prompt for e in examples],
        "reference answers": [e.answer for e in examples],
    }
    for what, group in texts.items():
        failed = [t for t in round_trip(tokenizer, group).values() if not t.ok]
        if what == "prompts":
            read = {t.text: t.read for t in failed}
        if failed:
            lost = "".join(dict.fromkeys(c for t in failed for c in t.lost))
            shown = ", ".join(map(repr, lost[:16])) + (", ..." if len(lost) > 16 else "")
            warnings.append(
                f"the tokenizer cannot write {len(lost)} characters of these {what} ({shown}): "
                f"{CANNOT_WRITE[what]} (the preflight's tokenizer.coverage fails)"
            )
    return read, warnings


def turn_json(rollout, i: int) -> list[dict[str, Any]]:
    """Sample i's turns: role (assistant / tool), text, trained (true only for the model's
    own tokens), tokens; a tool turn names its tool and whether the call failed."""
    out = []
    for t in rollout.turns[i]:
        turn = {"role": t.role, "text": t.text, "trained": t.trained, "tokens": t.end - t.start}
        if t.role == "tool":
            turn |= {"name": t.name, "error": t.error}
        out.append(turn)
    return out


def print_report(report: dict[str, Any], console: Console) -> None:
    samples = report["samples"]
    names = list(samples[0]["rewards"]) if samples else []
    table = Table(
        title=f"rollout: {report['task']}, G={report['num_generations']}, {report['model']}",
        show_lines=True,
    )
    for col in ("group", "prompt", "completion", "answer", "reward", *names, "len", "trunc"):
        table.add_column(col, overflow="fold")
    for s in samples:
        table.add_row(
            str(s["group"]),
            s.get("prompt_read", s["prompt"]),
            _turns_text(s["turns"]) if "turns" in s else s["completion"],
            s["answer"],
            _fmt(s["reward"]),
            *(_fmt(s["rewards"][n]) for n in names),
            str(s["length"]),
            "yes" if s["truncated"] else "",
        )
    console.print(table)
    shown = ", ".join(f"{k}={_fmt(v)}" for k, v in report["metrics"].items())
    console.print(shown)
    for warning in report.get("warnings", []):
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")


def _turns_text(turns: list[dict[str, Any]]) -> str:
    """An episode's turns, one line each: the model's as written, a tool's marked."""
    return "\n".join(
        escape(t["text"] if t["trained"] else f"[{t['name'] or 'tool'} -> {t['text']}]")
        for t in turns
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpolab")
    add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["rollout", *(sys.argv[1:] if argv is None else argv)])
    with json_stdout(args.json):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
