"""Checking a learner's my_grpo.py: grpolab's checks on the demo model and a real batch, turned
into the seven goals' statuses (pass / fail / not yet) with errors pointing at the learner's
lines. The model and the batch are built once and reused for every check."""

from __future__ import annotations

import ast
import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpolab.check import CheckResult
from grpolab.checks.context import PreflightBatch, PreflightSettings
from grpolab.checks.runner import blamed, run_checks
from grpolab.commands.drill.diagnose import first_failing, known_bugs
from grpolab.commands.drill.texts import problem_text
from grpolab.core import CORE_FUNCTIONS, CoreFunctions
from grpolab.functions import ImplLoadError, core_functions, impl_error_line, load_impl
from grpolab.model.policy import eval_mode

# The learner's functions each goal's checks call (directly or through grpo_loss).
GOAL_FUNCTIONS: dict[int, tuple[str, ...]] = {
    1: ("sequence_logprobs",),
    2: ("group_advantages",),
    3: ("sequence_logprobs", "grpo_loss"),
    4: ("policy_loss",),
    5: ("kl_k3",),
    6: ("aggregate", "grpo_loss", "sequence_logprobs"),
    7: ("grpo_loss", "sequence_logprobs"),
}
PASS, FAIL, TODO = "pass", "fail", "todo"
METRIC_KEYS = ("loss", "clip_frac", "kl", "adv_std", "ratio_mean")


# --- Which functions the learner has written ---------------------------------------------------


@dataclass
class Written:
    """Per core function: "written", "stub" (still raises NotImplementedError) or "missing"."""

    state: dict[str, str]
    lines: dict[str, int]  # the def line of each function in the file

    def todo(self, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if self.state.get(n) != "written"]


def _is_stub(node: ast.FunctionDef) -> bool:
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return True
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value is Ellipsis
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def written_functions(source: str, impl: CoreFunctions) -> Written:
    """What the learner wrote: a top-level def whose body is more than `raise
    NotImplementedError` (the last def of a name wins, as in Python)."""
    defs: dict[str, ast.FunctionDef] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            defs[node.name] = node
    state, lines = {}, {}
    for name in CORE_FUNCTIONS:
        if impl.source.get(name) == "grpolab":
            state[name] = "missing"
        elif name in defs and _is_stub(defs[name]):
            state[name] = "stub"
        else:
            state[name] = "written"  # a def, or a function imported into the file
        if name in defs:
            lines[name] = defs[name].lineno
    return Written(state, lines)


# --- The contract: shapes, types and finite values of what each function returns -------------


def call_traced(fn: Callable, *args, **kwargs) -> tuple[Any, int | None]:
    """fn(*args, **kwargs) and the line of fn's `return` that produced the value."""
    code = getattr(fn, "__code__", None)
    line = None

    def profile(frame, event, arg):
        nonlocal line
        if event == "return" and frame.f_code is code:
            line = frame.f_lineno

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return out, line


def _shape(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return "[" + ", ".join(str(d) for d in x.shape) + "]"
    return type(x).__name__


@dataclass(frozen=True)
class Said:
    """Something wrong, in no language yet: a key of texts.PROBLEMS and its fields."""

    key: str
    fields: dict[str, str]


@dataclass(frozen=True)
class Problem:
    """A written function breaking its contract (a wrong shape, NaN, an exception), at its
    line in the learner's file (`where`: "my_grpo.py:12: ", or "" when unknown)."""

    function: str
    said: Said
    where: str = ""
    line: int | None = None

    def text(self, lang: str = "en") -> str:
        return f"{self.where}{self.function} " + problem_text(
            self.said.key, lang, **self.said.fields
        )


def _tensor_problem(name: str, x: Any, shape: tuple[int, ...] | None, where=None) -> Said | None:
    """What is wrong with the returned value `x` (None when nothing is)."""
    if not isinstance(x, torch.Tensor):
        return Said("not_tensor", {"name": name, "type": type(x).__name__})
    if shape is not None and tuple(x.shape) != shape:
        if shape == () and x.numel() == 1:
            return None
        if shape == ():
            return Said("not_scalar", {"name": name, "shape": _shape(x)})
        want = "[" + ", ".join(map(str, shape)) + "]"
        return Said("shape", {"name": name, "shape": _shape(x), "want": want})
    values = x.detach()
    if where is not None and values.shape == where.shape:
        values = values[where]
    if values.is_floating_point() and not torch.isfinite(values).all():
        kind = "NaN" if torch.isnan(values).any() else "inf"
        return Said("not_finite", {"name": name, "kind": kind})
    return None


def _pair(out: Any, what: str) -> tuple[Any, Any] | Said:
    if not isinstance(out, tuple | list) or len(out) != 2:
        return Said("not_pair", {"shape": _shape(out), "what": what})
    return out[0], out[1]


def probe_contracts(
    impl: CoreFunctions, written: Written, model, batch: PreflightBatch, s: PreflightSettings
) -> dict[str, Problem]:
    """Call each written function once on real inputs; map function -> what breaks its
    contract (a wrong shape, NaN, an exception), with the line in the learner's file."""
    rows = slice(0, min(4, batch.input_ids.shape[0]))
    ids, am, cm = batch.input_ids[rows], batch.attention_mask[rows], batch.completion_mask[rows]
    b, T = ids.shape
    mask = cm[:, 1:].float()
    g = torch.Generator().manual_seed(s.seed)
    logp_old = -torch.rand(b, T - 1, generator=g) - 0.1
    logp_new = logp_old + 0.3 * torch.randn(b, T - 1, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:b]

    def run_sequence_logprobs():
        with torch.no_grad():
            out, line = call_traced(
                impl.sequence_logprobs, model, ids, am, cm, s.objective.temperature
            )
        pair = _pair(out, "(logp, mask)")
        if isinstance(pair, Said):
            return pair, line
        valid = cm[:, 1:].bool()
        return (
            _tensor_problem("logp", pair[0], (b, T - 1), valid)
            or _tensor_problem("mask", pair[1], (b, T - 1))
        ), line

    def run_group_advantages():
        out, line = call_traced(impl.group_advantages, batch.rewards, batch.group_size)
        return _tensor_problem("advantages", out, tuple(batch.rewards.shape)), line

    def run_policy_loss():
        out, line = call_traced(
            impl.policy_loss,
            logp_new,
            logp_old,
            adv,
            mask,
            s.objective.epsilon,
            s.objective.epsilon_high,
        )
        pair = _pair(out, "(per_token, clip_frac)")
        if isinstance(pair, Said):
            return pair, line
        return (
            _tensor_problem("per_token", pair[0], (b, T - 1), mask.bool())
            or _tensor_problem("clip_frac", pair[1], ())
        ), line

    def run_kl_k3():
        out, line = call_traced(impl.kl_k3, logp_new, logp_old)
        return _tensor_problem("KL values", out, (b, T - 1)), line

    def run_aggregate():
        out, line = call_traced(impl.aggregate, logp_new, mask, s.objective.loss_type, T - 1)
        return _tensor_problem("a value", out, ()), line

    def run_grpo_loss():
        out, line = call_traced(
            impl.grpo_loss, logp_new, logp_old, logp_old, adv, mask,
            **s.objective.loss_kwargs() | {"beta": 0.04, "max_completion_length": T - 1},
        )  # fmt: skip
        return _loss_problem(out), line

    probes = {
        "sequence_logprobs": run_sequence_logprobs,
        "group_advantages": run_group_advantages,
        "policy_loss": run_policy_loss,
        "kl_k3": run_kl_k3,
        "aggregate": run_aggregate,
        "grpo_loss": run_grpo_loss,
    }
    with eval_mode(model, zero_grad=True):
        return _run_probes(probes, written, impl)


def _run_probes(probes: dict, written: Written, impl: CoreFunctions) -> dict[str, Problem]:
    """function -> its problem, for each written function whose probe finds one."""
    problems: dict[str, Problem] = {}
    for name, probe in probes.items():
        if written.state[name] != "written":
            continue
        try:
            problem, line = probe()
        except NotImplementedError:
            continue  # it calls a function still to write: that goal is "not yet"
        except Exception as err:
            line = impl_error_line(err, impl.path) if impl.path else None
            problem = Said("raised", {"exc": type(err).__name__, "error": str(err)})
        if problem:
            line = line or written.lines.get(name)
            where = f"{Path(impl.path).name}:{line}: " if line else ""
            problems[name] = Problem(name, problem, where, line)
    return problems


def _loss_problem(out) -> Said | None:
    """What is wrong with grpo_loss's return value (a (loss, metrics) pair), or None."""
    pair = _pair(out, "(loss, metrics)")
    if isinstance(pair, Said):
        return pair
    loss, metrics = pair
    problem = _tensor_problem("a loss", loss, ())
    if problem is None and not isinstance(metrics, Mapping):
        problem = Said("metrics_type", {"type": type(metrics).__name__})
    if problem is None:
        absent = [k for k in METRIC_KEYS if k not in metrics]
        if absent:
            problem = Said("metrics_missing", {"keys": ", ".join(absent)})
    return problem


# --- Goals from the checks ---------------------------------------------------------------------


@dataclass
class GoalResult:
    goal: int
    status: str  # pass | fail | todo
    checks: list[CheckResult] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)  # functions still raising NotImplementedError
    missing: list[str] = field(default_factory=list)  # functions the file does not define
    problems: list[Problem] = field(default_factory=list)  # contract breaks, at file:line
    not_written_call: str | None = None  # a NotImplementedError met while checking
    hint_key: str = ""  # the hint that matches why the goal does not pass

    @property
    def headline(self) -> CheckResult | None:
        """The check to quote: the likely cause among the failing ones, else the first."""
        return (blamed(self.checks) or self.checks or [None])[0]

    def to_json(self) -> dict:
        return {
            "goal": self.goal,
            "status": self.status,
            "todo": self.todo,
            "missing": self.missing,
            "problems": [p.text() for p in self.problems],
            "hint_key": self.hint_key,
            "checks": [r.to_json() for r in self.checks],
        }


@dataclass
class DrillReport:
    path: str
    goals: dict[int, GoalResult]
    extras: list[CheckResult] = field(default_factory=list)
    load_error: str | None = None
    load_line: int | None = None

    @property
    def passed(self) -> int:
        return sum(g.status == PASS for g in self.goals.values())

    @property
    def all_pass(self) -> bool:
        return self.passed == len(self.goals)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "passed": self.all_pass,
            "goals_passed": self.passed,
            "load_error": self.load_error,
            "load_line": self.load_line,
            "goals": [g.to_json() for g in self.goals.values()],
            "extra_checks": [r.to_json() for r in self.extras],
        }


def _raised_not_implemented(r: CheckResult) -> bool:
    return r.error is not None and r.measured == "NotImplementedError"


def goal_results(
    results: list[CheckResult], written: Written, problems: dict[str, Problem]
) -> dict[int, GoalResult]:
    """Each goal's status: todo while one of its functions is unwritten, fail when its
    functions break their contract or a check fails, else pass."""
    goals = {}
    for goal, names in GOAL_FUNCTIONS.items():
        mine = [r for r in results if r.goal == goal]
        gr = GoalResult(goal, PASS, checks=mine)
        gr.todo = [n for n in names if written.state.get(n) == "stub"]
        gr.missing = [n for n in names if written.state.get(n) == "missing"]
        gr.problems = [problems[n] for n in names if n in problems]
        raised = [r for r in mine if _raised_not_implemented(r)]
        if gr.todo or gr.missing or raised:
            gr.status = TODO
            gr.checks = []
            gr.not_written_call = raised[0].error if raised else None
            gr.hint_key = f"write.{goal}"
        elif gr.problems or not mine or not all(r.passed for r in mine):
            gr.status = FAIL
            gr.hint_key = first_failing(goal, mine) or f"write.{goal}"
        else:
            gr.hint_key = mine[0].id
        goals[goal] = gr
    return goals


def load_error_report(path: Path, err: ImplLoadError) -> DrillReport:
    goals = {g: GoalResult(g, FAIL, hint_key=f"write.{g}") for g in GOAL_FUNCTIONS}
    message = str(err).replace(str(path), path.name)
    return DrillReport(str(path), goals, load_error=message, load_line=err.line)


def all_todo_report(path: Path, written: Written) -> DrillReport:
    return DrillReport(str(path), goal_results([], written, {}))


# --- The workbench: one model and one batch per session ----------------------------------------


@dataclass
class Workbench:
    """The demo model, its tokenizer and a real scored rollout batch, built on first use."""

    overrides: list[str] = field(default_factory=list)
    on_load: Callable[[], None] | None = None  # called before the (slow) first load
    model: Any = None
    tokenizer: Any = None
    batch: PreflightBatch | None = None
    settings: PreflightSettings | None = None
    completions: list[str] = field(default_factory=list)
    run: Any = None  # the run the batch was sampled by (its config chooses the functions)

    def ensure(self) -> None:
        if self.model is not None:
            return
        import transformers

        from grpolab.config import load_config
        from grpolab.train.preflight import sample_batch, settings_from_config
        from grpolab.train.setup import build_run, load_start_model, resolve_device

        if self.on_load:
            self.on_load()
        transformers.utils.logging.disable_progress_bar()
        cfg = load_config(None, self.overrides)
        if cfg.runtime.num_threads:
            torch.set_num_threads(cfg.runtime.num_threads)
        model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
        self.run = build_run(cfg, model, tokenizer)
        batch, completions = sample_batch(self.run)
        self.model, self.tokenizer, self.batch = model, tokenizer, batch
        self.completions = completions
        # The drill's loss masks by multiplying, as its hints teach, and the learner does not
        # write the micro-batch scaling: neither loss.masked_nan nor norm.minibatch_invariance
        # is one of its goals.
        self.settings = dataclasses.replace(
            settings_from_config(cfg), masked_nan=False, accumulation=False
        )

    def functions(self, impl: CoreFunctions) -> CoreFunctions:
        """The learner's functions where written, the trainer's (as configured) elsewhere."""
        runtime = self.run.cfg.runtime
        return core_functions(runtime.logprobs, runtime.shared_prefix, impl)

    def check(self, path: str | Path) -> DrillReport:
        """Every check on the learner's file; never raises for anything in the learner's code."""
        path = Path(path)
        try:
            impl = load_impl(path)
        except ImplLoadError as err:
            return load_error_report(path, err)
        written = written_functions(path.read_text(encoding="utf-8"), impl)
        if all(v != "written" for v in written.state.values()):
            return all_todo_report(path, written)  # nothing to run: no model needed yet
        self.ensure()
        impl = self.functions(impl)
        problems = probe_contracts(impl, written, self.model, self.batch, self.settings)
        torch.manual_seed(self.settings.seed)
        results = run_checks(self.model, self.batch, self.settings, impl)
        results = [_finite_measured(r) for r in results]
        goals = goal_results(results, written, problems)
        failing = {g for g, gr in goals.items() if gr.status == FAIL and not gr.problems}
        for goal, key in known_bugs(impl, failing).items():
            goals[goal].hint_key = key
        return DrillReport(str(path), goals, extras=[r for r in results if r.goal == 0])


def _finite_measured(r: CheckResult) -> CheckResult:
    """A NaN measured value is a failure whatever the comparison said."""
    if isinstance(r.measured, float) and math.isnan(r.measured):
        r.passed = False
    return r
