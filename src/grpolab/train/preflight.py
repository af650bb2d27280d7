"""`grpolab preflight`: every check of the registry (grpolab.checks) on the configured model,
task and engine.

A real rollout batch from the configured task is sampled (a few groups), scored by the
configured rewards, and every check runs on it, plus the checks that need the whole run:
the tokenizer against the task, gradient invariance to the minibatch split and to skipping
rows against a float64 copy of the model, a worst-case-length dry run, probe episodes (with
tools) and the reward probes. `preflight_gate` runs them before training starts and refuses to
start when one fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpolab import seeds
from grpolab.check import CheckResult
from grpolab.checks.context import Context, PreflightBatch, PreflightSettings
from grpolab.checks.episodes import Episodes, probe_episodes
from grpolab.checks.registry import ALL
from grpolab.checks.rewards import unscored_functions
from grpolab.checks.runner import blamed, run_check
from grpolab.config import Config, flatten, load_warnings, objective_of, to_dict
from grpolab.core import CoreFunctions, Objective
from grpolab.model.policy import eval_mode
from grpolab.rewards import score
from grpolab.rollout.advice import sampling_advice
from grpolab.train.monitors import limits_for
from grpolab.train.setup import (
    BatchPlan,
    Run,
    build_run,
    load_inputs,
    load_start_model,
    resolve_device,
    run_precision,
    start_model_source,
)
from grpolab.ways import way

PREFLIGHT_ROWS = 32  # sequences in the preflight batch (whole groups, at least two)


def settings_from_config(cfg: Config, objective: Objective | None = None) -> PreflightSettings:
    """What the checks hold a run to: its objective (`objective`: the run's, built once)."""
    return PreflightSettings(
        objective=objective or objective_of(cfg),
        engine_gap_max=limits_for(cfg.monitors, cfg.model.dtype, run_precision(cfg)).engine_gap,
        precision=run_precision(cfg),
        seed=cfg.seed,
        shared_prefix=cfg.runtime.shared_prefix,
        grad_rows=BatchPlan.of(cfg).micro,  # the trainer's forward + backward rows
        minibatch=BatchPlan.of(cfg).minibatch,  # rows per optimizer step
    )


def sample_batch(run: Run) -> tuple[PreflightBatch, list[str]]:
    """A few real groups from the configured task, sampled and scored as the trainer does.
    Uses its own generators, so the training run's prompt draw is untouched."""
    cfg = run.cfg
    G = cfg.batch.num_generations
    n_prompts = max(2, PREFLIGHT_ROWS // G)
    examples = run.task.sample(n_prompts, seeds.preflight_prompts(cfg.seed))
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed))
    rollout = run.engine.generate([e.prompt for e in examples], G, params)
    scores = score(rollout, examples, run.rewards)
    device = next(run.model.parameters()).device
    batch = PreflightBatch(
        rollout.input_ids.to(device),
        rollout.attention_mask.to(device),
        rollout.completion_mask.to(device),
        scores.total.float(),
        G,
        None if rollout.engine_logprobs is None else rollout.engine_logprobs.to(device),
        unscored_functions(scores),
        tuple(run.engine.stop_ids),
    )
    return batch, rollout.completions


def episodes_of(run: Run) -> Episodes:
    """Probe episodes of the configured engine and tool turns, and the functions checked."""
    cfg = run.cfg
    G = cfg.batch.num_generations
    examples = run.task.sample(max(2, PREFLIGHT_ROWS // G), seeds.preflight_prompts(cfg.seed))
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed))
    params.max_turns = max(params.max_turns or 1, 2)  # room for a tool turn
    batch = probe_episodes(run.engine, [e.prompt for e in examples], G, params)
    return Episodes(batch, run.engine.episodes.functions)


def run_preflight(run: Run, progress=None) -> list[CheckResult]:
    """Every check of the registry on the run's model, its core functions and a real batch,
    in registry order. progress(text): told what each group of checks does as it starts
    (PreflightProgress)."""
    cfg = run.cfg
    say = progress or (lambda doing: None)
    transformers.utils.logging.disable_progress_bar()
    # loss.masked_nan holds grpolab's own loss to NaN in masked slots; a user's loss gets
    # grpolab's inputs, finite under the mask, so masking by multiplication is right there.
    own_loss = run.functions.source.get("grpo_loss", "grpolab") == "grpolab"
    s = dataclasses.replace(settings_from_config(cfg, run.objective), masked_nan=own_loss)
    ctx = Context(run.functions, s, run.model, None, run, say=say)
    results = []
    if not run.task.has_references:  # right and wrong completions come from the references
        say("the reward probes: not run (the task has no reference answers to write right "
            "and wrong completions from)")  # fmt: skip
    with eval_mode(run.model, zero_grad=True):
        for check in ALL:
            if not _ready(ctx, check.stage):
                continue
            if check.when(ctx):
                results.append(run_check(check, ctx))
    return results


def _ready(ctx: Context, stage: str) -> bool:
    """Whether the inputs of `stage` exist, made when its first check comes: the sampled
    batch ("batch"), probe episodes ("episodes": only with tools or an environment)."""
    run, cfg = ctx.run, ctx.run.cfg
    if stage == "batch" and ctx.batch is None:
        G = cfg.batch.num_generations
        ctx.say(f"sampling {max(2, PREFLIGHT_ROWS // G)} prompts x {G} from the task (up to "
                f"{cfg.rollout.episode_budget()} tokens each) and scoring them")  # fmt: skip
        ctx.batch, completions = sample_batch(run)
        for warning in sampling_advice(completions, ctx.batch.rewards,
                                       run.tokenizer.chat_template is not None,
                                       cfg.task.chat_template):  # fmt: skip
            ctx.say(f"warning: {warning}")
        ctx.say(f"the checks of goals 1-7 on the {ctx.batch.input_ids.shape[0]} sampled rows")
        torch.manual_seed(ctx.settings.seed)
    if stage == "episodes" and ctx.episodes is None:
        if run.engine.episodes is None:
            return False
        ctx.say("the episode checks on probe episodes")
        ctx.episodes = episodes_of(run)
    return True


def preflight(
    cfg: Config,
    functions: CoreFunctions | None = None,
    episode_functions=None,
    console: Console | None = None,
) -> list[CheckResult]:
    """`grpolab preflight`: build the configured run (model, engine, task, rewards) and run
    every check on it. `functions`: the table to check (default: the trainer's);
    `episode_functions`: the episode functions to check (a run with tools); `console`: where
    each group of checks is announced as it starts and the task's answer kind is said (None:
    silent)."""
    if cfg.runtime.num_threads:
        torch.set_num_threads(cfg.runtime.num_threads)
    progress = PreflightProgress(console)
    inputs = load_inputs(cfg)  # the task and rewards first: their mistakes in seconds
    source = start_model_source(cfg)
    progress("loading the model")
    torch.manual_seed(cfg.seed)  # as training does: the same LoRA adapters, the same model
    model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device), source)
    run = build_run(cfg, model, tokenizer, functions=functions, inputs=inputs)
    if console is not None:
        console.print(run.task.describe_split())
        console.print(run.task.describe_answers())
    if episode_functions is not None and run.engine.episodes is not None:
        run.engine.episodes.functions = episode_functions
    results = run_preflight(run, progress)
    if all(r.passed for r in results) and episode_functions is None:  # `train` may reuse it
        key = fingerprint(run)
        record = results_json(results, run.functions, load_warnings(cfg), key) + "\n"
        remember_pass(key, record, len(results))
    return results


# --- Showing the results ------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}"
    return str(value)


def results_table(results: list[CheckResult], title: str = "grpolab preflight") -> Table:
    table = Table(title=title, show_lines=False)
    for col in ("check", "goal", "measured", "value", "expected", "result"):
        table.add_column(col, overflow="fold")
    for r in results:
        verdict = "[green]pass" if r.passed else "[bold red]FAIL"
        table.add_row(r.id, str(r.goal or "-"), r.what, _shown(r.measured), r.expected, verdict)
    return table


def print_results(results: list[CheckResult], console: Console, impl: CoreFunctions) -> None:
    replaced = [f for f, src in impl.source.items() if src != "grpolab"]
    title = "grpolab preflight" + (f" of {impl.path} ({', '.join(replaced)})" if impl.path else "")
    console.print(results_table(results, title))
    for r in blamed(results):  # the likely cause first
        detail = escape(f"{r.id}: {r.error or r.what} = {_shown(r.measured)}")
        console.print(f"[red]FAIL[/red] {detail}")
        if r.hint:
            console.print(f"     likely bug: {escape(r.hint)}")
    n_failed = sum(not r.passed for r in results)
    verdict = "[green]all checks pass" if not n_failed else f"[red]{n_failed} check(s) failed"
    console.print(f"{verdict} ({len(results)} checks)")


def results_json(
    results: list[CheckResult],
    impl: CoreFunctions,
    config_warnings: list[str] | None = None,
    fingerprint: str | None = None,
) -> str:
    """preflight.json: the verdict, whose functions were checked, each check's result, the
    keys given that have no effect under the rest of the config, and the fingerprint of what
    was checked (a later run with the same one reuses a pass)."""
    return json.dumps(
        {
            "passed": all(r.passed for r in results),
            "impl": impl.path,
            "replaced": [f for f, src in impl.source.items() if src != "grpolab"],
            "config_warnings": config_warnings or [],
            "fingerprint": fingerprint,
            "checks": [r.to_json() for r in results],
        },
        indent=2,
    )


class PreflightFailed(RuntimeError):
    """A preflight check failed: training does not start."""


def skip_warning() -> str:
    return (
        f"preflight skipped ({way('skip_preflight')}): the intermediate quantities of this run "
        "were not checked before training"
    )


def preflight_gate(run: Run, console: Console, skip: bool = False, recheck: bool = False) -> str:
    """Run every check on the run's model, core functions and a real batch before step 1,
    printing each group as it starts; returns preflight.json's text for the run directory.
    A passing preflight of the same fingerprint (`fingerprint`: what the checks read) is
    reused, said in one line, unless `recheck`. Raises PreflightFailed if a check fails, with
    the results written to a file of their own (the run directory is left as it was). The
    global RNG state is left as found, so a resumed run stays bit-exact."""
    if skip:
        warning = skip_warning()
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")
        return json.dumps({"skipped": True, "warning": warning}, indent=2) + "\n"
    key = fingerprint(run)
    passed = None if recheck else passed_before(key)
    if passed is not None:
        console.print(
            f"preflight: reusing the pass of {passed['when']} ({passed['checks']} checks; the "
            f"same model weights, tokenizer, objective, functions, task, engine and precision, "
            f"fingerprint {key}); {way('recheck')} runs it again"
        )
        return passed["record"]
    progress = PreflightProgress(console)
    device = next(run.model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        results = run_preflight(run, progress)
    record = results_json(results, run.functions, load_warnings(run.cfg), key) + "\n"
    failed = blamed(results)  # the likely cause first
    if failed:
        print_results(results, console, run.functions)
        fd, details = tempfile.mkstemp(prefix="grpolab-preflight-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(record)
        ids = ", ".join(r.id for r in failed)
        raise PreflightFailed(
            f"preflight: {len(failed)} of {len(results)} checks failed ({ids}); training did not "
            f"start and output_dir={run.cfg.output_dir} is as it was. Details in {details}; "
            f"{way('skip_preflight')} overrides"
        )
    console.print(f"preflight: all {len(results)} checks pass ({progress.elapsed():.1f} s)")
    remember_pass(key, record, len(results))
    return record


# --- A passing preflight, remembered ------------------------------------------------------------

PREFLIGHT_CACHE_ENV = "GRPOLAB_PREFLIGHT_CACHE"  # where passes are kept (a directory)
# Config keys that change nothing the checks read: where a run writes, how long it runs, what
# it logs and evaluates, whether inert keys are refused.
NOT_CHECKED = ("output_dir", "max_steps", "strict", "logging.", "checkpoints.", "eval.")
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def preflight_cache_dir() -> Path:
    """$GRPOLAB_PREFLIGHT_CACHE, else grpolab's cache ($XDG_CACHE_HOME or ~/.cache)/preflight."""
    if os.environ.get(PREFLIGHT_CACHE_ENV):
        return Path(os.environ[PREFLIGHT_CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpolab" / "preflight"


def fingerprint(run: Run) -> str:
    """What the preflight's verdict depends on, hashed: the config's keys the checks read,
    the precision, every weight of the policy (and the reference), the tokenizer, the source
    of the core and reward functions, the task's rows, grpolab's own code and the versions
    of torch and transformers. Equal fingerprints: the same checks on the same inputs."""
    h = hashlib.sha256()

    def part(label: str, data: bytes | str) -> None:
        h.update(label.encode() + b"\0" + (data.encode() if isinstance(data, str) else data))

    config = {k: v for k, v in flatten(to_dict(run.cfg)).items() if not k.startswith(NOT_CHECKED)}
    part("config", json.dumps(config, sort_keys=True, default=str))
    part("precision", f"{run.precision.name} {torch.__version__} {transformers.__version__}")
    for owner, model in (("policy", run.model), ("reference", run.ref_model)):
        for name, tensor in (model.state_dict() if model is not None else {}).items():
            part(f"{owner}.{name}", tensor_bytes(tensor))
    part("tokenizer", tokenizer_text(run.tokenizer))
    functions = [getattr(run.functions, f) for f in run.functions.source]
    for fn in [*functions, *(r.fn for r in run.rewards)]:
        part("function", source_text(fn))
    for e in run.task.train + run.task.eval:
        part("row", f"{e.prompt!s}\0{e.answer}")
    for file in sorted(PACKAGE_DIR.rglob("*.py")):
        part(str(file.relative_to(PACKAGE_DIR)), file.read_bytes())
    return h.hexdigest()[:16]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def tokenizer_text(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab())
    return f"{vocabulary}\0{tokenizer.chat_template}\0{tokenizer.special_tokens_map}"


def source_text(fn) -> str:
    """A function's source (its code's bytes where the source cannot be read)."""
    fn = inspect.unwrap(fn)
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return repr(code.co_code) if code is not None else repr(fn)


def passed_before(key: str) -> dict | None:
    """The remembered pass of fingerprint `key` (when, how many checks, preflight.json's
    text), or None."""
    try:
        return json.loads((preflight_cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def remember_pass(key: str, record: str, checks: int) -> None:
    """Keep a passing preflight under its fingerprint (best effort: an unwritable cache only
    means the next run checks again)."""
    entry = {"when": time.strftime("%Y-%m-%d %H:%M"), "checks": checks, "record": record}
    try:
        folder = preflight_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass


class PreflightProgress:
    """One line per group of checks as it starts, with the time since the first: a
    preflight on a real model takes minutes."""

    def __init__(self, console: Console | None):
        self.console = console
        self.tic = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.tic

    def __call__(self, doing: str) -> None:
        if self.console is not None:
            self.console.print(f"preflight {self.elapsed():6.1f} s  {escape(doing)}")


def write_results(results: list[CheckResult], path: Path, impl: CoreFunctions) -> None:
    path.write_text(results_json(results, impl) + "\n")
