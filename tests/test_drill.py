"""The drill end to end: the real interactive session in a pty (pexpect), piped sessions in
English and Chinese, `grpolab drill check`, and the goal/hint of every known bug on the demo
model and a real rollout batch."""

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from grpolab import core
from grpolab.checks import registry
from grpolab.commands.cli import main
from grpolab.commands.drill import hints, texts
from grpolab.commands.drill.runner import FAIL, PASS, TODO, Workbench
from grpolab.commands.drill.template import MY_GRPO, train_command
from grpolab.core import CORE_FUNCTIONS

TESTS = Path(__file__).parent
SOLUTION = (TESTS / "drill_solutions" / "my_grpo.py").read_text()
MUTANTS = TESTS / "mutants"
PROMPT = "drill> "
VERDICT = r"all 7 goals pass|\d/7 goals pass\."

# mutant -> (the first goal failing, the check whose hint `hint` gives)
MUTANT_GOAL_HINT = {
    "no_shift": (1, "logprobs.shift"),
    "bf16_log_softmax": (1, "logprobs.float32"),
    "no_temperature": (1, "logprobs.temperature"),
    "unbiased_std": (2, "advantages.population_std"),
    "no_zero_std_guard": (2, "advantages.zero_std_groups"),
    "interleaved_groups": (2, "advantages.contiguous"),
    "max_not_min": (4, "clip.values"),
    "eps_swapped": (4, "clip.asymmetric"),
    "naive_kl": (5, "kl.nonnegative"),
    "reversed_k3": (5, "kl.tracks_exact"),
    "token_mean_declared_sequence": (6, "norm.aggregation"),
    "prompt_in_mask": (6, "norm.masked_gradient"),
    "sign_flipped": (6, "loss.sgd_direction"),
    "unmasked_ratio_mean": (7, "loss.metrics"),
}


def with_mutant(name: str) -> str:
    """The correct solution with one function replaced by a known bug (the last def wins)."""
    return SOLUTION + "\n\n" + (MUTANTS / f"{name}.py").read_text()


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # the watcher never sees half a file


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def drill_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    return {**env, "NO_COLOR": "1", "LANG": "C.UTF-8", **extra}


# --- The workspace and the texts ---------------------------------------------------------------


def test_init_writes_the_workspace_and_never_overwrites(tmp_path, capsys):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    assert (ws / "my_grpo.py").read_text() == MY_GRPO
    assert "grpolab drill" in (ws / "README.md").read_text()
    mine = "# my work\n" + MY_GRPO
    (ws / "my_grpo.py").write_text(mine)
    assert main(["drill", "init", str(ws)]) == 0
    assert (ws / "my_grpo.py").read_text() == mine
    assert "kept" in capsys.readouterr().out


# grpolab's own functions take more than the seed's contract: truncated importance
# sampling's token_weights, the entropy, and the profiles' conventions and the menu's options.
OPTIONAL_EXTRAS = {
    "token_weights",
    "return_entropy",
    "entropy",
    "lengths",
    "valid",
    "loss",
    "std",
    "zero_std_guard",
    "estimator",
    "surrogate_options",  # policy_loss's: a registered surrogate's own (grpolab.objective)
    "options",  # grpo_loss's: the objective's units' keywords
    *core.LOSS_OPTION_DEFAULTS,
}


def test_the_template_states_the_core_contract():
    namespace: dict = {}
    exec(compile(MY_GRPO, "my_grpo.py", "exec"), namespace)
    for name in CORE_FUNCTIONS:
        ours = inspect.signature(namespace[name]).parameters
        reference = inspect.signature(getattr(core, name)).parameters
        # The learner writes the seed's contract; OPTIONAL_EXTRAS are grpolab's own.
        assert [(p.name, p.default) for p in ours.values()] == [
            (p.name, p.default) for p in reference.values() if p.name not in OPTIONAL_EXTRAS
        ], name
        assert "Returns" in namespace[name].__doc__
        with pytest.raises(NotImplementedError):
            namespace[name](*[None] * len([p for p in ours.values() if p.default is p.empty]))
    for key in ("clip_frac_low", "clip_frac_high", "adv_std", "ratio_mean", "[B, T-1]"):
        assert key in MY_GRPO


def test_every_goal_and_check_has_three_hints_in_both_languages():
    goal_checks = {c for g in range(1, 8) for c in registry.seed_goal_ids(g)}
    prefixes = ("logprobs.", "advantages.", "ratio.", "clip.", "kl.", "norm.", "loss.")
    seed_checks = {c.id for c in registry.ALL if c.id.startswith(prefixes) and 1 <= c.goal <= 7}
    seed_checks -= registry.DECLARED_ONLY
    assert goal_checks == seed_checks
    for key in [*goal_checks, *(f"write.{g}" for g in range(1, 8))]:
        assert len(hints.HINTS[key]) == 3, key
        for level in hints.HINTS[key]:
            assert level["en"].strip() and level["zh"].strip(), key
    for goal in range(1, 8):
        assert re.search("[\u4e00-\u9fff]", texts.GOALS[goal]["zh"])
    assert {k for k in texts.MESSAGES if set(texts.MESSAGES[k]) != {"en", "zh"}} == set()


def test_language_from_flag_then_locale():
    assert texts.pick_lang("en", {"LANG": "zh_CN.UTF-8"}) == "en"
    assert texts.pick_lang(None, {"LANG": "zh_CN.UTF-8"}) == "zh"
    assert texts.pick_lang(None, {"LC_ALL": "zh_TW.UTF-8", "LANG": "en_US.UTF-8"}) == "zh"
    assert texts.pick_lang(None, {"LANG": "en_US.UTF-8"}) == "en"
    assert texts.pick_lang(None, {}) == "en"


# --- Piped sessions and the non-interactive check (no model needed while nothing is written) --


def run_piped(ws: Path, commands: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpolab", "drill", str(ws), *args],
        input=commands,
        capture_output=True,
        text=True,
        env=drill_env(**env),
        timeout=300,
    )


@pytest.mark.slow
def test_piped_session_in_chinese(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    out = run_piped(
        ws, "goals\nhint 2\nhint 2\nhint 2\nhint 2\nshow 2\nbogus\n", LANG="zh_CN.UTF-8"
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "目标（0/7 通过）" in text and text.count("还没写") >= 7
    assert texts.GOALS[2]["zh"] in text
    for level in (1, 2, 3):
        assert f"目标 2 的提示 {level}/3" in text
        assert hints.HINTS["write.2"][level - 1]["zh"].splitlines()[0] in text
    assert "这是最后一条提示" in text
    assert "目标 2：先写 group_advantages" in text and "未知命令 'bogus'" in text
    assert "进度已保存" in text  # ended at EOF
    saved = json.loads((ws / ".drill.json").read_text())
    assert saved["hints_seen"] == {"write.2": 3}
    assert saved["goals"]["2"]["status"] == TODO

    # --lang wins over the locale.
    out = run_piped(ws, "hint 2\nhint 9\nquit\n", "--lang", "en", LANG="zh_CN.UTF-8")
    assert "hint 1/3 for goal 2" in out.stdout and "no goal 9" in out.stdout


# What a goal's title must not say: how to reach it (code, a keyword argument, the formula).
GIVE_AWAY = re.compile(r"[\[\]()=_]|torch|unbiased|log_softmax|exp|k3|:-1|0\.28|min\b")


@pytest.mark.slow
def test_goal_titles_say_what_to_achieve_not_how(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    commands = "goals\n" + "".join(f"hint {g}\n" for g in range(1, 8))
    for lang, todo in (("en", "not yet"), ("zh", "还没写")):
        out = run_piped(ws, commands, "--lang", lang).stdout
        titles = re.findall(rf"^  \d\. {todo}  (.*)$", out, re.M)
        assert titles == [texts.GOALS[g][lang] for g in range(1, 8)]
        assert [t for t in titles if GIVE_AWAY.search(t)] == []
        topics = re.findall(r"(?:for goal \d \(|的提示 1/3（)(.*?)[)）]:?：?$", out, re.M)
        assert topics == [texts.goal_topic(g, lang) for g in range(1, 8)]


@pytest.mark.slow
def test_hints_start_over_each_session_unless_continued(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    out = run_piped(ws, "hint 2\nhint 2\nhint 3\nquit\n").stdout
    assert "hint 1/3 for goal 2" in out and "hint 2/3 for goal 2" in out
    seen = {"write.2": 2, "write.3": 1}
    assert json.loads((ws / ".drill.json").read_text())["hints_seen"] == seen

    # A new session starts at hint 1 for every goal; the levels seen stay saved.
    out = run_piped(ws, "hint 2\nhint 3\nhelp\nquit\n").stdout
    assert "hint 1/3 for goal 2" in out and "hint 1/3 for goal 3" in out
    assert "hint 2/3" not in out and "grpolab drill DIR --continue" in out
    assert json.loads((ws / ".drill.json").read_text())["hints_seen"] == seen

    # --continue goes on from the levels seen in earlier sessions.
    out = run_piped(ws, "hint 2\nhint 3\nhint 4\nquit\n", "--continue").stdout
    assert out.startswith("--continue: the hints go on from the levels seen")
    assert "hint 3/3 for goal 2" in out and "hint 2/3 for goal 3" in out
    assert "hint 1/3 for goal 4" in out

    zh = run_piped(ws, "hint 2\nhelp\nquit\n", LANG="zh_CN.UTF-8").stdout
    assert "目标 2 的提示 1/3" in zh and "grpolab drill DIR --continue" in zh
    zh = run_piped(ws, "hint 2\nquit\n", "--continue", LANG="zh_CN.UTF-8").stdout
    assert zh.startswith("--continue：提示接着") and "目标 2 的提示 3/3" in zh


@pytest.mark.slow
def test_drill_check_exit_codes_and_json(tmp_path):
    ws = tmp_path / "ws"
    cmd = [sys.executable, "-m", "grpolab", "drill", "check", str(ws), "--json"]
    missing = subprocess.run(cmd, capture_output=True, text=True, env=drill_env())
    assert missing.returncode == 2 and "grpolab drill init" in missing.stderr
    assert main(["drill", "init", str(ws)]) == 0
    out = subprocess.run(cmd, capture_output=True, text=True, env=drill_env(), timeout=300)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert [g["status"] for g in report["goals"]] == [TODO] * 7
    assert report["goals"][2]["todo"] == ["sequence_logprobs", "grpo_loss"]
    text = subprocess.run(cmd[:-1], capture_output=True, text=True, env=drill_env(), timeout=300)
    last = text.stdout.rstrip().splitlines()[-1]
    assert last == f"0/7 goals pass. `grpolab drill {ws}` gives hints goal by goal."

    write(ws / "my_grpo.py", SOLUTION)
    out = subprocess.run(cmd, capture_output=True, text=True, env=drill_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["passed"] and report["goals_passed"] == 7
    assert all(c["passed"] for g in report["goals"] for c in g["checks"])
    assert json.loads((ws / ".drill.json").read_text())["passed_ever"] == list(range(1, 8))


@pytest.mark.slow
@pytest.mark.slow
def test_drill_check_says_how_to_train_in_the_shell(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    write(ws / "my_grpo.py", SOLUTION)
    cmd = [sys.executable, "-m", "grpolab", "drill", "check", str(ws)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=drill_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "type `train`" not in out.stdout and "all 7 goals pass" in out.stdout
    command = out.stdout.rstrip().splitlines()[-1].strip()
    assert command == train_command(ws)
    argv = shlex.split(command)
    assert argv[:4] == ["grpolab", "train", "--impl", str(ws / "my_grpo.py")]

    zh = subprocess.run([*cmd, "--lang", "zh"], capture_output=True, text=True, env=drill_env())
    assert "输入 `train`" not in zh.stdout and zh.stdout.rstrip().endswith(command)

    # The command as printed trains with the learner's file (`grpolab` is the package's).
    small = ["max_steps=2", "eval.eval_examples=20", "batch.prompts_per_step=4"]
    trained = subprocess.run(
        [sys.executable, "-m", "grpolab", *argv[1:], *small],
        capture_output=True,
        text=True,
        env=drill_env(),
        timeout=600,
    )
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    summary = json.loads((ws / "runs" / "drill" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_train_impl_reports_a_broken_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def kl_k3(a, b)\n    return a\n")
    out = subprocess.run(
        [sys.executable, "-m", "grpolab", "train", "--impl", str(broken), "max_steps=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "broken.py:1: syntax error" in out.stderr


# --- Every known bug: the goal that fails and the hint that names it ----------------------------


@pytest.fixture(scope="module")
def bench():
    b = Workbench()
    b.ensure()
    return b


@pytest.mark.parametrize("mutant", sorted(MUTANT_GOAL_HINT))
def test_each_known_bug_fails_its_goal_with_the_matching_hint(bench, tmp_path, mutant):
    goal, hint_key = MUTANT_GOAL_HINT[mutant]
    path = tmp_path / "my_grpo.py"
    path.write_text(with_mutant(mutant))
    report = bench.check(path)
    failing = [g for g, gr in report.goals.items() if gr.status != PASS]
    assert failing and failing[0] == goal
    assert report.goals[goal].status == FAIL and report.goals[goal].hint_key == hint_key
    caught = {r.id for g in report.goals.values() for r in g.checks if not r.passed}
    assert hint_key in caught


def test_errors_in_the_learners_code_point_at_its_line(bench, tmp_path):
    path = tmp_path / "my_grpo.py"

    raising = SOLUTION.replace(
        "    d = logp_ref - logp_new\n", "    d = logp_ref - logp_new\n    d = d @ d\n"
    )
    path.write_text(raising)
    report = bench.check(path)
    line = line_of(raising, "d = d @ d")
    assert report.goals[5].status == FAIL
    errors = [r.error for r in report.goals[5].checks if r.error]
    assert errors and f"my_grpo.py:{line}: RuntimeError" in errors[0]
    assert report.goals[5].checks[0].error_line == line

    wrong_shape = SOLUTION.replace("    return adv.view(-1)", "    return adv")
    path.write_text(wrong_shape)
    report = bench.check(path)
    line = line_of(wrong_shape, "    return adv")
    assert report.goals[2].status == FAIL
    assert [p.text() for p in report.goals[2].problems] == [
        f"my_grpo.py:{line}: group_advantages returned advantages of shape [4, 8], expected [32]"
    ]
    assert report.goals[2].problems[0].line == line

    nan = SOLUTION.replace(
        "    return token_logprobs, mask", "    return token_logprobs * 0 / 0, mask"
    )
    path.write_text(nan)
    report = bench.check(path)
    line = line_of(nan, "token_logprobs * 0 / 0")
    assert report.goals[1].status == FAIL
    assert (
        f"my_grpo.py:{line}: sequence_logprobs returned logp containing NaN"
        in report.goals[1].problems[0].text()
    )

    path.write_text(SOLUTION.replace("def kl_k3(logp_new, logp_ref):", "def kl_k3(logp_new)"))
    report = bench.check(path)
    assert report.load_error.startswith(f"my_grpo.py:{line_of(SOLUTION, 'def kl_k3')}: syntax")
    assert report.passed == 0


# --- The real interactive session in a pty ------------------------------------------------------


class Drill:
    """One `grpolab drill DIR` in a pty; `run` sends a command and returns its output."""

    def __init__(self, ws: Path, log: Path):
        self.ws = ws
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "grpolab", "drill", str(ws)],
            env=drill_env(COLUMNS="200"),
            encoding="utf-8",
            timeout=120,
            dimensions=(50, 200),
        )
        self.child.logfile_read = log.open("w")
        self.child.expect_exact(PROMPT)

    def run(self, command: str, timeout: float = 300) -> str:
        self.child.sendline(command)
        self.child.expect_exact(command)  # the terminal's echo
        self.child.expect_exact("\r\n" + PROMPT, timeout=timeout)
        return self.child.before.replace("\r\n", "\n")

    def edit(self, text: str, timeout: float = 300) -> str:
        """Save my_grpo.py and wait for the automatic re-check."""
        write(self.ws / "my_grpo.py", text)
        self.child.expect_exact("my_grpo.py changed: checking again", timeout=timeout)
        self.child.expect(VERDICT + "|does not load", timeout=timeout)
        out = self.child.before + self.child.after
        self.child.expect_exact(PROMPT)
        return (out + self.child.before).replace("\r\n", "\n")


def checks_of_the_solution(ws: Path) -> int:
    """How many checks `grpolab drill check --json` runs on SOLUTION (the goals' and the
    extras): the registry decides which apply, so the count is read, not written down."""
    assert main(["drill", "init", str(ws)]) == 0
    write(ws / "my_grpo.py", SOLUTION)
    cmd = [sys.executable, "-m", "grpolab", "drill", "check", str(ws), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=drill_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    return sum(len(g["checks"]) for g in report["goals"]) + len(report["extra_checks"])


@pytest.mark.slow
def test_the_interactive_session(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    drill = Drill(ws, tmp_path / "transcript.txt")

    out = drill.run("goals")
    assert "Goals (0/7 pass)" in out and out.count("not yet") == 7
    assert "train is available once all 7 goals pass (0/7 now)" in drill.run("train")

    out = drill.edit(SOLUTION)  # the watch mode: saving the file re-checks it
    assert "all 7 goals pass" in out and "FAIL" not in out
    out = drill.run("check")
    rows = 7 + checks_of_the_solution(tmp_path / "twin")  # goals, then their checks and extras
    assert out.count("  pass  ") == rows and "FAIL" not in out
    assert "group sums ~ 0 (advantages.group_sums)" in out and "expected <= 1e-4" in out
    out = drill.run("goals")
    assert "Goals (7/7 pass)" in out and "ratio == 1 on the first update (ratio.initial): 0" in out
    out = drill.run("show 2")
    sums = re.findall(r"row sum ([-+0-9.e]+)", out)
    assert len(sums) == 4 and all(abs(float(s)) < 1e-4 for s in sums)
    out = drill.run("show 3")
    assert "max |ratio - 1| = 0.00e+00" in out
    assert "every goal passes" in drill.run("hint")

    out = drill.run("train max_steps=2 eval.eval_examples=20 batch.prompts_per_step=4", 600)
    found = re.search(
        r"held-out accuracy with your GRPO: ([\d.]+)% before -> ([\d.]+)% after 2", out
    )
    assert found, out[-3000:]
    assert "resolved config: " in out and "adam_beta1" not in out  # the full config: config.yaml
    assert "holds every value" not in out  # the trainer's config line, in the drill's words
    summary = json.loads((ws / "runs" / "drill" / "summary.json").read_text())
    assert f"{summary['accuracy_before']:.1f}" == found.group(1)
    assert f"{summary['accuracy_after']:.1f}" == found.group(2)

    for mutant in ("no_zero_std_guard", "eps_swapped", "reversed_k3", "sign_flipped"):
        goal, key = MUTANT_GOAL_HINT[mutant]
        out = drill.edit(with_mutant(mutant))
        assert f"goal {goal}  FAIL" in out, (mutant, out)
        assert re.search(r"FAIL  .*\((" + re.escape(key) + r"|norm\.aggregation)\)", out)
        out = drill.run("hint")
        assert f"hint 1/3 for goal {goal} ({key}):" in out, (mutant, out)
        assert hints.HINTS[key][0]["en"][:40] in out.replace("\n  ", " ")
        assert "train is available once all 7 goals pass" in drill.run("train")

    drill.edit(with_mutant("no_zero_std_guard"))
    assert "hint 2/3 for goal 2 (advantages.zero_std_groups)" in drill.run("hint 2")
    out = drill.run("hint 2")
    assert "hint 3/3" in out and "adv = torch.where(std > 1e-4, adv, torch.zeros_like(adv))" in out

    broken = SOLUTION.replace("def kl_k3(logp_new, logp_ref):", "def kl_k3(logp_new, logp_ref)")
    line = line_of(broken, "def kl_k3")
    out = drill.edit(broken)
    assert f"your file does not load: my_grpo.py:{line}: syntax error" in out
    assert f"{line} | def kl_k3(logp_new, logp_ref)" in out
    assert f"my_grpo.py:{line}: syntax error" in drill.run("hint")

    raising = SOLUTION.replace("return torch.exp(d) - d - 1", "return torch.exp(d) - d - one")
    line = line_of(raising, "- one")
    out = drill.edit(raising)
    assert f"error in your code: my_grpo.py:{line}:" in out and "goal 5  FAIL" in out
    assert f"error in your code: my_grpo.py:{line}:" in drill.run("show 5")

    drill.child.sendline("quit")
    drill.child.expect_exact("progress saved in")
    drill.child.expect(pexpect.EOF)
    saved = json.loads((ws / ".drill.json").read_text())
    assert saved["passed_ever"] == list(range(1, 8))
    assert saved["hints_seen"]["advantages.zero_std_groups"] == 3
    assert saved["hints_seen"]["clip.asymmetric"] == 1
    assert saved["goals"]["5"]["status"] == FAIL
