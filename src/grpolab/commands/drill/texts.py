"""Every text the drill prints, in English and in Chinese (the course's wording and terms).
What the checks measured and expect, which grpolab.checks writes in English, is translated by
check id in check_texts.py."""

from __future__ import annotations

import os
import re
from functools import cache

LANGS = ("en", "zh")

# The seven goals, one per piece of the algorithm: what to achieve, never how (the hints
# escalate to the exact line; a title does not). The text before the colon names the goal.
GOALS: dict[int, dict[str, str]] = {
    1: {
        "en": "log-probs: each token scored by the logits that predict it, in full precision, "
        "at the sampling temperature",
        "zh": "对数概率：每个 token 由预测它的那一位 logits 打分，精度不丢，并与采样温度一致",
    },
    2: {
        "en": "advantages: normalised within each group, 0 for a group with no spread, each "
        "group one prompt's samples",
        "zh": "优势：在组内归一化；组内奖励没有差异时优势为 0；每组恰好是同一个 prompt 的样本",
    },
    3: {
        "en": "ratio: new over old policy, exactly 1 before the first update",
        "zh": "比率：新旧策略之比，第一次更新之前恒为 1",
    },
    4: {
        "en": "clip: the update bounded in both directions, each bound on its own side",
        "zh": "裁剪：更新幅度在两个方向上都受限，上下界各管自己的一侧",
    },
    5: {
        "en": "KL: a per-token estimate that is never negative, 0 for equal policies, and "
        "tracks the true KL",
        "zh": "KL 惩罚：逐 token 的估计恒非负，两个策略相同时为 0，均值等于真实 KL",
    },
    6: {
        "en": "normalisation: the loss averaged the declared way; prompt and padding carry no "
        "gradient",
        "zh": "归一化：loss 按声明的方式平均；prompt 和 padding 不带梯度",
    },
    7: {
        "en": "the assembled loss: finite, honest metrics, one step moves the policy the right way",
        "zh": "组装好的 loss：数值有限，监控指标如实，一步更新让策略往对的方向走",
    },
}

MESSAGES: dict[str, dict[str, str]] = {
    "banner": {
        "en": "grpolab drill: write GRPO's twenty lines in {path}, check every intermediate "
        "quantity,\nthen train with them. All checks must pass before training. "
        "Commands: goals, check, hint [N], show N, train, help, quit.",
        "zh": "grpolab drill：在 {path} 里写出 GRPO 的二十行，逐个中间量检查，然后用它们训练。\n"
        "这些检查全部通过之后才能开训。命令：goals、check、hint [N]、show N、train、help、quit。",
    },
    "help": {
        "en": "  goals       the seven goals, their status and the last measured number\n"
        "  check       run the checks on my_grpo.py (saving the file re-checks it)\n"
        "  hint [N]    the next hint for goal N (default: the first goal not passing);\n"
        "              every session starts at hint 1 (`grpolab drill DIR --continue` goes on\n"
        "              from the hints seen in earlier sessions)\n"
        "  show N      print goal N's intermediate quantity on the real batch\n"
        "  train [KEY=VALUE ...]  train the demo model with your functions (all goals pass)\n"
        "  help        this list\n"
        "  quit        leave (progress is kept in .drill.json)",
        "zh": "  goals       七个目标、状态和上次测得的数值\n"
        "  check       检查 my_grpo.py（保存文件会自动重新检查）\n"
        "  hint [N]    目标 N 的下一条提示（默认：第一个没通过的目标）；\n"
        "              每次会话都从第 1 条提示开始（`grpolab drill DIR --continue` 接着之前\n"
        "              会话已看过的提示往下给）\n"
        "  show N      在真实 batch 上打印目标 N 的中间量\n"
        "  train [KEY=VALUE ...]  用你的函数训练 demo 模型（七项全部通过后）\n"
        "  help        本列表\n"
        "  quit        退出（进度保存在 .drill.json）",
    },
    "hints_continued": {
        "en": "--continue: the hints go on from the levels seen in earlier sessions",
        "zh": "--continue：提示接着之前会话已看到的级别往下给",
    },
    "goal_word": {"en": "goal", "zh": "目标"},
    "expected_word": {"en": "expected", "zh": "要求"},
    "goals_title": {"en": "Goals ({passed}/7 pass)", "zh": "目标（{passed}/7 通过）"},
    "status_pass": {"en": "pass", "zh": "通过"},
    "status_fail": {"en": "FAIL", "zh": "未通过"},
    "status_todo": {"en": "not yet", "zh": "还没写"},
    "never_checked": {"en": "not checked yet", "zh": "还没检查"},
    "loading": {
        "en": "loading the demo model and sampling a real batch (once per session)...",
        "zh": "加载 demo 模型并采样一个真实 batch（每次会话一次）……",
    },
    "checking": {"en": "checking {path} ...", "zh": "检查 {path} ……"},
    "changed": {"en": "{path} changed: checking again", "zh": "{path} 已修改：重新检查"},
    "all_pass": {
        "en": "all 7 goals pass: type `train` to train the demo model with your functions",
        "zh": "七项全部通过：输入 `train` 用你的函数训练 demo 模型",
    },
    "some_pass": {
        "en": "{passed}/7 goals pass. `hint` gives a hint for the first goal not passing.",
        "zh": "{passed}/7 项通过。`hint` 给第一个没通过的目标一条提示。",
    },
    "all_pass_shell": {
        "en": "all 7 goals pass. Train the demo model with your functions:\n  {command}",
        "zh": "七项全部通过。用你的函数训练 demo 模型：\n  {command}",
    },
    "some_pass_shell": {
        "en": "{passed}/7 goals pass. `grpolab drill {dir}` gives hints goal by goal.",
        "zh": "{passed}/7 项通过。运行 `grpolab drill {dir}` 可以逐个目标看提示。",
    },
    "todo_functions": {
        "en": "write {functions} first (still raising NotImplementedError)",
        "zh": "先写 {functions}（还在 raise NotImplementedError）",
    },
    "todo_missing": {
        "en": "my_grpo.py defines no {functions}",
        "zh": "my_grpo.py 里没有定义 {functions}",
    },
    "todo_called": {
        "en": "calls a function not written yet: {error}",
        "zh": "调用了一个还没写的函数：{error}",
    },
    "load_error": {
        "en": "your file does not load: {error}",
        "zh": "你的文件加载失败：{error}",
    },
    "code_error": {"en": "error in your code: {error}", "zh": "你的代码出错：{error}"},
    "extra_title": {
        "en": "beyond the seven goals (shown, not required):",
        "zh": "七项之外（仅显示，不要求）：",
    },
    "hint_header": {
        "en": "hint {level}/3 for goal {goal} ({topic}):",
        "zh": "目标 {goal} 的提示 {level}/3（{topic}）：",
    },
    "hint_last": {
        "en": "(that was the last hint for this; `show {goal}` prints the quantity itself)",
        "zh": "（这是最后一条提示；`show {goal}` 打印这个中间量本身）",
    },
    "hint_all_pass": {
        "en": "every goal passes: no hint needed. `train` trains with your functions.",
        "zh": "所有目标都通过了，不需要提示。`train` 用你的函数训练。",
    },
    "hint_passing": {
        "en": "goal {goal} passes; here is its hint anyway:",
        "zh": "目标 {goal} 已经通过；提示照样给出：",
    },
    "bad_goal": {
        "en": "no goal {arg}: goals are numbered 1 to 7",
        "zh": "没有目标 {arg}：目标编号是 1 到 7",
    },
    "show_needs_goal": {"en": "usage: show N (N = 1..7)", "zh": "用法：show N（N = 1..7）"},
    "show_todo": {
        "en": "goal {goal}: write {functions} first",
        "zh": "目标 {goal}：先写 {functions}",
    },
    "train_locked": {
        "en": "train is available once all 7 goals pass ({passed}/7 now). `goals` shows "
        "which are left.",
        "zh": "七项全部通过后才能开训（现在 {passed}/7）。`goals` 看还剩哪些。",
    },
    "train_start": {
        "en": "training the demo model with {path}: grpolab train {args}",
        "zh": "用 {path} 训练 demo 模型：grpolab train {args}\n"
        "（下面是 grpolab train 自己的输出，为英文）",
    },
    "resolved_config": {"en": "resolved config: {path}", "zh": "完整配置见 {path}"},
    "train_done": {
        "en": "held-out accuracy with your GRPO: {before} before -> {after} after {steps} "
        "steps ({gain}); run directory {run_dir}",
        "zh": "你的 GRPO：留出集准确率 训练前 {before} -> 训练 {steps} 步后 {after}"
        "（{gain}）；运行目录 {run_dir}",
    },
    "gain_points": {"en": "{gain:+.1f} points", "zh": "{gain:+.1f} 个百分点"},
    "train_failed": {
        "en": "training stopped with exit code {code} (see the output above)",
        "zh": "训练以退出码 {code} 结束（见上面的输出）",
    },
    "interrupted": {
        "en": "(interrupted; `quit` or Ctrl-D leaves the drill)",
        "zh": "（已中断；`quit` 或 Ctrl-D 退出 drill）",
    },
    "unknown_command": {
        "en": "unknown command {cmd!r}; type `help`",
        "zh": "未知命令 {cmd!r}；输入 `help`",
    },
    "bye": {
        "en": "progress saved in {path}. Bye.",
        "zh": "进度已保存到 {path}。再见。",
    },
    "no_workspace": {
        "en": "{path} does not exist: create the workspace with `grpolab drill init {dir}`",
        "zh": "{path} 不存在：先用 `grpolab drill init {dir}` 创建工作区",
    },
    "bad_arguments": {
        "en": "grpolab drill: error: unexpected arguments {args}",
        "zh": "grpolab drill：错误：多余的参数 {args}",
    },
    "init_written": {"en": "wrote {path}", "zh": "已写入 {path}"},
    "init_kept": {
        "en": "kept {path} (exists; never overwritten)",
        "zh": "保留 {path}（已存在，不会覆盖）",
    },
    "init_next": {
        "en": "next: write the functions in {path}, then run `grpolab drill {dir}`",
        "zh": "下一步：在 {path} 里写函数，然后运行 `grpolab drill {dir}`",
    },
    "internal_error": {
        "en": "the drill could not do that: {error}",
        "zh": "drill 无法完成：{error}",
    },
}

# What breaks a function's contract (runner.probe_contracts), after "<file>:<line>: <function> ".
PROBLEMS: dict[str, dict[str, str]] = {
    "not_tensor": {
        "en": "returned {name} as a {type}, expected a tensor",
        "zh": "返回的 {name} 是 {type}，应为张量",
    },
    "shape": {
        "en": "returned {name} of shape {shape}, expected {want}",
        "zh": "返回的 {name} 形状为 {shape}，应为 {want}",
    },
    "not_scalar": {
        "en": "returned {name} of shape {shape}, expected a scalar",
        "zh": "返回的 {name} 形状为 {shape}，应为标量",
    },
    "not_finite": {"en": "returned {name} containing {kind}", "zh": "返回的 {name} 含有 {kind}"},
    "not_pair": {
        "en": "returned {shape}, expected a pair {what}",
        "zh": "返回的是 {shape}，应为二元组 {what}",
    },
    "metrics_type": {
        "en": "returned metrics as a {type}, expected a dict",
        "zh": "返回的 metrics 是 {type}，应为 dict",
    },
    "metrics_missing": {
        "en": "returned metrics without {keys}",
        "zh": "返回的 metrics 缺少 {keys}",
    },
    # the exception's own message follows, as Python wrote it
    "raised": {"en": "raised {exc}: {error}", "zh": "抛出 {exc}: {error}"},
}

# The returned values PROBLEMS names in words rather than by a variable's name.
RETURNED_ZH = {"a value": "值", "a loss": "loss", "KL values": "KL 值"}

# Why my_grpo.py does not load, as grpolab.functions.load_impl words it (English patterns,
# see `translated`); the Python message after the colon stays as Python wrote it.
LOAD_ERRORS_ZH: dict[str, str] = {
    "{where}: syntax error: {message}": "{where}: 语法错误 SyntaxError: {message}",
    "{where}: {exc} while loading: {message}": "{where}: 加载时抛出 {exc}: {message}",
    "--impl {path}: no such file": "--impl {path}：文件不存在",
}


# `show N`: the words around the printed quantities.
SHOW: dict[str, dict[str, str]] = {
    "1_head": {
        "en": "row {row} of the batch ({shapes}): logp[:, t] is the log-prob of token t+1, "
        "mask[:, t] = completion_mask[:, t+1]",
        "zh": "batch 第 {row} 行（{shapes}）：logp[:, t] 是第 t+1 个 token 的对数概率，"
        "mask[:, t] = completion_mask[:, t+1]",
    },
    "1_token": {"en": "token t+1", "zh": "token t+1"},
    "1_sum": {
        "en": "sum of the completion's logp = {total:.4f} (the sequence's log-prob)",
        "zh": "completion 的 logp 之和 = {total:.4f}（整条回答的对数概率）",
    },
    "2_head": {
        "en": "the real batch: {groups} groups of G = {G} (goal 2's checks also use designed "
        "rewards, G = 4: a group of equal rewards, a group of 1e-9 noise)",
        "zh": "真实 batch：{groups} 组，每组 G = {G}（目标 2 的检查另外还用一组设计的奖励，"
        "G = 4：一组奖励全相同，一组只差 1e-9 的噪声）",
    },
    "2_group": {"en": "group {i}:", "zh": "第 {i} 组"},
    "2_row_sum": {"en": "row sum", "zh": "行和"},
    "2_note": {"en": "# every row should be ~ 0", "zh": "# 每一行都应该接近 0"},
    "3_head": {
        "en": "logp_old: an extra forward right after sampling; logp_new: the first "
        "update's forward",
        "zh": "logp_old：采样后立刻多跑一次前向（方案 A）；logp_new：第一次更新时的前向",
    },
    "3_over": {
        "en": "ratio = exp(logp_new - logp_old) over {n} completion tokens:",
        "zh": "ratio = exp(logp_new - logp_old)，共 {n} 个 completion token：",
    },
    "3_bound": {
        "en": "(should be allclose to 1, atol=1e-3)",
        "zh": "（应与 1 allclose，atol=1e-3）",
    },
    "4_head": {
        "en": "eps_low {lo:g}, eps_high {hi:g}: ratio clipped to [{a:g}, {b:g}]",
        "zh": "eps_low {lo:g}，eps_high {hi:g}：ratio 裁剪到 [{a:g}, {b:g}]",
    },
    "4_clipped": {"en": "clipped", "zh": "裁剪后"},
    "expected_col": {"en": "expected", "zh": "应为"},
    "5_head": {
        "en": "the model's least certain next-token distribution in the batch (new) and a "
        "perturbed copy (ref); 4096 tokens sampled from new:",
        "zh": "batch 里模型最不确定的一个下一 token 分布（new）和它的扰动版本（ref）；"
        "从 new 采样 4096 个 token：",
    },
    "5_first": {"en": "kl_k3 of the first 8 samples:", "zh": "前 8 个样本的 kl_k3："},
    "5_naive": {"en": "naive logp_new - logp_ref:", "zh": "朴素估计 logp_new - logp_ref："},
    "5_exact": {"en": "exact KL(new || ref)", "zh": "精确的 KL(new || ref)"},
    "5_note": {
        "en": "(the k3 mean should be close to it, and its min >= 0)",
        "zh": "（k3 的均值应接近它，且最小值 >= 0）",
    },
    "6_head": {
        "en": "per_token [4, 6] with completion lengths {lengths} (max_completion_length {L}):",
        "zh": "per_token [4, 6]，completion 长度 {lengths}（max_completion_length {L}）：",
    },
    "6_cols": {"en": "yours", "zh": "你的"},
    "6_note": {
        "en": "the drill declares loss_agg = {agg!r}: grpo_loss must use that one",
        "zh": "drill 声明 loss_agg = {agg!r}：grpo_loss 必须用这一种",
    },
    "7_head": {
        "en": "grpo_loss on the real batch, with logp_old and logp_ref perturbed (as after a "
        "few updates), beta 0.04:",
        "zh": "真实 batch 上的 grpo_loss，logp_old 和 logp_ref 加了扰动（像更新几步之后），"
        "beta 0.04：",
    },
}


def show_text(key: str, lang: str, **fields) -> str:
    return SHOW[key][lang].format(**fields)


def pick_lang(requested: str | None, environ: dict[str, str] | None = None) -> str:
    """`--lang` wins; else a LC_ALL / LANG starting with "zh" means Chinese; else English."""
    if requested:
        return requested
    env = os.environ if environ is None else environ
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = env.get(var, "")
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def msg(key: str, lang: str, **fields) -> str:
    return MESSAGES[key][lang].format(**fields)


def goal_text(goal: int, lang: str) -> str:
    return GOALS[goal][lang]


def goal_topic(goal: int, lang: str) -> str:
    """The goal's name: its title before the colon."""
    return re.split("[:：]", goal_text(goal, lang))[0]


def problem_text(key: str, lang: str, **fields) -> str:
    if lang == "zh":
        fields = {k: RETURNED_ZH.get(v, v) for k, v in fields.items()}
    return PROBLEMS[key][lang].format(**fields)


def load_error_text(error: str, lang: str) -> str:
    return translated(error, LOAD_ERRORS_ZH) if lang == "zh" else error


# --- English text written elsewhere, in Chinese -----------------------------------------------
# A table maps English patterns to Chinese: "{name}" in a pattern matches any text (numbers,
# identifiers, the values a check measured) and fills the same "{name}" of the Chinese; a name
# used twice must match the same text twice. The English is what grpolab.checks writes, so a
# number or a tolerance lives only there.

# Values of a pattern's fields that are English words: what they are in Chinese.
FIELD_WORDS_ZH = {"population": "总体", "sample": "样本"}


@cache
def _compiled(pattern: str) -> re.Pattern:
    parts, seen = [], set()
    for literal, name in re.findall(r"([^{]*)(?:\{(\w+)\})?", pattern):
        parts.append(re.escape(literal))
        if name:
            parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>.+?)")
            seen.add(name)
    return re.compile("".join(parts), re.DOTALL)


def translation(text: str, table: dict[str, str]) -> str | None:
    """`text` in Chinese by the first pattern of `table` that matches all of it, else None."""
    for pattern, zh in table.items():
        found = _compiled(pattern).fullmatch(text)
        if found:
            fields = {k: FIELD_WORDS_ZH.get(v, v) for k, v in found.groupdict().items()}
            return zh.format(**fields)
    return None


def translated(text: str, table: dict[str, str]) -> str:
    """`text` in Chinese, or as it is when no pattern matches (tests/test_drill_texts.py keeps
    every text the drill shows matched)."""
    found = translation(text, table)
    return text if found is None else found
