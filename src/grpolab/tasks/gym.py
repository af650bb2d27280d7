"""reasoning-gym task suites: problems from any of reasoning-gym's procedural generators
(`pip install grpolab[gym]`), judged by the generator's own `score_answer`.

    task.name: reasoning_gym
    task.dataset: chain_sum                      # one generator, by its registered name
    task.dataset_config: {min_terms: 3}          # its parameters (its config dataclass's)
    task.dataset:                                # or several, drawn with weights
      - {name: chain_sum, weight: 2, config: {min_terms: 3}}
      - basic_arithmetic                         # weight 1, default parameters

The prompt is the generator's question (task.prompt_template: "{prompt}" and the problem's
metadata fields, e.g. "{expression} =" for chain_sum). Problems are drawn by reasoning-gym
from task.seed: the first task.num_eval are held out, the training rows follow
(task.num_train of them; 0: GYM_DEFAULT_TRAIN), a training problem whose question is a
held-out one left out. The final answer of a completion (`final_answer`) is the
last <answer>...</answer> (reasoning-gym's convention), else the last \\boxed{...}, else the
line after the last "####", else what follows the last "answer is" / "answer:" on its line,
else the whole completion; the generator's `score_answer` scores it against the row's entry
(the `gym_score` reward), and a score of 1 is the task's strict judge (`Task.strict_judge`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from grpolab.tasks.base import GENERATED_NUM_EVAL, Example, Task, TaskConfig
from grpolab.tasks.strict import ANSWER_IS, ANSWER_TAGS, last_boxed

GYM_DEFAULT_TRAIN = 10_000  # training problems generated when task.num_train is 0
INSTALL = "pip install 'grpolab[gym]' (reasoning-gym)"

Scorer = Callable[[str | None, dict[str, Any]], float]


def reasoning_gym():
    """The reasoning_gym module, or a one-line error saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"task.name='reasoning_gym' needs reasoning-gym: {INSTALL}") from None
    return reasoning_gym


def generator_names() -> list[str]:
    """Every generator reasoning-gym registers."""
    reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    weight: float
    config: dict[str, Any]


def specs(cfg: TaskConfig) -> list[Spec]:
    """task.dataset (and task.dataset_config) read as generators, each checked: a one-line
    error naming the key and what was expected."""
    given = cfg.dataset
    if isinstance(given, str):
        return [_checked(given, 1.0, cfg.dataset_config, "task.dataset", "task.dataset_config")]
    if not isinstance(given, list | tuple) or not given:
        raise ValueError(
            f"task.dataset={given!r}: expected a reasoning-gym generator name (chain_sum) or a "
            "list of them, each a name or {name: ..., weight: ..., config: {...}}"
        )
    out = []
    for i, item in enumerate(given):
        where = f"task.dataset[{i}]"
        if isinstance(item, str):
            out.append(_checked(item, 1.0, None, where, f"{where}.config"))
            continue
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(
                f"{where}={item!r}: expected a generator name or {{name: ..., weight: ..., "
                "config: {...}}"
            )
        unknown = set(item) - {"name", "weight", "config"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}: expected name, "
                             "weight, config")  # fmt: skip
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ValueError(f"{where}.weight={weight!r}: expected a number > 0")
        out.append(_checked(item["name"], float(weight), item.get("config"), where,
                            f"{where}.config"))  # fmt: skip
    names = [s.name for s in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"task.dataset names {twice} more than once: give each generator once")
    return out


def _checked(name: str, weight: float, config: Any, where: str, config_key: str) -> Spec:
    """One generator: its name registered and its parameters accepted by its config class."""
    reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{where}={name!r} is not a reasoning-gym generator: {hint}({len(DATASETS)} "
            "generators, reasoning_gym.factory.DATASETS)"
        )
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"{config_key}={config!r}: expected a mapping of {name}'s parameters")
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1])]
    fields = [f for f in fields if f not in ("seed", "size")]
    bad = [k for k in config if k not in fields]
    if bad:
        raise ValueError(f"{config_key}: {name} has no parameter {bad[0]!r}; its parameters: "
                         f"{', '.join(fields)}")  # fmt: skip
    try:
        DATASETS[name][1](**config).validate()
    except AttributeError:
        pass  # a config without validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"{config_key}={config!r}: {name} refuses it ({e or 'invalid'})") from None
    return Spec(name, weight, dict(config))


def build_dataset(cfg: TaskConfig, size: int):
    """The reasoning-gym dataset of `size` problems drawn from task.seed: one generator, or a
    composite drawing each problem's generator by weight."""
    rg = reasoning_gym()
    chosen = specs(cfg)
    if isinstance(cfg.dataset, str):
        return rg.create_dataset(chosen[0].name, **chosen[0].config, seed=cfg.seed, size=size)
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    parts = [DatasetSpec(s.name, s.weight, s.config) for s in chosen]
    return CompositeDataset(CompositeConfig(size=size, seed=cfg.seed, datasets=parts))


def load_gym(cfg: TaskConfig) -> Task:
    """Held-out problems first, then the training ones, none repeating a held-out question."""
    if cfg.num_eval is None:
        cfg = dataclasses.replace(cfg, num_eval=GENERATED_NUM_EVAL)
    for name in ("num_eval", "num_train"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"task.{name}={value!r}: expected an int >= 0")
    template = cfg.prompt_template or "{prompt}"
    n_train = cfg.num_train or GYM_DEFAULT_TRAIN
    dataset = build_dataset(cfg, cfg.num_eval + n_train)
    entries = [dataset[i] for i in range(len(dataset))]
    held, seen = [], set()
    for entry in entries[: cfg.num_eval]:
        if entry["question"] not in seen:
            seen.add(entry["question"])
            held.append(entry)
    train = [e for e in entries[cfg.num_eval :] if e["question"] not in seen]
    if not train:
        raise ValueError(
            f"task.num_eval={cfg.num_eval} leaves no training problems of task.dataset="
            f"{cfg.dataset!r}: lower it or raise task.num_train"
        )
    task = Task(
        name="reasoning_gym",
        train=[_example(e, template) for e in train],
        eval=[_example(e, template) for e in held],
        config=cfg,
    )
    task.split_reason = (
        f"{len(held)} held-out problems drawn first by task.seed={cfg.seed}, training problems "
        f"repeating a held-out question left out ({len(entries) - cfg.num_eval - len(train)})"
    )
    scorer = dataset.score_answer
    task.score_answer = scorer
    task.strict_judge = lambda completion, example: score(scorer, completion, example) >= 1.0
    return task


def _example(entry: dict[str, Any], template: str) -> Example:
    """A row: the prompt is task.prompt_template filled with {prompt} (the question) and the
    entry's metadata fields ("{expression} =" for chain_sum)."""
    fields = {k: v for k, v in entry["metadata"].items() if isinstance(k, str)}
    try:
        prompt = template.format_map(fields | {"prompt": entry["question"]})
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        source = entry["metadata"].get("source_dataset", "the generator")
        raise ValueError(
            f"task.prompt_template={template!r}: {source}'s problems fill {{prompt}} and their "
            f"metadata fields {sorted(fields)}, not {e!s}"
        ) from None
    columns = {"question": entry["question"], "metadata": entry["metadata"]}
    return Example(prompt=prompt, answer=str(entry["answer"]), columns=columns)


def final_answer(completion: str) -> str | None:
    """The completion's final answer as written (the module docstring), None when empty."""
    tagged = ANSWER_TAGS.findall(completion)
    if tagged:
        span = tagged[-1]
    elif (boxed := last_boxed(completion)) is not None:
        span = boxed
    elif "####" in completion:
        span = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    elif said := [m.end() for m in ANSWER_IS.finditer(completion)]:
        span = completion[said[-1] :].strip().split("\n", 1)[0].rstrip(".")
    else:
        span = completion
    span = span.strip()
    return span or None


def entry_of(example: Example) -> dict[str, Any]:
    """The reasoning-gym entry a row was made from: what score_answer reads."""
    question = example.columns.get("question", example.prompt)
    metadata = example.columns.get("metadata") or {}
    return {"question": question, "answer": example.answer, "metadata": metadata}


def score(scorer: Scorer, completion: str, example: Example) -> float:
    """The generator's score of the completion's final answer (0 when it gives none)."""
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    return float(scorer(answer, entry_of(example)))


def scorer_by_source() -> Scorer:
    """score_answer of each row's own generator (its metadata's source_dataset), in its
    default configuration: for rewards built without the loaded task."""
    reasoning_gym()
    from reasoning_gym import get_score_answer_fn

    cache: dict[str, Scorer] = {}

    def score_answer(answer: str | None, entry: dict[str, Any]) -> float:
        name = entry["metadata"].get("source_dataset")
        if name not in cache:
            cache[name] = get_score_answer_fn(name)
        return cache[name](answer, entry)

    return score_answer
