"""The training loop: set up, check, train, finish.

    session = start(cfg, ...)      # device, ranks, run directory, model, run, resume
    gate(session, ...)             # the preflight on this model and a real batch
    commit(session)                # only now is the run directory written
    steps(session)                 # grpo_step, monitors, evaluation, logs, checkpoints
    finish(session)                # last checkpoint, held-out accuracy, summary.json

Each step is `grpolab.train.step.grpo_step`; what it computes is documented there.
"""

from __future__ import annotations

import json
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape

from grpolab import core
from grpolab.config import (
    Config,
    MonitorsConfig,
    differences_from_defaults,
    load_notes,
    load_warnings,
    replaced,
    to_dict,
    to_yaml,
)
from grpolab.core import CoreFunctions
from grpolab.model import dist as dist_module
from grpolab.model.memory import fix_malloc_thresholds, release_freed_memory
from grpolab.rewards.probes import reward_scale
from grpolab.tasks import load_task
from grpolab.train.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    restore,
    resume_config_changes,
    resume_point,
    save_run,
    set_aside,
)
from grpolab.train.evaluate import accuracy_rewards, evaluate_greedy, evaluate_pass_at_k
from grpolab.train.monitors import (
    MonitorLimits,
    MonitorStop,
    NonFiniteError,
    RewardDivergence,
    check_step,
    count_nonfinite,
    limits_for,
    write_capsule,
    zeroed_step,
)
from grpolab.train.preflight import preflight_gate
from grpolab.train.rundir import OutputDirError, RunLock, claim_output_dir, prepare_output_dir
from grpolab.train.setup import (
    Run,
    build_run,
    check_context_fits,
    load_inputs,
    load_start_model,
    old_logprobs_from_loss_forward,
    resolve_device,
    start_model_source,
    task_engine,
)
from grpolab.train.step import StepBatch, grpo_step
from grpolab.train.tracking import Tracker, check_trackers, progress_bar
from grpolab.ways import way


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM stopped the run; the message says what was saved."""


class RewardsFailing(RuntimeError):
    """A reward function failed on every sample of monitors.max_consecutive_reward_failures
    steps in a row: the run stopped with a checkpoint; the message names it and its error."""


@dataclass(frozen=True)
class LoopSettings:
    """What the loop's inner parts (the steps, the monitors, the logging, the evaluation)
    read of the config, built once at the start (`LoopSettings.of`)."""

    max_steps: int
    progress_bar: bool
    logging_steps: int
    log_completions_steps: int
    log_completions_count: int
    save_steps: int
    eval_steps: int
    eval_examples: int
    eval_length: int  # the held-out completions' length budget
    eval_batch_size: int
    monitors: MonitorsConfig  # its thresholds, action and stop counts
    limits: MonitorLimits  # the per-step limits under the run's dtype and precision

    @classmethod
    def of(cls, cfg: Config, precision) -> LoopSettings:
        e, log = cfg.eval, cfg.logging
        return cls(
            max_steps=cfg.max_steps,
            progress_bar=log.progress,
            logging_steps=log.logging_steps,
            log_completions_steps=log.log_completions_steps,
            log_completions_count=log.log_completions_count,
            save_steps=cfg.checkpoints.save_steps,
            eval_steps=e.eval_steps,
            eval_examples=e.eval_examples,
            eval_length=e.eval_max_completion_length or cfg.rollout.max_completion_length,
            eval_batch_size=cfg.eval_batch_size,
            monitors=cfg.monitors,
            limits=limits_for(cfg.monitors, cfg.model.dtype, precision),
        )


@dataclass
class Session:
    """A run in progress, and where it writes."""

    run: Run
    run_dir: Path  # checkpoints (rank 0 writes them)
    log_dir: Path  # config, metrics, summary: run_dir on rank 0, a scratch directory elsewhere
    console: Console
    start_step: int
    resume_dir: Path | None
    loop: LoopSettings
    # The loop's own state, kept in checkpoints: accuracy_before, eval_history,
    # wall_seconds (of the runs before a resume), config_changes.
    progress: dict[str, Any] = field(default_factory=dict)
    wall_start: float = field(default_factory=time.time)
    tracker: Tracker | None = None
    divergence: RewardDivergence | None = None  # the reward against the strict accuracy
    step: int = 0  # the last step taken
    overwrite: bool = False
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # passed over by the resume
    # What the start writes into the run directory (name -> text), held until `commit`: a
    # start that fails or is interrupted leaves the directory as it was.
    staged: dict[str, str] = field(default_factory=dict)
    # Called as listener(event, session, data) at "train_begin", "step" (step, metrics),
    # "save" (step, path) and "train_end" (summary); one that sets `stop` (on any rank) ends
    # the run after the step, finished as at max_steps (the last checkpoint, the evaluation,
    # the summary).
    listeners: list[Callable[[str, Session, dict], None]] = field(default_factory=list)
    stop: bool = False

    def wall_seconds(self) -> float:
        return self.progress.get("wall_seconds", 0.0) + time.time() - self.wall_start

    def emit(self, event: str, **data: Any) -> None:
        for listener in self.listeners:
            listener(event, self, data)


@dataclass
class Stage:
    """What the start is doing, for the line a Ctrl-C prints, and the run directory's lock
    once taken (released when the run ends, however it ends)."""

    doing: str = "starting"
    lock: RunLock | None = None


def train(
    cfg: Config,
    resume: str | bool | None = None,
    overwrite: bool = False,
    functions: CoreFunctions | None = None,
    console: Console | None = None,
    skip_preflight: bool = False,
    allow_config_change: bool = False,
    recheck: bool = False,
    listeners: Sequence[Callable[[str, Session, dict], None]] = (),
) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary (also written to summary.json).

    The preflight checks run first, on this model and a real batch, and training refuses to
    start if one fails (PreflightFailed) unless `skip_preflight`; a pass of the same
    fingerprint (an earlier `train` or `grpolab preflight`) is reused unless `recheck`. A
    resume whose config changes what is trained is refused unless `allow_config_change`.
    `functions`: the core functions to train with (a user's, `--impl`); default grpolab's,
    as configured. Nothing is written into the run directory before the first step
    (`commit`): a start that fails or is interrupted (Interrupted) leaves it as it was.
    `listeners`: called at the loop's events (Session.listeners)."""
    stage = Stage()
    try:
        try:
            session = start(cfg, resume, overwrite, functions, console, allow_config_change, stage)
            session.listeners = list(listeners)
            gate(session, skip_preflight, stage, recheck)
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted while {stage.doing}, before training started; nothing was written "
                f"(output_dir={cfg.output_dir} is as it was)"
            ) from None
        commit(session)
        steps(session)
        return finish(session)
    finally:
        if stage.lock is not None:
            stage.lock.release()


# --- Set up ------------------------------------------------------------------------------------


def start(
    cfg: Config,
    resume: str | bool | None,
    overwrite: bool,
    functions: CoreFunctions | None,
    console: Console | None,
    allow_config_change: bool,
    stage: Stage | None = None,
) -> Session:
    """Everything before the first step that writes nothing: the run directory, the
    checkpoint to resume and the config against the checkpoint's are checked first."""
    stage = stage or Stage()
    wall_start = time.time()
    console = console or wide_console()
    transformers.utils.logging.disable_progress_bar()
    fix_malloc_thresholds()  # big buffers reused from the heap, not faulted in each time
    if cfg.runtime.num_threads:
        torch.set_num_threads(cfg.runtime.num_threads)
    device = dist_module.local_device(resolve_device(cfg.model.device))
    # Under torchrun: one process per rank; only rank 0 writes the run directory (the others
    # log to a scratch directory), and every rank runs the same loop.
    d = dist_module.init(cfg.parallel.strategy, device)
    if not d.main:
        console = Console(quiet=True)
    named = cfg.output_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    # Every rank names rank 0's directory ({time} may differ between processes).
    cfg = replaced(cfg, {"output_dir": dist_module.all_gather_objects(named, d)[0]})
    run_dir = Path(cfg.output_dir)
    stage.lock = claim(run_dir, bool(resume), overwrite, d)
    if stage.lock is not None and stage.lock.stale_note:
        console.print(f"note: {escape(stage.lock.stale_note)}")
    resume_dir, damaged = None, []
    if resume:
        resume_dir, damaged = resume_point(run_dir, None if resume is True else resume)
        check_steps_left(cfg, resume_dir)

    stage.doing = "reading the task and the rewards"
    inputs = load_inputs(cfg)  # everything knowable before the model, in the first seconds
    check_trackers(cfg.logging.report_to)
    source = start_model_source(cfg)
    stage.doing = "loading the model"
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_start_model(cfg, device, source)
    run = build_run(cfg, model, tokenizer, device, functions, d, inputs)
    start_step, progress, changes = 0, {}, []
    if resume_dir is not None:
        stage.doing = f"restoring {resume_dir}"
        changes = resume_config_changes(cfg, resume_dir, run_dir, allow_config_change)
        start_step, progress = restore(run, resume_dir)
        console.print(f"resuming from {resume_dir} at step {start_step}")
    if changes:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changes)
        console.print(f"[yellow]config changed on resume (applied):[/yellow] {escape(listed)}")
        progress.setdefault("config_changes", []).append(
            {"step": start_step, "changes": {k: [old, new] for k, old, new in changes}}
        )
    log_dir = run_dir if d.main else Path(tempfile.mkdtemp(prefix=f"grpolab-rank{d.rank}-"))
    progress = {k: progress[k] for k in PROGRESS_KEYS if k in progress}
    loop = LoopSettings.of(cfg, run.precision)
    return Session(run, run_dir, log_dir, console, start_step, resume_dir, loop, progress,
                   wall_start, overwrite=overwrite, damaged=damaged)  # fmt: skip


def claim(run_dir: Path, resume: bool, overwrite: bool, d) -> RunLock | None:
    """The run directory checked and locked by rank 0 (every rank raises its refusal)."""
    lock, refused = None, None
    if d.main:
        try:
            lock = claim_output_dir(run_dir, resume, overwrite)
        except (OutputDirError, FileExistsError) as e:
            refused = e
    refused = dist_module.all_gather_objects(refused, d)[0]
    if refused is not None:
        raise refused
    return lock


def check_steps_left(cfg: Config, resume_dir: Path) -> None:
    """A resume with max_steps below the checkpoint's step would train nothing."""
    step = checkpoint_step(resume_dir)
    if step is not None and cfg.max_steps < step:
        raise ValueError(
            f"max_steps={cfg.max_steps} is below the step of the checkpoint to resume "
            f"({resume_dir}, step {step}): set max_steps above {step} to train further"
        )


# The loop's state that checkpoints keep (besides the run's).
PROGRESS_KEYS = (
    "accuracy_before",
    "strict_accuracy_before",
    "eval_history",
    "wall_seconds",
    "config_changes",
    "reward_failure_streak",  # {function: steps in a row it failed on every sample}
)


def gate(
    session: Session, skip_preflight: bool, stage: Stage | None = None, recheck: bool = False
) -> None:
    """Print the resolved config and objective (staged for the run directory), run the
    preflight, and measure the held-out accuracy before training."""
    stage = stage or Stage()
    run, console = session.run, session.console
    cfg = run.cfg
    card = core.objective_card(run.objective)
    if old_logprobs_from_loss_forward(cfg, run.plan):
        card += (
            "\n  (one optimizer step per batch: logp_old is the loss forward's own detached"
            " log-probs, exact, no extra pass)"
        )
    card += f"\n  precision     {run.precision.name} ({run.precision.reason})"
    card += "".join(f"\n  note: {note}" for note in load_notes(cfg))
    card += "".join(f"\n  warning: {warning}" for warning in load_warnings(cfg))
    for warning in load_warnings(cfg):  # keys given that change nothing: said, not fatal
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    session.staged |= {"config.yaml": to_yaml(cfg), "objective.txt": card + "\n"}
    console.print(config_summary(cfg, session.run_dir), soft_wrap=True)  # a path kept whole
    console.print(escape(card))
    console.print(run.task.describe_split())
    console.print(run.task.describe_answers())
    sharded = dist_module.is_sharded(run.model)
    if sharded and not skip_preflight:  # its probes deep-copy the model, which FSDP2 refuses
        console.print(
            "preflight: not run under parallel.strategy=fsdp; `grpolab preflight` with this "
            "config checks the same quantities on one process"
        )
    stage.doing = "running the preflight"
    record = preflight_gate(run, console, skip=skip_preflight or sharded, recheck=recheck)
    session.staged["preflight.json"] = record
    release_freed_memory()  # the preflight's copies and full-vocabulary logits
    if session.resume_dir is None:
        stage.doing = "measuring the held-out accuracy before training"
        before, strict_before = held_out_accuracy(session, "before GRPO")
        session.progress |= {"accuracy_before": before, "strict_accuracy_before": strict_before}
    session.progress.setdefault("eval_history", [])
    scale = reward_scale(run.task, run.rewards, run.tokenizer)  # wrong vs right total reward
    session.divergence = RewardDivergence(
        limits_for(cfg.monitors, cfg.model.dtype, run.precision), scale
    )


def config_summary(cfg: Config, run_dir: Path) -> str:
    """What the console shows of the config: the values that differ from the defaults (the
    run directory's config.yaml holds every value)."""
    changed = differences_from_defaults(cfg)
    lines = [f"  {key} = {value!r}" for key, value in changed if key != "output_dir"]
    head = f"config: the defaults, except ({run_dir / 'config.yaml'} holds every value):"
    if not lines:
        head = f"config: the defaults ({run_dir / 'config.yaml'} holds every value)"
    return escape("\n".join([head, *lines]))


def commit(session: Session) -> None:
    """Training starts: the run directory is prepared (a replaced run deleted, leftovers of
    a save cut short removed, damaged checkpoints set aside), the staged files written and
    the logs opened."""
    run, console, run_dir = session.run, session.console, session.run_dir
    resume = session.resume_dir is not None
    if run.dist.main:
        for note in prepare_output_dir(run_dir, resume, session.overwrite):
            console.print(f"note: {escape(note)}")
        for path, why in session.damaged:  # out of the listing, kept for a look
            console.print(
                f"[yellow]warning:[/yellow] {path} is damaged ({escape(why)}): resumed from "
                f"{session.resume_dir.name} instead; the damaged one is now "
                f"{set_aside(path).name}"
            )
    dist_module.barrier(run.dist)
    for name, text in session.staged.items():
        (session.log_dir / name).write_text(text)
    session.tracker = Tracker(
        session.log_dir, run.cfg.logging.report_to, to_dict(run.cfg), console,
        resume_step=session.start_step,
    )  # fmt: skip


# --- The steps ---------------------------------------------------------------------------------


def steps(session: Session) -> None:
    """grpo_step from the start step to max_steps, each watched, logged and (every
    save_steps) checkpointed. Stops with a checkpoint on a monitor (monitors.action=stop),
    on too many non-finite steps in a row, or on Ctrl-C / SIGTERM."""
    run, loop = session.run, session.loop
    session.step = session.start_step
    with (
        progress_bar(session.console, loop.progress_bar) as bar,
        StopRequests(bar.console) as stop,
    ):
        bar_task = bar.add_task("grpo", total=loop.max_steps, completed=session.start_step, info="")
        session.emit("train_begin")
        for step in range(session.start_step + 1, loop.max_steps + 1):
            try:
                metrics, batch = grpo_step(run, step)
            except KeyboardInterrupt:  # a second Ctrl-C: the step is incomplete, not saved
                session.tracker.close()
                raise Interrupted(
                    f"interrupted during step {step}; it was not saved. "
                    f"{last_checkpoint_note(session.run_dir)}"
                ) from None
            session.step = step
            warnings = watch(session, step, metrics, batch, bar.console)
            failing = count_reward_failures(session, batch)
            record(session, step, metrics, batch)
            session.emit("step", step=step, metrics=metrics)
            bar.update(bar_task, completed=step, info=f"reward {metrics['reward/mean']:.3f}")
            first = step == session.start_step + 1
            if first or step % loop.logging_steps == 0 or metrics["skipped"] or failing:
                bar.console.print(session.tracker.console_line(step, loop.max_steps, metrics))
            if first and abs(metrics["loss"]) < ZERO_LOSS:
                bar.console.print(f"note: {ZERO_LOSS_NOTE}")
            stop_if_unhealthy(session, step, warnings, batch, zeroed_step(step, metrics))
            if dist_module.any_rank(stop.requested, run.dist):
                path = save(session, step)
                session.tracker.close()
                raise Interrupted(
                    f"stopped after step {step} ({stop.signal_name}); checkpoint {path}; "
                    f"continue with {continue_command(session.run_dir)}"
                )
            session.stop = dist_module.any_rank(session.stop, run.dist)  # every rank stops
            every = loop.save_steps
            if every and step % every == 0 and step < loop.max_steps and not session.stop:
                save(session, step)
            if session.stop:
                break


# A loss this close to 0 on the first step is GRPO's own: on-policy the ratio is 1, and the
# advantages are centred in each group, so the surrogate's value is their mean, about 0.
ZERO_LOSS = 1e-4
ZERO_LOSS_NOTE = (
    "a loss of ~0 is expected: the ratio is 1 before the update and the advantages are centred "
    "in each group, so the loss's value is about 0 while its gradient (gnorm) is not; the "
    "reward and the accuracy show the learning"
)


def watch(session: Session, step: int, metrics: dict, batch: StepBatch, console) -> list[str]:
    """The monitors' warnings for this step (printed, and kept in its metrics); the
    non-finite guard's counters."""
    run, m = session.run, session.loop.monitors
    count_nonfinite(run, metrics["skipped"])
    metrics["skipped_steps"] = run.skipped_steps
    if m.action == "off":
        return []
    trainer_logp_old = run.objective.on_policy
    watched = metrics | {"nonfinite": batch.nonfinite}
    warnings = check_step(step, watched, session.loop.limits, trainer_logp_old)
    gaps, diverging = session.divergence.update(step, metrics)  # the reward running ahead
    metrics |= gaps
    warnings += diverging
    if warnings:
        metrics["warnings"] = warnings
        for w in warnings:
            console.print(f"[yellow]monitor:[/yellow] {escape(w)}")
    return warnings


def count_reward_failures(session: Session, batch: StepBatch) -> list[str]:
    """Each reward function's streak of steps on which it failed on every sample (of every
    rank); returns the functions that did on this step."""
    run = session.run
    streaks = session.progress.setdefault("reward_failure_streak", {})
    failing = []
    for fn in run.rewards:
        everywhere = batch.scores.errors.get(fn.name, 0) >= batch.scores.samples
        everywhere = not dist_module.any_rank(not everywhere, run.dist)
        streaks[fn.name] = streaks.get(fn.name, 0) + 1 if everywhere else 0
        if everywhere:
            failing.append(fn.name)
    return failing


def record(session: Session, step: int, metrics: dict, batch: StepBatch) -> None:
    """Held-out accuracy every eval_steps, metrics.jsonl, sample completions."""
    loop = session.loop
    if loop.eval_steps and step % loop.eval_steps == 0 and step < loop.max_steps:
        accuracy, strict = held_out_accuracy(session, f"at step {step}")
        metrics["eval_accuracy"], metrics["eval_strict_accuracy"] = accuracy, strict
        session.progress["eval_history"].append([step, metrics["eval_accuracy"]])
    session.tracker.log(step, metrics)
    every = loop.log_completions_steps
    if every and (step == 1 or step % every == 0):
        session.tracker.log_completions(step, batch.samples(loop.log_completions_count))


def stop_if_unhealthy(
    session: Session, step: int, warnings: list[str], batch: StepBatch, zeroed: str | None = None
):
    """monitors.action=stop with a warning, a step whose every importance weight was dropped
    (`zeroed`, whatever the action), or max_consecutive_nonfinite skipped steps in a row:
    save, write the replay capsule (non-finite), raise."""
    run, m = session.run, session.loop.monitors
    if zeroed:
        path = save(session, step)
        session.tracker.close()
        raise MonitorStop(f"stopped at {zeroed}; checkpoint {path}")
    if warnings and m.action == "stop":
        path = save(session, step)
        session.tracker.close()
        raise MonitorStop(
            f"stopped at step {step} (monitors.action=stop): {warnings[0]}; checkpoint {path}"
        )
    streaks = session.progress.get("reward_failure_streak", {})
    failed = [name for name, n in streaks.items() if n >= m.max_consecutive_reward_failures]
    if failed:
        path = save(session, step)
        session.tracker.close()
        fn = next(fn for fn in run.rewards if fn.name == failed[0])
        raise RewardsFailing(
            f"stopped at step {step}: reward {fn.name!r} failed on every sample of the last "
            f"{streaks[fn.name]} steps (monitors.max_consecutive_reward_failures="
            f"{m.max_consecutive_reward_failures}); its last error: {fn.last_error}; "
            f"checkpoint {path}"
        )
    if run.consecutive_nonfinite >= m.max_consecutive_nonfinite:
        path = save(session, step)
        capsule = session.log_dir / "nonfinite-capsule.pt"
        write_capsule(capsule, run, batch, batch.nonfinite)
        session.tracker.close()
        raise NonFiniteError(
            f"stopped at step {step}: {run.consecutive_nonfinite} consecutive steps with a "
            f"non-finite value, first {batch.nonfinite}; weights unchanged since the last "
            f"good step, saved to {path}; replay capsule {capsule}"
        )


def save(session: Session, step: int) -> Path:
    progress = session.progress | {"wall_seconds": session.wall_seconds()}
    progress.setdefault("config_changes", [])
    path = save_run(session.run, session.run_dir, step, progress)
    session.emit("save", step=step, path=path)
    return path


def held_out_accuracy(session: Session, label: str) -> tuple[float | None, float | None]:
    """(accuracy, strict accuracy), greedy, in percent on the task's held-out problems (None
    when there are none or eval.eval_examples=0)."""
    run, loop = session.run, session.loop
    if loop.eval_examples == 0 or not run.task.eval:
        return None, None
    examples = run.task.eval[: loop.eval_examples]
    run.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: not held meanwhile
    progress = EvalProgress(session.console, f"held-out accuracy {label}", len(examples))
    # Batches of a training rollout's size: no larger a KV cache than training needs.
    held_out = evaluate_greedy(
        run.engine,
        examples,
        run.accuracy,
        loop.eval_length,
        loop.eval_batch_size,
        run.task.answer_kind,
        on_batch=progress,
        judge=run.task.strict_judge,
    )
    session.console.print(
        f"held-out accuracy {label}: [bold]{held_out.accuracy:.1f}%[/bold], strict "
        f"{held_out.strict_accuracy:.1f}% ({len(examples)} problems, greedy, "
        f"{progress.elapsed():.1f} s)"
    )
    return held_out.accuracy, held_out.strict_accuracy


class EvalProgress:
    """A line while an evaluation runs, at most every EVAL_PROGRESS_SECONDS: how many of the
    problems are done and the time so far (a real model's evaluation takes minutes)."""

    def __init__(self, console: Console, label: str, total: int):
        self.console, self.label, self.total = console, label, total
        self.tic = self.last = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.tic

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last >= EVAL_PROGRESS_SECONDS:
            self.last = now
            seconds = now - self.tic
            self.console.print(f"{self.label}: {done} of {self.total} problems ({seconds:.0f} s)")


EVAL_PROGRESS_SECONDS = 5.0


# --- Finish ------------------------------------------------------------------------------------


def finish(session: Session) -> dict[str, Any]:
    """The last checkpoint, the held-out accuracy after training, summary.json."""
    run, cfg, console = session.run, session.run.cfg, session.console
    trained = cfg.max_steps > session.start_step or session.resume_dir is None
    checkpoint = save(session, session.step) if trained else session.resume_dir
    before = session.progress.get("accuracy_before")
    strict_before = session.progress.get("strict_accuracy_before")
    try:
        after, strict_after = held_out_accuracy(session, "after GRPO")
    except KeyboardInterrupt:
        session.tracker.close()
        raise Interrupted(
            f"interrupted during the held-out evaluation after training; checkpoint "
            f"{checkpoint} is saved (summary.json was not written)"
        ) from None
    session.tracker.close()
    summary = {
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_gain": None if before is None or after is None else after - before,
        "strict_accuracy_before": strict_before,
        "strict_accuracy_after": strict_after,
        "steps": session.step,
        "skipped_steps": run.skipped_steps,
        "eval_history": session.progress["eval_history"],
        "wall_seconds": session.wall_seconds(),
        "checkpoint": str(checkpoint),
        "eval_examples": min(cfg.eval.eval_examples, len(run.task.eval)),
        "config_changes": session.progress.get("config_changes", []),
    }
    (session.log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    run.engine.close()  # vLLM tears its process groups down: before the trainer's
    dist_module.shutdown()
    if before is not None and after is not None:
        console.print(
            f"[bold]held-out accuracy: {before:.1f}% before GRPO -> {after:.1f}% after "
            f"{session.step} steps ({after - before:+.1f} points)[/bold]; strict "
            f"{percent(strict_before)} -> {percent(strict_after)}; in "
            f"{summary['wall_seconds']:.0f} s; run directory {session.log_dir}"
        )
    else:  # no held-out rows (or no evaluation): say where the run is and why no accuracy
        console.print(
            f"[bold]trained {session.step} steps[/bold] in {summary['wall_seconds']:.0f} s; "
            f"no held-out accuracy ({escape(no_evaluation_reason(run))}); run directory "
            f"{session.log_dir}"
        )
    session.emit("train_end", summary=summary)
    return summary


def no_evaluation_reason(run: Run) -> str:
    if not run.task.has_references:
        return "the task has no reference answers"
    if run.cfg.eval.eval_examples == 0:
        return "eval.eval_examples=0"
    return "no rows held out: task.num_eval, task.eval_fraction or task.eval_path hold some out"


# --- Stopping on request -------------------------------------------------------------------------


class StopRequests:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the step in progress, which is
    then checkpointed; a second Ctrl-C interrupts at once (KeyboardInterrupt). Outside the
    main thread signals cannot be caught, and nothing changes."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, console: Console):
        self.console = console
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame) -> None:
        if self.requested and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(number).name
        self.console.print(
            f"[yellow]{self.signal_name}: stopping after this step and saving a checkpoint "
            "(Ctrl-C again to stop at once, without saving it)[/yellow]"
        )

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def last_checkpoint_note(run_dir: Path) -> str:
    latest = latest_checkpoint(run_dir)
    if latest:
        return f"The last checkpoint is {latest}."
    return "No checkpoint was saved: the same command starts the run over."


def continue_command(run_dir: Path) -> str:
    """How the caller continues a stopped run."""
    if way("resume") == "--resume":
        return f"`grpolab train ... output_dir={run_dir} --resume`"
    return f"`{way('resume')}` (output_dir={run_dir})"


def wide_console() -> Console:
    """A console that does not wrap the per-step lines at 80 columns in a log or a pipe."""
    console = Console()
    if not console.is_terminal:
        console.width = 160
    return console


# --- grpolab eval ------------------------------------------------------------------------------


def run_eval(
    cfg: Config,
    examples: int | None = None,
    pass_at_k: int | None = None,
    samples: int | None = None,
    temperature: float = 1.0,
    console: Console | None = None,
) -> dict[str, float]:
    """`grpolab eval`: greedy accuracy (and pass@k) of cfg.model on cfg.task's held-out set,
    in batches of a training step's size, as the trainer evaluates."""
    console = console or wide_console()
    transformers.utils.logging.disable_progress_bar()
    if cfg.runtime.num_threads:
        torch.set_num_threads(cfg.runtime.num_threads)
    model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
    task = load_task(cfg.task)
    held_out = task.eval[:examples] if examples else task.eval
    if not task.has_references:
        raise ValueError(f"task {cfg.task.name!r}: {task.split_reason}: nothing to evaluate")
    if not held_out:
        raise ValueError(f"task {cfg.task.name!r} has no held-out examples (task.num_eval)")
    engine = task_engine(cfg, model, tokenizer)
    check_context_fits(cfg, engine, task)
    console.print(task.describe_answers())
    accuracy = accuracy_rewards(cfg.rewards, task)
    length = cfg.eval.eval_max_completion_length or cfg.rollout.max_completion_length
    progress = EvalProgress(console, "accuracy (greedy)", len(held_out))
    greedy = evaluate_greedy(
        engine,
        held_out,
        accuracy,
        length,
        cfg.eval_batch_size,
        task.answer_kind,
        progress,
        judge=task.strict_judge,
    )
    result = {"accuracy": greedy.accuracy, "strict_accuracy": greedy.strict_accuracy}
    console.print(
        f"accuracy (greedy): {greedy.accuracy:.1f}% on {len(held_out)} problems; strict "
        f"{greedy.strict_accuracy:.1f}% (the final answer exactly the reference; "
        f"{progress.elapsed():.1f} s)"
    )
    if pass_at_k:
        key = f"pass@{pass_at_k}"
        progress = EvalProgress(console, key, len(held_out))
        result[key] = evaluate_pass_at_k(
            engine, held_out, accuracy, length, pass_at_k, samples, temperature, cfg.seed,
            on_batch=progress,
        )  # fmt: skip
        n = samples or pass_at_k
        console.print(
            f"{key}: {result[key]:.1f}% ({n} samples per problem, T={temperature:g}; "
            f"{progress.elapsed():.1f} s)"
        )
    return result
