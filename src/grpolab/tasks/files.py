"""File-based tasks: GSM8K-style rows ("question", "answer" ending in "#### 42") and generic
rows with configurable prompt / answer fields. Local .jsonl / .json / .csv read here; .parquet files
and Hugging Face dataset ids go through `datasets`."""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path
from typing import Any

from grpolab.tasks.base import (
    AUTO_HOLD_OUT_KEEPS,
    GENERATED_NUM_EVAL,
    Example,
    Task,
    TaskConfig,
)
from grpolab.tasks.conversation import Conversation, is_conversation

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# Per task: (prompt_field, answer_field, prompt_template) when the config leaves them unset.
SAMPLE_GSM8K = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"
FILE_TASK_DEFAULTS = {
    "gsm8k": ("question", "answer", "{prompt} " + GSM8K_INSTRUCTION),
    "jsonl": ("prompt", "answer", "{prompt}"),
}
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def load_file_task(cfg: TaskConfig) -> Task:
    prompt_field, answer_field, template = _fields(cfg)
    held_out = _eval_rows(cfg)
    if isinstance(cfg.rows, str) and not cfg.path and held_out is not None:
        return _held_out_only(cfg, held_out, prompt_field, answer_field, template)
    rows, source = _train_rows(cfg)
    answer_field = _reference_field(cfg, rows, answer_field)
    examples = _examples(cfg, rows, prompt_field, answer_field, template, source)
    if not examples:
        raise ValueError(f"{source} holds no rows")
    if answer_field is None:  # nothing to hold out: an evaluation needs references
        task = Task(name=cfg.name, train=examples[: cfg.num_train or None], eval=[], config=cfg)
        task.has_references = False
        task.split_reason = (
            f"no row of {source} has an 'answer' or 'solution' field: no reference answers, "
            "so nothing is held out and the rewards alone judge the completions"
        )
        return task
    if held_out is not None:
        eval_rows, why = held_out
        eval_examples = _examples(cfg, eval_rows, prompt_field, answer_field, template, why)
        eval_examples = eval_examples[: cfg.num_eval or None]
        train = examples
        why = f"from {why}"
    else:
        # The rows held out (`_hold_out`) are chosen by task.seed.
        order = list(range(len(examples)))
        random.Random(cfg.seed).shuffle(order)
        n_eval, why = _hold_out(cfg, len(examples))
        eval_examples = [examples[i] for i in sorted(order[:n_eval])]
        train = [examples[i] for i in sorted(order[n_eval:])]
        if n_eval:
            why += f", chosen by task.seed={cfg.seed}"
    if cfg.num_train:
        train = train[: cfg.num_train]
    task = Task(name=cfg.name, train=train, eval=eval_examples, config=cfg)
    task.split_reason = why
    return task


Rows = list[tuple[str, dict[str, Any]]]  # [(where, row)]: where names the row in errors


def _held_out_only(cfg: TaskConfig, held_out: tuple[Rows, str], prompt_field: str,
                   answer_field: str, template: str) -> Task:  # fmt: skip
    """The held-out rows alone, when the training rows were given in Python (config.yaml
    records them as a line) and the held-out ones are given apart: what `grpolab eval` of
    such a run reads. No training row: a training run of it says so."""
    rows, why = held_out
    answer_field = _reference_field(cfg, rows, answer_field)
    examples = _examples(cfg, rows, prompt_field, answer_field, template, why)
    task = Task(name=cfg.name, train=[], eval=examples[: cfg.num_eval or None], config=cfg)
    task.has_references = answer_field is not None
    task.split_reason = f"from {why}; the training rows, task.rows={cfg.rows}, are not on disk"
    return task


def _train_rows(cfg: TaskConfig) -> tuple[Rows, str]:
    """(the training rows, what they are called): rows given in Python (task.rows), else
    task.path's. A record of rows given in Python (config.yaml's line for them) yields to a
    task.path given with it, and is refused alone: those rows are not on disk."""
    given = _given(cfg.rows, "task.rows", cfg.path, "task.path")
    if given is not None:
        return given
    if not cfg.path:
        raise ValueError(
            f"task.name={cfg.name!r} needs task.path (a .jsonl/.parquet file or a dataset id)"
        )
    return _read_rows(cfg.path, cfg.subset, cfg.split), f"task.path={cfg.path!r}"


def _eval_rows(cfg: TaskConfig) -> tuple[Rows, str] | None:
    """(the held-out rows, what they are called) when given apart: task.eval_rows,
    task.eval_path or task.eval_split; None: they are held out of the training rows."""
    given = _given(cfg.eval_rows, "task.eval_rows", cfg.eval_path, "task.eval_path")
    if given is not None:
        return given
    if not (cfg.eval_path or cfg.eval_split):
        return None
    path = cfg.eval_path or cfg.path
    if path is None:  # training rows given in Python, a split of nothing
        raise ValueError(f"task.eval_split={cfg.eval_split!r} needs task.path (a dataset id)")
    rows = _read_rows(path, cfg.subset, cfg.eval_split or cfg.split)
    return rows, path + (f"[{cfg.eval_split}]" if cfg.eval_split else "")


def _given(rows: Any, key: str, path: str | None, path_key: str) -> tuple[Rows, str] | None:
    """Rows given in Python as (where, row) pairs and their name; None when none are (or a
    record of them yields to `path`)."""
    if rows is None or (isinstance(rows, str) and path):
        return None
    if isinstance(rows, str):
        raise ValueError(
            f"{key}: {rows}: those rows are not on disk; give them as a file ({path_key}=FILE) "
            "or run from Python with them"
        )
    if path:
        raise ValueError(f"{key} and {path_key}={path!r} both give rows: give one of them")
    label = getattr(rows, "label", key)
    return [(f"{label} row {i + 1}", _as_row(r, f"{label} row {i + 1}", "a dict"))
            for i, r in enumerate(rows)], label  # fmt: skip


def _hold_out(cfg: TaskConfig, rows: int) -> tuple[int, str]:
    """(how many of a file's `rows` are held out, why): what task.eval_fraction or
    task.num_eval ask for; unasked, GENERATED_NUM_EVAL rows only when at least
    AUTO_HOLD_OUT_KEEPS of the file still trains, else none (a user's data is trained on)."""
    if cfg.eval_fraction is not None:
        if not 0 <= cfg.eval_fraction < 1:
            raise ValueError(f"task.eval_fraction={cfg.eval_fraction!r}: expected [0, 1)")
        return round(cfg.eval_fraction * rows), f"task.eval_fraction={cfg.eval_fraction:g}"
    if cfg.num_eval is not None:
        return min(cfg.num_eval, rows), f"task.num_eval={cfg.num_eval}"
    if rows - GENERATED_NUM_EVAL >= AUTO_HOLD_OUT_KEEPS * rows:
        return GENERATED_NUM_EVAL, (
            f"{GENERATED_NUM_EVAL} of {rows} rows held out, {AUTO_HOLD_OUT_KEEPS:.0%} or more "
            "still train; task.num_eval, task.eval_fraction or task.eval_path to choose"
        )
    return 0, (
        f"no hold-out: {GENERATED_NUM_EVAL} held-out rows would leave less than "
        f"{AUTO_HOLD_OUT_KEEPS:.0%} of the {rows} to train on; task.num_eval, "
        "task.eval_fraction or task.eval_path hold rows out for the held-out accuracy"
    )


def _reference_field(cfg: TaskConfig, rows, default: str) -> str | None:
    """The column holding the reference answers: task.answer_field when given; else the
    task's default ('answer'), else 'solution' (TRL's math datasets), whichever the rows
    have; None for a jsonl task whose rows have neither (a reward needs no reference)."""
    if cfg.answer_field is not None or cfg.name != "jsonl":
        return default
    for name in (default, "solution"):
        if any(name in row for _, row in rows):
            return name
    return None


BAD_ROWS_SHOWN = 10  # a file with many bad rows: this many are named, then a count


# Columns that often hold a task's prompts or answers under another name: a file without
# the configured one is pointed at the key that names it and the column it likely means.
PROMPT_COLUMNS = ("prompt", "question", "problem", "input", "instruction", "query", "text")
ANSWER_COLUMNS = ("answer", "solution", "output", "target", "label", "response", "completion")


def _check_columns(rows, prompt_field: str, answer_field: str | None, source: str) -> None:
    """A column no row has is one mistake, said once: which key names it, and the column of
    the file that probably holds it."""
    present = {name for _, row in rows for name in row}
    for field, key, likely in ((prompt_field, "task.prompt_field", PROMPT_COLUMNS),
                               (answer_field, "task.answer_field", ANSWER_COLUMNS)):  # fmt: skip
        if field is None or field in present or not rows:
            continue
        guess = next((c for c in likely if c in present), None)
        fix = f"{key}={guess}" if guess else f"{key}=<the column that holds them>"
        raise ValueError(
            f"{source}: no row has a field {field!r} (its fields: "
            f"{', '.join(sorted(map(str, present)))}); name the column with {fix}"
        )


def _examples(
    cfg, rows, prompt_field: str, answer_field: str, template: str, source: str
) -> list[Example]:
    """Every row's Example; the bad rows are all reported together (the first BAD_ROWS_SHOWN
    named), so a file is fixed in one pass, not one error per run. `source`: what the rows
    are called."""
    _check_columns(rows, prompt_field, answer_field, source)
    examples, bad = [], []
    for where, row in rows:
        try:
            examples.append(_example(cfg, row, where, prompt_field, answer_field, template))
        except ValueError as e:
            bad.append(str(e))
    if len(bad) == 1:
        raise ValueError(bad[0])
    if bad:
        more = len(bad) - BAD_ROWS_SHOWN
        raise ValueError(
            f"{len(bad)} of {len(rows)} rows are bad: "
            + "; ".join(bad[:BAD_ROWS_SHOWN])
            + (f"; ... and {more} more" if more > 0 else "")
        )
    return examples


def _fields(cfg: TaskConfig) -> tuple[str, str, str]:
    prompt_default, answer_default, template_default = FILE_TASK_DEFAULTS[cfg.name]
    return (
        cfg.prompt_field or prompt_default,
        cfg.answer_field or answer_default,
        cfg.prompt_template if cfg.prompt_template is not None else template_default,
    )


def _example(
    cfg: TaskConfig,
    row: dict[str, Any],
    where: str,
    prompt_field: str,
    answer_field: str,
    template: str,
) -> Example:
    for name in (prompt_field, answer_field):
        if name is not None and name not in row:
            raise ValueError(f"{where}: no field {name!r} (fields: {', '.join(map(str, row))})")
    prompt = row[prompt_field]
    answer = row[answer_field] if answer_field is not None else ""  # "": no reference
    if is_conversation(prompt):  # TRL's conversational form, rendered by the chat template
        try:
            conversation = Conversation(prompt)
        except ValueError as e:
            raise ValueError(f"{where}: field {prompt_field!r}: {e}") from None
        if template != "{prompt}":
            raise ValueError(
                f"{where}: field {prompt_field!r} is a conversation (a list of messages), used "
                f"as written: task.prompt_template={template!r} applies to text prompts only"
            )
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"{where}: field {prompt_field!r} is empty or neither text nor a list of "
            f"{{'role', 'content'}} messages: {_short(prompt)}"
        )
    if answer_field is not None and (
        answer is None or (isinstance(answer, str) and not answer.strip())
    ):
        raise ValueError(f"{where}: field {answer_field!r} is empty: {answer!r}")
    columns = dict(row)
    if cfg.name == "gsm8k":
        match = _GSM8K_FINAL.search(str(answer))
        if match is None:
            raise ValueError(
                f"{where}: field {answer_field!r} has no final '#### <answer>': {_short(answer)}"
            )
        columns["solution"] = answer
        answer = match.group(1).replace(",", "")
    if is_conversation(prompt):
        return Example(prompt=conversation, answer=str(answer).strip(), columns=columns)
    try:
        text = template.format_map({**row, "prompt": prompt})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"task.prompt_template={template!r} cannot be filled from {where}: {e!r}"
        ) from None
    return Example(prompt=text, answer=str(answer).strip(), columns=columns)


def _read_rows(path: str, subset: str | None, split: str) -> list[tuple[str, dict[str, Any]]]:
    """[(where, row)]: where names the file and line (or row) for error messages."""
    file = Path(path).expanduser()
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet", ".csv") or file.exists():
        if not file.is_file():
            raise ValueError(f"task file {path!r} does not exist")
        if suffix == ".jsonl" or (suffix == ".json" and _is_json_lines(file)):
            return _read_jsonl(file)
        if suffix == ".json":
            data = json.loads(file.read_text(encoding="utf-8-sig"))
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a list of objects or JSON lines")
            return [
                (f"{path} row {i + 1}", _as_row(r, f"{path} row {i + 1}"))
                for i, r in enumerate(data)
            ]
        if suffix == ".csv":
            with file.open(encoding="utf-8-sig", newline="") as f:
                # row 1 is the header: data row i is the file's line i + 1
                return [(f"{path} line {i + 2}", dict(r)) for i, r in enumerate(csv.DictReader(f))]
        if suffix == ".parquet":
            dataset = _datasets().load_dataset("parquet", data_files=str(file), split="train")
            return [(f"{path} row {i + 1}", dict(r)) for i, r in enumerate(dataset)]
        raise ValueError(f"task file {path!r}: use .jsonl, .json, .csv or .parquet")
    dataset = _datasets().load_dataset(path, subset, split=split)
    return [(f"{path}[{split}] row {i + 1}", dict(r)) for i, r in enumerate(dataset)]


def _read_jsonl(file: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with file.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{file} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            rows.append((where, _as_row(row, where)))
    return rows


def _is_json_lines(file: Path) -> bool:
    with file.open(encoding="utf-8-sig") as f:
        head = f.read(1).strip() or f.read(64).lstrip()[:1]
    return head == "{"


def _as_row(row: Any, where: str, kind: str = "a JSON object") -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected {kind}, got {type(row).__name__}")
    return row


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "reading .parquet files and dataset ids needs the `datasets` package: "
            "pip install datasets"
        ) from None
    return datasets


def _short(value: Any, width: int = 60) -> str:
    text = str(value)
    return repr(text if len(text) <= width else "..." + text[-width:])
