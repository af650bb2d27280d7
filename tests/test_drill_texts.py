"""The drill in Chinese: every text it can print under --lang zh (the tables of goals, hints,
messages, `show`, contract problems; every check it can show, measured on correct and on
buggy code; piped sessions and `grpolab drill check` through the real command) holds no
English sentence outside code, identifiers, paths, numbers and Python's own messages."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpolab.checks.context import Context
from grpolab.checks.registry import ALL
from grpolab.commands.cli import main
from grpolab.commands.drill import check_texts, hints, render, texts
from grpolab.commands.drill.runner import Problem, Said, Workbench
from grpolab.commands.drill.session import train_result
from grpolab.commands.drill.state import DrillState
from grpolab.core import CoreFunctions

TESTS = Path(__file__).parent
SOLUTION = (TESTS / "drill_solutions" / "my_grpo.py").read_text()
MUTANTS = TESTS / "mutants"
# The known bugs a learner of the seed's objective can write (the checks of the other files
# in tests/mutants/ run only where an objective declares their option).
SEED_MUTANTS = (
    "kl_no_grad",
    "kl_detached_exp",
    "kl_loss_no_grad",
    "eos_as_padding",
    "no_shift",
    "bf16_log_softmax",
    "no_temperature",
    "unbiased_std",
    "no_zero_std_guard",
    "interleaved_groups",
    "max_not_min",
    "eps_swapped",
    "naive_kl",
    "reversed_k3",
    "token_mean_declared_sequence",
    "prompt_in_mask",
    "sign_flipped",
    "unmasked_ratio_mean",
    "excluded_rows_vote",
)
# grpolab's own functions as the learner's: they take every optional keyword (`valid`...),
# so every check the drill can run on some learner's file runs.
ALL_KEYWORDS = (
    "from grpolab.core import (aggregate, grpo_loss, group_advantages, kl_k3, policy_loss,\n"
    "    sequence_logprobs)\n"
)


# --- The heuristic ------------------------------------------------------------------------------

# Quoted material: `code`, 'a string', "a string" (an apostrophe inside a word is no quote).
QUOTED = re.compile(r"`[^`\n]*`|(?<![A-Za-z])'[^'\n]*'(?![A-Za-z])|\"[^\"\n]*\"")
# An exception's own message, as Python wrote it: after "SomethingError: " to the line's end.
PYTHON_MESSAGE = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Interrupt)\b:.*$")
SOURCE_EXCERPT = re.compile(r"^\s*\d+ \| ")  # a line of the learner's file, quoted
WORD = re.compile(r"[A-Za-z]+(?:['-][A-Za-z]+)*")  # "group's", "log-probs"
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]+")  # Chinese, its punctuation
EDGES = "(<|,.;:!?)>"


def python_line(line: str) -> bool:
    """A line of Python (a hint's exact line, a printed expression)."""
    code = line.strip()
    for candidate in (code, code + " pass"):
        try:
            ast.parse(candidate)
            return True
        except SyntaxError:
            pass
    return False


# Terms a Chinese ML course writes in English inside its sentences (as the seed course does):
# they neither count as English words nor break a run of them.
# fmt: off
KEPT_TERMS = frozenset({
    "token", "tokens", "prompt", "completion", "padding", "batch", "mask", "loss", "logits",
    "logprob", "logp", "demo", "grpolab", "drill", "train", "clip", "ratio", "metrics", "std",
    "eps", "min", "max", "mean", "exp", "softmax", "log-softmax", "dtype", "profile", "seed",
    "ulp", "mode", "shape", "inf",
})
# fmt: on


def english_runs(text: str, least: int = 2) -> list[str]:
    """Runs of `least` or more English words in `text`, outside quoted code, Python lines,
    quoted source lines and Python's exception messages. An English word is made of ASCII
    letters, at least two, all lowercase after the first; the course's terms (KEPT_TERMS) and
    one-letter words ("a", "x") neither count nor break a run. Anything else breaks one:
    Chinese, a number, an identifier (snake_case, dotted, CamelCase, ACRONYM, with brackets
    or digits), a path, an operator."""
    found = []
    for line in text.splitlines():
        if SOURCE_EXCERPT.match(line) or python_line(line):
            continue
        line = CJK.sub(" | ", PYTHON_MESSAGE.sub(" ", QUOTED.sub(" ", line)))
        run: list[str] = []
        for token in [*line.split(), "|"]:
            word = token.strip(EDGES)
            if WORD.fullmatch(word) and (len(word) == 1 or word.lower() in KEPT_TERMS):
                continue
            if WORD.fullmatch(word) and word[1:].islower():
                run.append(word)
                continue
            if len(run) >= least:
                found.append(" ".join(run))
            run = []
    return found


def test_the_heuristic_catches_the_english_the_drill_used_to_print_in_chinese():
    # Lines `grpolab drill --lang zh` printed before its check texts were translated.
    before = [
        "            max |population std of a group's advantages - 1| (G = 4; declared "
        "population std, profile seed)",
        "      通过  loss 是有限的标量 (loss.finite): 0.201   期望 finite scalar",
        "      通过  一步更新方向正确 (loss.sgd_direction): 0.00543   期望 > 0 (A>0 rises "
        "relative to A<0)",
        "      通过  错一位 (logprobs.shift): 1.13e-07   期望 <= 2.6e-06 (4 x float32 "
        "log-softmax's 9.4e-08 + 4 ulp + the loss's 1.6e-07)",
        "      通过  被截断的 token 没有梯度 (clip.gradient): 0   期望 == 0 on clipped, != 0 "
        "elsewhere",
        "  kl_k3 of the first 8 samples:   0.0012  0.0003",
        "my_grpo.py:12: group_advantages returned advantages of shape [4, 8], expected [32]",
    ]
    assert all(english_runs(line) for line in before), [
        line for line in before if not english_runs(line)
    ]
    # What stays as it is: code, identifiers, numbers, paths, quoted source, Python's words.
    kept = [
        "      通过  每组之和接近 0 (advantages.group_sums): 1.79e-07   要求 <= 1e-4",
        "      未通过  组内标准差为 1 (advantages.population_std): 0.134   要求 <= 1e-2",
        "目标 4 的提示 2/3（clip.asymmetric）：",
        "  非对称裁剪（DAPO 的 clip-higher，0.2 / 0.28）：eps_low 管下界 1 - eps_low。",
        "if beta > 0.0 and logp_ref is not None:",
        "sequence: ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()",
        "      44 | return torch.exp(d) - d - one",
        "你的代码出错：my_grpo.py:44: kl_k3 raised NameError: name 'one' is not defined",
        "用 my_grpo.py 训练 demo 模型：grpolab train --impl /tmp/x/my_grpo.py --overwrite",
        "  train [KEY=VALUE ...]  用你的函数训练 demo 模型（七项全部通过后）",
    ]
    assert [english_runs(line) for line in kept] == [[]] * len(kept)


# --- The tables ---------------------------------------------------------------------------------


def zh_tables() -> dict[str, str]:
    """Every Chinese text of the drill's tables, by where it lives."""
    tables = {f"GOALS[{g}]": t["zh"] for g, t in texts.GOALS.items()}
    tables |= {f"MESSAGES[{k}]": t["zh"] for k, t in texts.MESSAGES.items()}
    tables |= {f"SHOW[{k}]": t["zh"] for k, t in texts.SHOW.items()}
    tables |= {f"PROBLEMS[{k}]": t["zh"] for k, t in texts.PROBLEMS.items()}
    tables |= {f"LOAD_ERRORS_ZH[{k}]": t for k, t in texts.LOAD_ERRORS_ZH.items()}
    tables |= {f"CHECK_NAMES[{k}]": t["zh"] for k, t in check_texts.CHECK_NAMES.items()}
    tables |= {
        f"CHECK_ZH[{k}][{en}]": zh for k, t in check_texts.CHECK_ZH.items() for en, zh in t.items()
    }
    tables |= {
        f"HINTS[{k}][{i + 1}]": level["zh"]
        for k, levels in hints.HINTS.items()
        for i, level in enumerate(levels)
    }
    return tables


def test_every_chinese_text_of_the_tables_is_chinese():
    english = {where: english_runs(t) for where, t in zh_tables().items()}
    assert {where: runs for where, runs in english.items() if runs} == {}


def test_every_message_and_hint_has_both_languages():
    for table in (texts.MESSAGES, texts.SHOW, texts.PROBLEMS, check_texts.CHECK_NAMES):
        assert {k for k, v in table.items() if set(v) != {"en", "zh"}} == set()
    for key, levels in hints.HINTS.items():
        assert all(set(level) == {"en", "zh"} for level in levels), key


# --- Every check the drill can show --------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    b = Workbench()
    b.ensure()
    return b


def drill_checks(bench) -> set[str]:
    """The checks the drill runs on some learner's file: those of the batch stage whose
    condition holds under the drill's objective and settings for functions taking every
    keyword grpolab's take (a learner's take fewer, which runs fewer)."""
    ctx = Context(bench.functions(CoreFunctions()), bench.settings, bench.model, bench.batch)
    return {c.id for c in ALL if c.stage == "batch" and c.when(ctx)}


def test_every_check_the_drill_can_show_has_its_words(bench):
    shown = drill_checks(bench)
    assert {"logprobs.shift", "rewards.variance", "advantages.excluded_rows"} <= shown
    assert shown - set(check_texts.CHECK_NAMES) == set()
    assert shown - set(check_texts.CHECK_ZH) == set()


def checked(bench, tmp_path: Path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return bench.check(path)


def test_every_check_result_the_drill_shows_is_chinese(bench, tmp_path):
    """The solution, each known bug, grpolab's own functions and a raising one: every result's
    measured text and expectation has a Chinese rendering, and the rendered report and goals
    hold no English sentence."""
    sources = {
        "solution": SOLUTION,
        "all_keywords": ALL_KEYWORDS,
        "raising": SOLUTION.replace("return torch.exp(d) - d - 1", "return torch.exp(d) - d - one"),
        **{m: SOLUTION + "\n\n" + (MUTANTS / f"{m}.py").read_text() for m in SEED_MUTANTS},
    }
    untranslated, english = set(), {}
    seen: set[str] = set()
    for name, source in sources.items():
        report = checked(bench, tmp_path, name, source)
        results = [r for g in report.goals.values() for r in g.checks] + report.extras
        for r in results:
            seen.add(r.id)
            for text in (r.what, r.expected):
                zh = check_texts.check_said(r.id, text, "zh")
                if zh == text and english_runs(text, least=1):
                    untranslated.add((r.id, text))
        state = DrillState()
        state.record(report)
        lines = render.report_lines(report, "zh", render.Painter())
        lines += render.goals_lines(state, "zh", render.Painter())
        runs = [run for line in lines for run in english_runs(line)]
        if runs:
            english[name] = runs
    assert untranslated == set()
    assert english == {}
    assert seen >= drill_checks(bench) - {"advantages.excluded_rows"} | {"engine.agreement"}


def test_contract_problems_load_errors_and_the_train_line_in_chinese():
    fields = {"name": "advantages", "shape": "[4, 8]", "want": "[32]"}
    problem = Problem("group_advantages", Said("shape", fields), "my_grpo.py:9: ", 9)
    assert problem.text() == (
        "my_grpo.py:9: group_advantages returned advantages of shape [4, 8], expected [32]"
    )
    assert problem.text("zh") == (
        "my_grpo.py:9: group_advantages 返回的 advantages 形状为 [4, 8]，应为 [32]"
    )
    for key, english in texts.PROBLEMS.items():
        for name in ("a value", "a loss", "KL values", "logp"):
            fields = {
                k: name if k == "name" else "x" for k in re.findall(r"\{(\w+)\}", english["en"])
            }
            said = Problem("aggregate", Said(key, fields)).text("zh")
            assert not english_runs(said), (key, said)
    assert texts.load_error_text("my_grpo.py:3: syntax error: expected ':'", "zh") == (
        "my_grpo.py:3: 语法错误 SyntaxError: expected ':'"
    )
    loading = "my_grpo.py:5: ZeroDivisionError while loading: division by zero"
    assert texts.load_error_text(loading, "zh") == (
        "my_grpo.py:5: 加载时抛出 ZeroDivisionError: division by zero"
    )
    summary = {"accuracy_before": 35.2, "accuracy_after": 48.8, "steps": 100, "accuracy_gain": 13.6}
    assert train_result(summary, Path("ws/runs/drill"), "zh") == (
        "你的 GRPO：留出集准确率 训练前 35.2% -> 训练 100 步后 48.8%（+13.6 个百分点）；"
        "运行目录 ws/runs/drill"
    )


# --- Through the real command --------------------------------------------------------------------


def drill(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """`python -m grpolab drill ARGS` with `stdin` piped, in a Chinese locale."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    return subprocess.run(
        [sys.executable, "-m", "grpolab", "drill", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**base, "NO_COLOR": "1", "LANG": "zh_CN.UTF-8", **env},
        timeout=600,
    )


def assert_chinese(output: str) -> None:
    runs = english_runs(output)
    assert runs == [], runs


def every_hint(goals=range(1, 8)) -> str:
    return "".join(f"hint {g}\n" * 3 for g in goals)


@pytest.mark.slow
def test_a_new_workspace_in_chinese(tmp_path):
    ws = tmp_path / "ws"
    init = drill("init", str(ws))
    assert init.returncode == 0 and "已写入" in init.stdout
    assert_chinese(init.stdout)
    commands = "goals\n" + every_hint() + "hint\nhelp\nshow 3\nshow\ntrain\nhint 9\nbogus\nquit\n"
    out = drill(str(ws), stdin=commands)
    assert out.returncode == 0, out.stderr
    assert "目标 7 的提示 3/3" in out.stdout and "未知命令 'bogus'" in out.stdout
    assert_chinese(out.stdout)
    for args in (("check", str(ws)), ("check", str(tmp_path / "none")), (str(ws), "extra")):
        done = drill(*args)
        assert done.returncode in (1, 2)
        assert_chinese(done.stdout + done.stderr)


@pytest.mark.slow
def test_a_session_on_buggy_and_broken_code_in_chinese(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    (ws / "my_grpo.py").write_text(SOLUTION + "\n\n" + (MUTANTS / "eps_swapped.py").read_text())
    commands = "goals\ncheck\nhint\nhint\nhint\n" + "".join(f"show {g}\n" for g in range(1, 8))
    out = drill(str(ws), stdin=commands + "train\nquit\n")
    assert out.returncode == 0, out.stderr
    assert "目标 4  未通过" in out.stdout and "目标 4 的提示 3/3（clip.asymmetric）" in out.stdout
    assert_chinese(out.stdout)

    (ws / "my_grpo.py").write_text(
        SOLUTION.replace("return torch.exp(d) - d - 1", "return torch.exp(d) - d - one").replace(
            "    return adv.view(-1)", "    return adv"
        )
    )
    out = drill(str(ws), stdin="check\nhint 5\nshow 5\nshow 2\n")
    assert "你的代码出错：my_grpo.py:" in out.stdout and "形状为 [4, 8]，应为 [32]" in out.stdout
    assert_chinese(out.stdout)

    (ws / "my_grpo.py").write_text(SOLUTION.replace("def kl_k3(logp_new, logp_ref):", "def kl_k3("))
    out = drill("check", str(ws))
    assert out.returncode == 1 and "你的文件加载失败：my_grpo.py:" in out.stdout
    assert "语法错误" in out.stdout
    assert_chinese(out.stdout)


@pytest.mark.slow
def test_passing_and_training_in_chinese(tmp_path):
    ws = tmp_path / "ws"
    assert main(["drill", "init", str(ws)]) == 0
    (ws / "my_grpo.py").write_text(SOLUTION)
    check = drill("check", str(ws))
    assert check.returncode == 0 and "七项全部通过" in check.stdout
    assert_chinese(check.stdout)

    train = "train max_steps=2 eval.eval_examples=20 batch.prompts_per_step=4\n"
    out = drill(str(ws), stdin="goals\nhint\n" + train + "quit\n")
    assert out.returncode == 0, out.stderr
    # grpolab train's own output (English) lies between the drill's two lines around it.
    head, trainer = out.stdout.split("（下面是 grpolab train 自己的输出，为英文）\n")
    trainer, tail = trainer.split("你的 GRPO：")
    assert "完整配置见 " in trainer and re.search(r"训练 2 步后 [\d.]+%", tail)
    assert "holds every value" not in trainer  # the config line is the drill's, in Chinese
    assert_chinese(head + "你的 GRPO：" + tail)
    summary = json.loads((ws / "runs" / "drill" / "summary.json").read_text())
    assert f"训练前 {summary['accuracy_before']:.1f}%" in tail
