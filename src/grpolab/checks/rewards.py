"""The task and the rewards: the tokenizer can write the task (`tokenizer.coverage`), some
group's rewards vary (`rewards.variance`), and the reward functions answer the probes honestly:
hand-written completions for real task rows (grpolab.rewards.probes: the reference answer, a
wrong one, the prompt echoed or restated, no answer)."""

from __future__ import annotations

import dataclasses
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


def variance(ctx):
    """On the checked batch; in the preflight, when its few groups are all flat, on a
    training step's worth of groups: a sparse reward (a base model right 3% of the time)
    often leaves the preflight's groups flat while a step's prompts_per_step still teach, so
    the check fails only when a whole step would have no group that varies."""
    rewards, G = ctx.batch.rewards, ctx.batch.group_size
    zero = flat_share(rewards, G)
    if zero == 1 and ctx.run is not None:
        have = rewards.numel() // G
        more = ctx.run.cfg.batch.prompts_per_step - have
        if more > 0:
            ctx.say("rewards.variance on a whole step's prompts (the sampled groups were all flat)")
            zero = flat_share(torch.cat([rewards, step_rewards(ctx.run, have, more)]), G)
    return ctx.result(
        "frac_reward_zero_std (groups that teach nothing)",
        zero,
        "< 1 (some group varies)",
        zero < 1,
    )


def step_rewards(run, have: int, more: int) -> torch.Tensor:
    """Rewards of `more` groups beyond the preflight's `have` (the preflight's own prompt
    draw, continued; its own sampling seed): [more * G]."""
    cfg = run.cfg
    draw = seeds.preflight_prompts(cfg.seed)
    run.task.sample(have, draw)  # the preflight's own prompts, then new ones
    examples = run.task.sample(more, draw)
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed) + 1)
    G = cfg.batch.num_generations
    rollout = run.engine.generate([e.prompt for e in examples], G, params)
    return score(rollout, examples, run.rewards).total.float()


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
    "no group has reward variance: every advantage is 0 and nothing is learned; make the task "
    "easier/harder or the reward denser",
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
