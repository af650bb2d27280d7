"""The checks the drill shows, in its words: a short name for each (what it asks for, not how
to get there), and in Chinese what it measured and what it expects. grpolab.checks writes
those in English with the numbers of the run; each is translated here by check id through
English patterns (texts.translation), so the numbers and tolerances stay in the checks.
tests/test_drill_texts.py runs every check the drill can show, on correct and buggy code, and
fails on any text left untranslated."""

from __future__ import annotations

from grpolab.commands.drill.texts import translated

# A short name for each check, for the check table.
CHECK_NAMES: dict[str, dict[str, str]] = {
    "logprobs.shift": {
        "en": "matches the model's own cross-entropy",
        "zh": "与模型自身的交叉熵一致",
    },
    "logprobs.float32": {"en": "full precision on a bf16 model", "zh": "bf16 模型上精度不丢"},
    "logprobs.temperature": {"en": "at the sampling temperature", "zh": "与采样温度一致"},
    "advantages.group_sums": {"en": "group sums ~ 0", "zh": "每组之和接近 0"},
    "advantages.population_std": {"en": "std 1 within a group", "zh": "组内标准差为 1"},
    "advantages.zero_std_groups": {
        "en": "0 for a group with no spread",
        "zh": "没有差异的组优势为 0",
    },
    "advantages.contiguous": {
        "en": "a group is one prompt's samples",
        "zh": "每组是同一个 prompt 的样本",
    },
    "advantages.excluded_rows": {
        "en": "excluded rows do not vote",
        "zh": "被排除的行不参与组内统计",
    },
    "ratio.initial": {"en": "ratio == 1 on the first update", "zh": "第一次更新时 ratio 恒为 1"},
    "clip.values": {"en": "the clipped surrogate's values", "zh": "裁剪后代理损失的取值"},
    "clip.gradient": {"en": "no gradient through the clip", "zh": "被裁剪的 token 没有梯度"},
    "clip.asymmetric": {"en": "each eps on its own side", "zh": "两个 eps 各管一侧"},
    "clip.clip_frac": {"en": "clip_frac counted right", "zh": "clip_frac 统计正确"},
    "kl.nonnegative": {"en": "never negative", "zh": "恒非负"},
    "kl.identical": {"en": "0 for identical policies", "zh": "两个策略相同时为 0"},
    "kl.tracks_exact": {"en": "mean equals the true KL", "zh": "均值等于真实 KL"},
    "kl.gradient": {"en": "its gradient, not only its value", "zh": "不只取值对，梯度也对"},
    "norm.aggregation": {"en": "the declared aggregation", "zh": "声明的归一化方式"},
    "norm.masked_gradient": {
        "en": "prompt and padding: no gradient",
        "zh": "prompt 和 padding 没有梯度",
    },
    "norm.eos": {"en": "the EOS is trained", "zh": "结尾的 EOS 参与训练"},
    "loss.finite": {"en": "loss is a finite scalar", "zh": "loss 是有限的标量"},
    "loss.metrics": {"en": "metrics masked", "zh": "监控指标只在 mask 内统计"},
    "loss.sgd_direction": {"en": "a step goes the right way", "zh": "一步更新方向正确"},
    "engine.agreement": {"en": "engine agrees with trainer", "zh": "推理引擎与训练端一致"},
    "engine.trained_tokens": {
        "en": "trains the tokens the engine sampled",
        "zh": "训练的正是推理引擎采样的 token",
    },
    "rewards.variance": {"en": "some group varies", "zh": "至少一组奖励有差异"},
}

# check id -> {what the check writes (English pattern): its Chinese}, for what it measured
# and what it expects; a text with no English words in it ("<= 1e-4") is shown as it is.
CHECK_ZH: dict[str, dict[str, str]] = {
    "logprobs.shift": {
        "max |mean completion logp + model's labels CE| per row": (
            "各行 |completion 的平均 logp + 模型自带 labels 算出的交叉熵| 的最大值"
        ),
        "<= {tol} ({k} x float32 log-softmax's {plain} + {ulp} ulp + the loss's {loss})": (
            "<= {tol}（float32 log-softmax 的误差 {plain} 的 {k} 倍 + {ulp} ulp"
            " + 该交叉熵自身的误差 {loss}）"
        ),
    },
    "logprobs.float32": {
        "bf16 model: dtype {dtype}, share of log-probs on the bf16 grid (max gap to float64 "
        "{gap})": "bf16 模型：dtype {dtype}，落在 bf16 网格上的对数概率所占比例"
        "（与 float64 的最大差 {gap}）",
    },
    "logprobs.temperature": {
        "max gap to softmax(logits / {T}) in float64 (at T = 1: {own})": (
            "与 float64 的 softmax(logits / {T}) 的最大差（T = 1 时为 {own}）"
        ),
        "<= {tol} ({k} x max(float32 log-softmax, its own gap at T = 1 / T)'s {plain} + {ulp} "
        "ulp)": "<= {tol}（max(float32 log-softmax 的误差, 它在 T = 1 时的误差 / T) = {plain}"
        " 的 {k} 倍 + {ulp} ulp）",
    },
    "advantages.contiguous": {
        "max |adv(reordered) - adv reordered| on designed rewards (G = {G}), groups and the "
        "samples inside each reordered (group i = samples [i*G, (i+1)*G))": (
            "设计的奖励上（G = {G}）把各组及组内样本重新排序："
            "|adv(重排后的 rewards) - 重排后的 adv| 的最大值（第 i 组 = 样本 [i*G, (i+1)*G)）"
        ),
    },
    "advantages.group_sums": {
        "max |sum of a group's advantages| on the real batch (G = {G}) and designed rewards "
        "(G = {G4})": "真实 batch（G = {G}）和设计的奖励（G = {G4}）上，一组优势之和的最大绝对值",
    },
    "advantages.population_std": {
        "max |{std} std of a group's advantages - 1| on designed rewards (G = {G}; declared "
        "{std} std, profile {profile})": (
            "设计的奖励上（G = {G}），|组内优势的{std}标准差 - 1| 的最大值"
            "（声明的是{std}标准差，profile {profile}）"
        ),
    },
    "advantages.zero_std_groups": {
        "max |adv| in an equal-reward group and a 1e-9-noise group (designed rewards, G = {G})": (
            "奖励全相同的组和只差 1e-9 噪声的组里 |adv| 的最大值（设计的奖励，G = {G}）"
        ),
        "== 0 exactly": "恰好 == 0",
    },
    "advantages.excluded_rows": {
        "max |adv - the reference over the valid rows only| (G = {G}, {n} valid per group); "
        "excluded rows' max |adv| {leaked}": (
            "|adv - 只用有效行算出的参考值| 的最大值（G = {G}，每组 {n} 个有效行）；"
            "被排除的行 |adv| 的最大值 {leaked}"
        ),
        "<= {tol}, excluded rows exactly 0": "<= {tol}，被排除的行恰好为 0",
    },
    "ratio.initial": {
        "max |ratio - 1| on the first inner step (and |ratio_mean - 1|)": (
            "第一次内层更新时 |ratio - 1| 的最大值（以及 |ratio_mean - 1|）"
        ),
    },
    "clip.values": {
        "max |per_token - (-min(r*A, clip(r)*A))| on a perturbed policy, both signs of A "
        "(ratios off the band between the two bounds)": (
            "扰动后的策略上 |per_token - (-min(r*A, clip(r)*A))| 的最大值，A 取正负两种符号"
            "（ratio 不在两个界之间的区间里）"
        ),
    },
    "clip.gradient": {
        "max |grad| on clipped tokens (min |grad| elsewhere {g})": (
            "被裁剪的 token 上 |grad| 的最大值（其余 token 上 |grad| 的最小值为 {g}）"
        ),
        "== 0 on clipped, != 0 elsewhere": "被裁剪处 == 0，其余处 != 0",
    },
    "clip.asymmetric": {
        "tokens between 1+-eps_low and 1+-eps_high treated wrongly (eps {eps})": (
            "ratio 落在 1±eps_low 与 1±eps_high 之间、却处理错了的 token 数（eps {eps}）"
        ),
    },
    "clip.clip_frac": {
        "|clip_frac - direct count| (direct {direct})": (
            "|clip_frac - 直接计数|（直接计数为 {direct}）"
        ),
    },
    "kl.nonnegative": {"min KL estimate over the vocabulary": "整个词表上 KL 估计的最小值"},
    "kl.identical": {"max |KL| for identical policies": "两个策略相同时 |KL| 的最大值"},
    "kl.tracks_exact": {
        "max relative gap of E_p[estimate] to the exact KL (KL {kl}, {n}-sample mean {mean})": (
            "E_p[估计值] 与精确 KL 的最大相对误差（KL 为 {kl}，{n} 个样本的均值为 {mean}）"
        ),
    },
    "kl.gradient": {
        "max relative gap of the KL's gradient to float64 ({est}): kl_k3's {k3}, the loss's KL "
        "term's {term} ({n} tokens); d loss / d beta {dbeta}": (
            "KL 梯度与 float64 的最大相对误差（{est}）：kl_k3 的 {k3}，loss 中 KL 项的 {term}"
            "（{n} 个 token）；d loss / d beta 为 {dbeta}"
        ),
        "<= 1e-4, d loss / d beta != 0": "<= 1e-4，且 d loss / d beta != 0",
    },
    "norm.aggregation": {
        "|loss - {agg}-mean| on unequal lengths ({others})": (
            "长度不等的序列上 |loss - 按 {agg} 方式的平均|（其他方式：{others}）"
        ),
    },
    "norm.masked_gradient": {
        "max |d loss / d logp| on prompt and padding positions": (
            "prompt 和 padding 位置上 |d loss / d logp| 的最大值"
        ),
    },
    "norm.eos": {
        "completions whose EOS is out of the loss mask or gets no gradient, of {n} ({s} ended "
        "in EOS as sampled, the rest given one)": (
            "EOS 不在 loss 的 mask 内、或没有梯度的 completion 数（共 {n} 个；{s} 个采样时以 EOS "
            "结束，其余补上了 EOS）"
        ),
    },
    "loss.finite": {
        "loss on a perturbed policy with KL": "扰动后的策略上、带 KL 项的 loss",
        "finite scalar": "有限的标量",
    },
    "loss.metrics": {
        "max |metric - direct masked computation| (worst: {key})": (
            "|指标 - 在 mask 内直接算出的值| 的最大值（最差的是 {key}）"
        ),
    },
    "loss.sgd_direction": {
        "mean logp change after one SGD step: A>0 {up}, A<0 {down}": (
            "一步 SGD 之后 logp 的平均变化：A>0 为 {up}，A<0 为 {down}"
        ),
        "> 0 (A>0 rises relative to A<0)": "> 0（A>0 的 logp 相对 A<0 的上升）",
    },
    "engine.agreement": {
        "engine vs trainer float32 logp: max gap (mean {mean})": (
            "推理引擎与训练端 float32 logp 的最大差（平均 {mean}）"
        ),
    },
    "engine.trained_tokens": {
        "positions trained that the engine did not sample ({extra}) or sampled and left out "
        "({missing}), of {n}; rows whose counts differ: {rows}": (
            "训练了但推理引擎没有采样的位置（{extra}）或采样了却被排除的位置（{missing}），"
            "共 {n} 个；数量不一致的行：{rows}"
        ),
    },
    "rewards.variance": {
        "frac_reward_zero_std (groups that teach nothing)": (
            "frac_reward_zero_std（学不到东西的组所占比例）"
        ),
        "< 1 (some group varies)": "< 1（至少一组奖励有差异）",
    },
}

# What any check says when the functions under test raised (grpolab.checks.runner).
ANY_CHECK_ZH = {
    "the implementation raised": "你的实现抛出了异常",
    "no exception": "不抛出异常",
}


def check_name(check_id: str, lang: str) -> str:
    names = CHECK_NAMES.get(check_id)
    return names[lang] if names else check_id


def check_said(check_id: str, text: str | None, lang: str) -> str:
    """What check `check_id` measured or expects (`text`, as the check wrote it) in `lang`."""
    if lang == "en" or not text:
        return text or ""
    return translated(text, CHECK_ZH.get(check_id, {}) | ANY_CHECK_ZH)
