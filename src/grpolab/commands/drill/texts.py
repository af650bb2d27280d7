"""Every text the drill prints, in English and in Chinese (the course's wording and terms)."""

from __future__ import annotations

import os

LANGS = ("en", "zh")

# The seven goals, one per piece of the algorithm; zh follows the course's "这节课的落点".
GOALS: dict[int, dict[str, str]] = {
    1: {
        "en": "log-probs: logits[:, :-1] against input_ids[:, 1:], float32 before "
        "log_softmax, temperature applied",
        "zh": "logprob：logits[:, :-1] 配 input_ids[:, 1:]，log_softmax 前转 float32，除以采样温度",
    },
    2: {
        "en": "advantages: population std (unbiased=False), exactly 0 where std ~ 0, "
        "groups contiguous, group sums ~ 0",
        "zh": "优势：总体标准差（unbiased=False），std 接近 0 时显式归零，同组样本必须连续，"
        "每组之和接近 0",
    },
    3: {
        "en": "ratio: logp_old from an extra forward, exactly 1 before the first update",
        "zh": "ratio：logp_old 建议多跑一次前向拿（方案 A），初值必须恒为 1",
    },
    4: {
        "en": "clip: torch.min acts in both directions; asymmetric eps (0.2 / 0.28) on the "
        "right sides",
        "zh": "clip：torch.min 让它对两个方向都生效；非对称 eps（0.2/0.28）用在正确的一侧",
    },
    5: {
        "en": "KL: k3 = exp(d) - d - 1, never negative, tracks the true KL",
        "zh": "KL：用 k3 估计 exp(d)-d-1，恒非负且方差小，期望等于真实 KL",
    },
    6: {
        "en": "normalisation: token-mean vs sequence-mean chosen explicitly; prompt and "
        "padding carry no gradient",
        "zh": "归一化：token 平权 vs 序列平权不等价，显式选一个；prompt 和 padding 不带梯度",
    },
    7: {
        "en": "the assembled grpo_loss: finite, honest metrics, one step moves the policy "
        "the right way",
        "zh": "拼起来：grpo_loss 有限，监控指标只在 mask 内统计，一步更新让模型往对的方向走",
    },
}

# A short name for each check, for the check table.
CHECK_NAMES: dict[str, dict[str, str]] = {
    "logprobs.shift": {"en": "shifted by one", "zh": "错一位"},
    "logprobs.float32": {"en": "float32 before log_softmax", "zh": "log_softmax 前转 float32"},
    "logprobs.temperature": {"en": "temperature applied", "zh": "除以采样温度"},
    "advantages.group_sums": {"en": "group sums ~ 0", "zh": "每组之和接近 0"},
    "advantages.population_std": {
        "en": "population std (divide by G)",
        "zh": "总体标准差（除 G）",
    },
    "advantages.zero_std_groups": {"en": "exactly 0 where std ~ 0", "zh": "std 接近 0 时显式归零"},
    "advantages.contiguous": {"en": "groups contiguous", "zh": "同组样本连续排列"},
    "ratio.initial": {"en": "ratio == 1 on the first update", "zh": "初值 ratio 恒为 1"},
    "clip.values": {"en": "-min(ratio*A, clip(ratio)*A)", "zh": "-min(ratio*A, clip(ratio)*A)"},
    "clip.gradient": {"en": "no gradient through the clip", "zh": "被截断的 token 没有梯度"},
    "clip.asymmetric": {"en": "eps_low / eps_high sides", "zh": "eps_low / eps_high 的方向"},
    "clip.clip_frac": {"en": "clip_frac counted right", "zh": "clip_frac 统计正确"},
    "kl.nonnegative": {"en": "never negative", "zh": "恒非负"},
    "kl.identical": {"en": "0 for identical policies", "zh": "两个策略相同时为 0"},
    "kl.tracks_exact": {"en": "mean equals the true KL", "zh": "期望等于真实 KL"},
    "norm.aggregation": {"en": "the declared aggregation", "zh": "声明的归一化方式"},
    "norm.masked_gradient": {
        "en": "prompt and padding: no gradient",
        "zh": "prompt 和 padding 没有梯度",
    },
    "loss.finite": {"en": "loss is a finite scalar", "zh": "loss 是有限的标量"},
    "loss.metrics": {"en": "metrics masked", "zh": "监控指标只在 mask 内统计"},
    "loss.sgd_direction": {"en": "a step goes the right way", "zh": "一步更新方向正确"},
    "engine.agreement": {"en": "engine agrees with trainer", "zh": "推理引擎与训练一致"},
    "rewards.variance": {"en": "some group varies", "zh": "有组内奖励有差异"},
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
        "  hint [N]    the next hint for goal N (default: the first goal not passing)\n"
        "  show N      print goal N's intermediate quantity on the real batch\n"
        "  train [KEY=VALUE ...]  train the demo model with your functions (all goals pass)\n"
        "  help        this list\n"
        "  quit        leave (progress is kept in .drill.json)",
        "zh": "  goals       七个目标、状态和上次测得的数值\n"
        "  check       检查 my_grpo.py（保存文件会自动重新检查）\n"
        "  hint [N]    目标 N 的下一条提示（默认：第一个没通过的目标）\n"
        "  show N      在真实 batch 上打印目标 N 的中间量\n"
        "  train [KEY=VALUE ...]  用你的函数训练 demo 模型（七项全部通过后）\n"
        "  help        本列表\n"
        "  quit        退出（进度保存在 .drill.json）",
    },
    "goal_word": {"en": "goal", "zh": "目标"},
    "expected_word": {"en": "expected", "zh": "期望"},
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
    "likely_bug": {"en": "likely bug: {hint}", "zh": "可能的 bug：{hint}"},
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
        "zh": "用 {path} 训练 demo 模型：grpolab train {args}",
    },
    "train_done": {
        "en": "held-out accuracy with your GRPO: {before} before -> {after} after {steps} "
        "steps ({gain}); run directory {run_dir}",
        "zh": "你的 GRPO：held-out 准确率 训练前 {before} -> 训练后 {after}，{steps} 步"
        "（{gain}）；运行目录 {run_dir}",
    },
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


# `show N`: the words around the printed quantities.
SHOW: dict[str, dict[str, str]] = {
    "1_head": {
        "en": "row {row} of the batch ({shapes}): logp[:, t] is the log-prob of token t+1, "
        "mask[:, t] = completion_mask[:, t+1]",
        "zh": "batch 第 {row} 行（{shapes}）：logp[:, t] 是第 t+1 个 token 的 logprob，"
        "mask[:, t] = completion_mask[:, t+1]",
    },
    "1_sum": {
        "en": "sum of the completion's logp = {total:.4f} (the sequence's log-prob)",
        "zh": "completion 的 logp 之和 = {total:.4f}（整条回答的对数概率）",
    },
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
    "4_head": {
        "en": "eps_low {lo:g}, eps_high {hi:g}: ratio clipped to [{a:g}, {b:g}]",
        "zh": "eps_low {lo:g}，eps_high {hi:g}：ratio 截断到 [{a:g}, {b:g}]",
    },
    "5_head": {
        "en": "the model's least certain next-token distribution in the batch (new) and a "
        "perturbed copy (ref); 4096 tokens sampled from new:",
        "zh": "batch 里模型最不确定的一个下一 token 分布（new）和它的扰动版本（ref）；"
        "从 new 采样 4096 个 token：",
    },
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


def check_name(check_id: str, lang: str) -> str:
    names = CHECK_NAMES.get(check_id)
    return names[lang] if names else check_id
