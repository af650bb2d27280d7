"""The task and the rewards: the tokenizer can write the task (`tokenizer.coverage`), some
group's rewards vary (`rewards.variance`), and the reward functions answer the probes honestly:
hand-written completions for real task rows (grpolab.rewards.probes: the reference answer, a
wrong one, the prompt echoed or restated, no answer)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from grpolab import seeds
from grpolab.check import Check, CheckResult, Mutant, result_of
from grpolab.rewards import probes, score
from grpolab.rewards.probes import ProbeReport, probe_task
from grpolab.tasks.coverage import coverage_measurement


def coverage(ctx):
    run = ctx.run
    ctx.say("tokenizer.coverage: the task's prompts and answers through the tokenizer")
    system_prompt = run.cfg.task.system_prompt if run.cfg.task.chat_template else None
    return ctx.result(*coverage_measurement(run.task, run.tokenizer, system_prompt))


def check_tokenizer_coverage(task, tokenizer, system_prompt: str | None = None) -> CheckResult:
    """tokenizer.coverage of `task` outside a run."""
    return result_of(COVERAGE, *coverage_measurement(task, tokenizer, system_prompt))


def flat_share(rewards: torch.Tensor, G: int) -> float:
    """frac_reward_zero_std: the share of groups whose rewards do not vary."""
    r = rewards.double().view(-1, G)
    return (r.std(dim=1, unbiased=False) <= 1e-4).double().mean().item()


# Before calling a reward flat, the preflight looks at this many groups at least (a step's
# when it has more): with none of them varying, right answers are rarer than 3 in
# FLAT_EVIDENCE_GROUPS x G samples (the rule of three's 95 % bound).
FLAT_EVIDENCE_GROUPS = 16
FLAT_STEP_RISK = 0.05  # the batch advised leaves a step without a varying group this rarely


def variance(ctx):
    """On the checked batch; in the preflight, when its groups are all flat, on more groups (a
    step's prompts_per_step, at least FLAT_EVIDENCE_GROUPS): a sparse reward (a model right a
    few % of the time) often leaves a few groups flat while a step's groups still teach, so
    the check fails only when no group of those varies, and then says why: a reward that
    scored no sample, or right answers too rare for the batch (the batch that would do)."""
    rewards, G = ctx.batch.rewards, ctx.batch.group_size
    zero = flat_share(rewards, G)
    what = "frac_reward_zero_std (groups that teach nothing)"
    if ctx.run is None:
        return ctx.result(what, zero, "< 1 (some group varies)", zero < 1)
    have = rewards.numel() // G
    unscored = list(ctx.batch.unscored)
    if zero == 1:
        want = min(max(ctx.run.cfg.batch.prompts_per_step, FLAT_EVIDENCE_GROUPS),
                   len(ctx.run.task.train))  # fmt: skip
        if want > have:
            ctx.say(f"rewards.variance on {want} groups (the {have} sampled were all flat)")
            more, also = step_scores(ctx.run, have, want - have)
            unscored = [name for name in unscored if name in also]
            rewards = torch.cat([rewards, more])
            zero = flat_share(rewards, G)
    groups, step = rewards.numel() // G, ctx.run.cfg.batch.prompts_per_step
    what += f" over {groups} groups of {G}; " + step_risk(zero, groups, G, step)
    result = ctx.result(what, zero, "< 1 (some group varies)", zero < 1)
    if zero < 1:
        return result
    return dataclasses.replace(result, hint=flat_hint(unscored, groups, G, step))


def step_risk(flat: float, groups: int, G: int, step: int) -> str:
    """What the observed share of flat groups means for a training step of `step` groups."""
    if flat == 1:
        return "no group varies"
    return (
        f"at this rate a step of batch.prompts_per_step={step} has no varying group with "
        f"probability {flat**step:.2g}"
    )


def flat_hint(unscored: list[str], groups: int, G: int, step: int) -> str:
    """Why no group varies, and the way out: a function that scored no sample, else right
    answers rarer than the rule of three's bound and the batch that would see them."""
    if unscored:
        names = ", ".join(repr(n) for n in unscored)
        return (
            f"reward {names} returned None for every sample: it scores no row of this task "
            "(check the columns it reads and when it returns None), so every total is flat"
        )
    p = min(3 / (groups * G), 0.5)  # right answers are rarer than this (95 %)
    flat_group = p**G + (1 - p) ** G
    need = math.ceil(math.log(FLAT_STEP_RISK) / math.log(flat_group))
    return (
        f"no group of {groups} x {G} samples has reward variance, so every advantage is 0: "
        f"the reward is constant here, or right answers are rarer than 1 in {1 / p:.0f} "
        f"samples. At that rate a step needs batch.prompts_per_step >= {need} (or "
        "objective.dynamic_sampling=true, which samples more prompts until groups vary) to "
        f"hold a varying group {1 - FLAT_STEP_RISK:.0%} of the time; if none is ever right, "
        "make the task easier, the reward denser, or use a stronger model"
    )


def step_scores(run, have: int, more: int) -> tuple[torch.Tensor, list[str]]:
    """Total rewards of `more` groups beyond the preflight's `have` (the preflight's own
    prompt draw, continued; its own sampling seed), [more * G], and the reward functions that
    returned None for every one of them."""
    cfg = run.cfg
    draw = seeds.preflight_prompts(cfg.seed)
    run.task.sample(have, draw)  # the preflight's own prompts, then new ones
    examples = run.task.sample(more, draw)
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed) + 1)
    G = cfg.batch.num_generations
    rollout = run.engine.generate([e.prompt for e in examples], G, params)
    scores = score(rollout, examples, run.rewards)
    return scores.total.float(), unscored_functions(scores)


def unscored_functions(scores) -> tuple[str, ...]:
    """The reward functions that returned None for every sample of a scored batch."""
    return tuple(name for name, values in scores.per_function.items()
                 if values.numel() and bool(values.isnan().all()))  # fmt: skip


def _report(ctx) -> ProbeReport:
    run = ctx.run

    def probe() -> ProbeReport:
        names = ", ".join(fn.name for fn in run.rewards)
        ctx.say(f"the reward probes on real task rows ({names})")
        return probe_task(run.task, run.rewards, run.tokenizer)

    return ctx.memo("rewards.probes", probe)


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one reward probe check asks: no row where `findings(report)` finds a `breach`."""

    check: Check
    findings: Callable[[ProbeReport], list]
    breach: str


def probe_result(demand: Demand, report: ProbeReport) -> CheckResult:
    """One demand on the run's reward functions' scores of the probes (grpolab.rewards.probes:
    what each kind of reward can be asked)."""
    rows, check = len(report.rows), demand.check
    failed = {n: e for n, e in report.errors.items() if e} if demand is PROBES[0] else {}
    if failed:  # a function that fails on the probes cannot be asked anything
        name, n = next(iter(failed.items()))
        error = report.error_texts.get(name, "its error is in the log")
        what = f"reward {name!r} failed on {n} of {len(report.probes)} probes: {error}"
        return dataclasses.replace(
            result_of(check, what, rows, f"0 of {rows}", False),
            hint=f"the reward function {name!r} fails on real task rows: fix it (the first "
            "failure's traceback is in the log); a failing reward gives every sample the "
            "fallback (rewards.fallback)",
        )
    found = demand.findings(report)
    what = f"rows where {demand.breach} ({_about(report)})"
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        what = f"rows where {demand.breach}; first: {found[0].sentence()}{more}"
    bad_rows = len({f.row for f in found})
    return result_of(check, what, bad_rows, f"0 of {rows}", not found)


def _about(report: ProbeReport) -> str:
    checking = report.answer_checking()
    others = [n for n in report.ruled() if n not in checking]
    about = f"{len(report.rows)} rows; answer-checking: {', '.join(checking) or 'none'}"
    if others:
        about += f"; not answer-checking (probed for the first demand only): {', '.join(others)}"
    for name in report.learned:
        right, compared = report.preferences(name)
        about += (
            f"; learned, reported and held to no demand: {name} prefers the reference to a "
            f"wrong answer on {right} of {compared} rows"
        )
    if report.not_probed:
        about += f"; not probed (need token ids): {', '.join(report.not_probed)}"
    return about


def check_reward_probes(report: ProbeReport) -> list[CheckResult]:
    """The reward probe checks on a probe report."""
    return [probe_result(demand, report) for demand in PROBES]


def _demand(id: str, hint: str, findings, breach: str, mutants=()) -> Demand:
    def run(ctx):
        return probe_result(next(d for d in PROBES if d.check is ctx.check), _report(ctx))

    when = lambda ctx: ctx.run.task.has_references  # noqa: E731 - written from the references
    check = Check(id, 0, hint, run, when=when, stage="run", mutants=mutants)
    return Demand(check, findings, breach)


COVERAGE = Check(
    "tokenizer.coverage",
    0,
    "the tokenizer cannot write these characters: the model reads <unk> (or nothing) where "
    "they stand and can never write an answer that has them, so every reward is flat; use a "
    "model whose tokenizer covers the task's text, or write the task in the symbols it has",
    coverage,
    stage="run",
)
VARIANCE = Check(
    "rewards.variance",
    0,
    "no group has reward variance: every advantage is 0 and nothing is learned; a larger "
    "batch.prompts_per_step (or objective.dynamic_sampling) when right answers are rare, an "
    "easier task or a denser reward when there are none",
    variance,
)
PROBES = (
    _demand(
        "rewards.reference",
        "a reward gives a probe more than the right answer: it must compare the completion's "
        "final answer with the row's reference (the 'answer' column)",
        probes.reference_findings,
        "a probe scores above the reference answer",
    ),
    _demand(
        "rewards.wrong_answer",
        "a reward accepts a wrong final answer: compare the final answer as written (the last "
        "number, \\boxed{} or ####) with the reference, not any number the completion contains",
        probes.wrong_findings,
        "a wrong answer scores as much as the reference",
    ),
    _demand(
        "rewards.echo",
        "a reward accepts the prompt echoed or the question restated: never evaluate an "
        "expression found in the completion (math-verify parses '88 + 22 =' as 110); compare "
        "the final answer as written",
        probes.echo_findings,
        "the prompt echoed or restated scores as much as the reference",
        (Mutant("reward_accepts_echo"),),
    ),
    _demand(
        "rewards.no_answer",
        "a reward pays inaction: an empty or 'I don't know' completion gets more than a wrong "
        "answer (a default of 0 beside a penalty for wrong ones), so GRPO teaches the model to "
        "stop answering; give no answer at most what a wrong answer gets",
        probes.no_answer_findings,
        "no answer scores more than a wrong one",
        (Mutant("reward_pays_inaction"),),
    ),
)
CHECKS = (COVERAGE, VARIANCE)  # the reward probes' checks: PROBES
