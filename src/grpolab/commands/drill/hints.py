"""Progressive hints: a nudge, then the concept, then the exact line, in English and Chinese.

Hints are keyed by the check that fails (so a failing advantages.zero_std_groups gives the
zero-std guard hints), and by "write.N" for a goal whose function is not written yet.
"""

from __future__ import annotations

# key -> three levels -> {"en": ..., "zh": ...}
HINTS: dict[str, list[dict[str, str]]] = {
    # --- Goals whose functions are not written yet ----------------------------------------
    "write.1": [
        {
            "en": "Write sequence_logprobs: forward the model, then pick out the log-prob of "
            "each token that was actually sampled.",
            "zh": "写 sequence_logprobs：模型前向一次，然后取出实际采样出的那些 token 的对数概率。",
        },
        {
            "en": "logits at position t predict the token at t+1: compare logits[:, :-1] with "
            "input_ids[:, 1:] and take the mask from completion_mask[:, 1:]. Divide the float32 "
            "logits by the temperature, log_softmax over the vocabulary, gather the targets.",
            "zh": "位置 t 的 logits 预测的是位置 t+1 的 token：logits[:, :-1] 配 input_ids[:, 1:]，"
            "mask 用 completion_mask[:, 1:]。logits 转 float32、除以温度，对词表做 log_softmax，"
            "再 gather 出目标 token。",
        },
        {
            "en": "logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)\n"
            "token_logprobs = torch.gather(logprobs, dim=-1, "
            "index=input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
            "return token_logprobs, completion_mask[:, 1:].float()",
            "zh": "logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)\n"
            "token_logprobs = torch.gather(logprobs, dim=-1, "
            "index=input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
            "return token_logprobs, completion_mask[:, 1:].float()",
        },
    ],
    "write.2": [
        {
            "en": "Write group_advantages: each reward compared with the other samples of the "
            "same prompt.",
            "zh": "写 group_advantages：每个奖励和同一个 prompt 的其他样本比较。",
        },
        {
            "en": "View the rewards as [n_groups, G] (the G samples of a prompt are contiguous), "
            "subtract each row's mean, divide by the row's population std + 1e-4, and set "
            "rows with std <= 1e-4 to exactly 0.",
            "zh": "把 rewards 看成 [n_groups, G]（同组样本连续排列），每行减去行均值，"
            "除以该行的总体标准差 + 1e-4；std <= 1e-4 的行显式归零。",
        },
        {
            "en": "r = rewards.view(-1, group_size)\n"
            "std = r.std(dim=1, unbiased=False, keepdim=True)\n"
            "adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-4)\n"
            "return torch.where(std > 1e-4, adv, torch.zeros_like(adv)).view(-1)",
            "zh": "r = rewards.view(-1, group_size)\n"
            "std = r.std(dim=1, unbiased=False, keepdim=True)\n"
            "adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-4)\n"
            "return torch.where(std > 1e-4, adv, torch.zeros_like(adv)).view(-1)",
        },
    ],
    "write.3": [
        {
            "en": "Goal 3 needs sequence_logprobs and grpo_loss (which returns ratio_mean): "
            "write those first.",
            "zh": "目标 3 需要 sequence_logprobs 和 grpo_loss（它返回 ratio_mean）：先写这两个。",
        },
        {
            "en": "The ratio is new policy over old policy per token. Right after sampling, "
            "before any update, the two are the same model: the ratio must be exactly 1.",
            "zh": "ratio 是每个 token 上新策略与旧策略之比。采样后、参数更新前，两者是同一个模型："
            "ratio 必须恒为 1。",
        },
        {
            "en": "ratio = torch.exp(logp_new - logp_old)",
            "zh": "ratio = torch.exp(logp_new - logp_old)",
        },
    ],
    "write.4": [
        {
            "en": "Write policy_loss: the PPO-style clipped surrogate, per token.",
            "zh": "写 policy_loss：逐 token 的裁剪代理损失（PPO 式）。",
        },
        {
            "en": "Broadcast the sequence's advantage to its tokens (advantages.unsqueeze(1)): "
            "score by sequence, take gradients by token. Take the min of the plain and the "
            "clipped term, and a minus sign because we minimise.",
            "zh": "序列级优势广播到 token 级（advantages.unsqueeze(1)）："
            "「按序列打分，按 token 求梯度」。"
            "对原始项和裁剪项取 min，加负号因为要最小化。",
        },
        {
            "en": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)\n"
            "per_token = -torch.min(ratio * adv, clipped * adv)",
            "zh": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)\n"
            "per_token = -torch.min(ratio * adv, clipped * adv)",
        },
    ],
    "write.5": [
        {
            "en": "Write kl_k3: a per-token KL estimate that is never negative.",
            "zh": "写 kl_k3：一个恒非负的逐 token KL 估计。",
        },
        {
            "en": "Not the naive logp_new - logp_ref (high variance, can be negative): "
            "Schulman's k3 estimator exp(d) - d - 1 with d = logp_ref - logp_new.",
            "zh": "不是朴素的 logp_new - logp_ref（方差大，可能为负）：用 Schulman 的 k3 估计 "
            "exp(d) - d - 1，其中 d = logp_ref - logp_new。",
        },
        {
            "en": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
            "zh": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
        },
    ],
    "write.6": [
        {
            "en": "Goal 6 needs aggregate and grpo_loss (and sequence_logprobs for the mask): "
            "write those first.",
            "zh": "目标 6 需要 aggregate 和 grpo_loss（以及提供 mask 的 sequence_logprobs）："
            "先写它们。",
        },
        {
            "en": "Token-mean and sequence-mean are not equivalent: choose by `mode`. Only "
            "masked (completion) tokens count, in the numerator and in the denominator.",
            "zh": "token 平权和序列平权不等价：按 mode 选择。分子和分母都只算 mask 内"
            "（completion）的 token。",
        },
        {
            "en": "sequence: ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1))"
            ".mean()\n"
            "token:    (per_token * mask).sum() / mask.sum()\n"
            "constant: (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)",
            "zh": "sequence: ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1))"
            ".mean()\n"
            "token:    (per_token * mask).sum() / mask.sum()\n"
            "constant: (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)",
        },
    ],
    "write.7": [
        {
            "en": "Write grpo_loss: it assembles policy_loss, kl_k3 and aggregate and returns "
            "the loss with its metrics.",
            "zh": "写 grpo_loss：把 policy_loss、kl_k3、aggregate 拼起来，返回 loss 和监控指标。",
        },
        {
            "en": "per_token from policy_loss; add beta * kl_k3 when beta > 0 and logp_ref is "
            "given; aggregate with loss_agg; then, without grad, the metrics: loss, clip_frac, "
            "kl, adv_std, ratio_mean (token statistics masked).",
            "zh": "policy_loss 给出 per_token；beta > 0 且有 logp_ref 时加上 beta * kl_k3；"
            "用 loss_agg 归一化；然后在 no_grad 下算指标：loss、clip_frac、kl、adv_std、"
            "ratio_mean（token 统计量要 mask）。",
        },
        {
            "en": "per_token, clip_frac = policy_loss(logp_new, logp_old, advantages, mask, "
            "eps_low, eps_high)\n"
            "if beta > 0.0 and logp_ref is not None:\n"
            "    per_token = per_token + beta * kl_k3(logp_new, logp_ref)\n"
            "loss = aggregate(per_token, mask, loss_agg, max_completion_length)",
            "zh": "per_token, clip_frac = policy_loss(logp_new, logp_old, advantages, mask, "
            "eps_low, eps_high)\n"
            "if beta > 0.0 and logp_ref is not None:\n"
            "    per_token = per_token + beta * kl_k3(logp_new, logp_ref)\n"
            "loss = aggregate(per_token, mask, loss_agg, max_completion_length)",
        },
    ],
    # --- Goal 1: log-probs ------------------------------------------------------------------
    "logprobs.shift": [
        {
            "en": "Your log-probs do not match the model's own cross-entropy on the completion: "
            "which logits score which token?",
            "zh": "你的 logprob 和模型自己在 completion 上的交叉熵对不上：哪个位置的 logits "
            "给哪个 token 打分？",
        },
        {
            "en": "The off-by-one: logits at position t predict the token at t+1. Drop the last "
            "logit, drop the first token, and shift the mask the same way.",
            "zh": "关键的错一位：位置 t 的 logits 预测的是位置 t+1 的 token。去掉最后一个 logits、"
            "去掉第一个 token，mask 也同样错一位。",
        },
        {
            "en": "logits = logits[:, :-1, :]   targets = input_ids[:, 1:]   "
            "mask = completion_mask[:, 1:]",
            "zh": "logits = logits[:, :-1, :]   targets = input_ids[:, 1:]   "
            "mask = completion_mask[:, 1:]",
        },
    ],
    "logprobs.float32": [
        {
            "en": "With a bf16 model your log-probs are off by far more than float32 rounding: "
            "in which dtype is the softmax computed?",
            "zh": "模型是 bf16 时，你的 logprob 误差远大于 float32 的舍入："
            "softmax 是在什么精度下算的？",
        },
        {
            "en": "bf16 log_softmax loses ~1e-2 per token, and exp(logp_new - logp_old) turns "
            "that into a ratio that is not 1. Cast the logits to float32 before log_softmax.",
            "zh": "bf16 的 log_softmax 每个 token 会丢掉约 1e-2 的精度，exp(logp_new - logp_old) "
            "会把它放大成不等于 1 的 ratio。log_softmax 前把 logits 转成 float32。",
        },
        {
            "en": "logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)",
            "zh": "logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)",
        },
    ],
    "logprobs.temperature": [
        {
            "en": "At temperature 0.7 your log-probs differ from the sampling policy's: "
            "where does `temperature` go?",
            "zh": "温度 0.7 时你的 logprob 和采样策略的不一致：参数 temperature 用在哪里？",
        },
        {
            "en": "The policy that sampled is softmax(logits / T). The ratio compares against "
            "that policy, so divide the logits by the temperature before log_softmax.",
            "zh": "采样的策略是 softmax(logits / T)。ratio 要和这个策略比，所以 log_softmax "
            "之前先把 logits 除以温度。",
        },
        {
            "en": "logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)",
            "zh": "logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)",
        },
    ],
    # --- Goal 2: advantages -----------------------------------------------------------------
    "advantages.group_sums": [
        {
            "en": "The advantages of a group should sum to ~0: each reward is compared with "
            "its own group only.",
            "zh": "一组的优势之和应该接近 0：每个奖励只和自己组内比较。",
        },
        {
            "en": "Subtract each group's own mean (a row mean of the [n_groups, G] view), not "
            "the batch mean.",
            "zh": "减去每组自己的均值（[n_groups, G] 视图的行均值），不是整个 batch 的均值。",
        },
        {
            "en": "r = rewards.view(-1, group_size)\nmean = r.mean(dim=1, keepdim=True)",
            "zh": "r = rewards.view(-1, group_size)\nmean = r.mean(dim=1, keepdim=True)",
        },
    ],
    "advantages.population_std": [
        {
            "en": "Within a group with spread, your advantages should have std 1: look at how "
            "the std is computed.",
            "zh": "有差异的组里，优势的标准差应该是 1：看看标准差是怎么算的。",
        },
        {
            "en": "The drill declares the population std (divide by G), grpolab's seed "
            "convention; torch's default std divides by G-1 (the sample std, what TRL, verl and "
            "OpenRLHF use: a convention, not a bug, but not the declared one here). The two "
            "differ by a factor sqrt(G/(G-1)): sqrt(4/3) on the check's designed rewards "
            "(G = 4), sqrt(8/7) on the real batch of `show 2` (G = 8).",
            "zh": "本练习约定用总体标准差（除 G），即 grpolab 种子实现的约定；torch 默认的 std "
            "除的是 G−1（样本标准差，TRL、verl、OpenRLHF 用的就是它：这是另一种约定，不是错误，"
            "但不是这里声明的约定）。两者差一个 sqrt(G/(G-1)) 的因子：检查所用的设计奖励"
            "（G = 4）上是 sqrt(4/3)，`show 2` 的真实 batch（G = 8）上是 sqrt(8/7)。",
        },
        {
            "en": "std = r.std(dim=1, unbiased=False, keepdim=True)",
            "zh": "std = r.std(dim=1, unbiased=False, keepdim=True)",
        },
    ],
    "advantages.zero_std_groups": [
        {
            "en": "A group where every reward is (almost) the same gets non-zero advantages "
            "from you. What should a group that is all right or all wrong teach?",
            "zh": "奖励（几乎）全相同的组，你给出了非零优势。一组全对或全错，应该学到什么？",
        },
        {
            "en": "The most important line: where std <= 1e-4 set the advantage to exactly 0. "
            "Otherwise a std of 1e-8 turns float noise into a huge advantage and one step "
            "blows the model up.",
            "zh": "这是最重要的一行：std <= 1e-4 时显式归零。没有它，如果 std 是 1e-8 这种极小值，"
            "就会算出巨大的优势值，一步把模型炸掉。",
        },
        {
            "en": "adv = torch.where(std > 1e-4, adv, torch.zeros_like(adv))",
            "zh": "adv = torch.where(std > 1e-4, adv, torch.zeros_like(adv))",
        },
    ],
    "advantages.contiguous": [
        {
            "en": "Your advantages mix samples of different prompts: which samples form a group?",
            "zh": "你的优势把不同 prompt 的样本混在一起了：哪些样本是一组？",
        },
        {
            "en": "The G samples of one prompt are contiguous (vLLM's n=G returns them "
            "together): group i is samples [i*G, (i+1)*G). view(-1, G) relies on it; "
            "view(G, -1) or a transpose reads the groups across prompts.",
            "zh": "同组样本必须连续排列（vLLM 的 n=G 会把同一个 prompt 的 G 条放在一起）："
            "第 i 组是样本 [i*G, (i+1)*G)。view(-1, G) 依赖这个假设；"
            "view(G, -1) 或转置会跨 prompt 分组。",
        },
        {
            "en": "r = rewards.view(-1, group_size)   # [n_groups, G]",
            "zh": "r = rewards.view(-1, group_size)   # [n_groups, G]",
        },
    ],
    # --- Goal 3: ratio ----------------------------------------------------------------------
    "ratio.initial": [
        {
            "en": "Before the first update the new and the old policy are the same model: "
            "your ratio is not 1 there.",
            "zh": "第一次更新之前，新旧策略是同一个模型：你的 ratio 在这里不等于 1。",
        },
        {
            "en": "logp_old comes from the same model, same inputs, same temperature, right "
            "after sampling (an extra forward). ratio = exp(logp_new - logp_old), "
            "and ratio_mean is its mean over the masked tokens.",
            "zh": "logp_old 来自同一个模型、同样的输入和温度，采样后立刻跑一次前向（方案 A）。"
            "ratio = exp(logp_new - logp_old)，ratio_mean 是它在 mask 内的均值。",
        },
        {
            "en": "ratio = torch.exp(logp_new - logp_old)\n"
            "assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3), ratio",
            "zh": "ratio = torch.exp(logp_new - logp_old)\n"
            "assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3), ratio",
        },
    ],
    # --- Goal 4: clip -----------------------------------------------------------------------
    "clip.values": [
        {
            "en": "Your per-token loss differs from the clipped surrogate on some tokens: "
            "check the sign and which of the two terms is taken.",
            "zh": "你的 per_token 在一些 token 上和裁剪代理损失不一致："
            "检查符号，以及取的是两项中的哪一项。",
        },
        {
            "en": "min makes the clip act in both directions: don't push good answers up too "
            "far, don't push bad answers down too hard. The minus sign is there because we "
            "minimise.",
            "zh": "min 让它对「好回答提太多」和「坏回答压太狠」都生效。负号：要最小化。",
        },
        {
            "en": "per_token = -torch.min(ratio * adv, clipped * adv)",
            "zh": "per_token = -torch.min(ratio * adv, clipped * adv)",
        },
    ],
    "clip.gradient": [
        {
            "en": "Clipped tokens still get a gradient (or unclipped ones get none).",
            "zh": "被裁剪的 token 仍然有梯度（或者没被裁剪的 token 没有梯度）。",
        },
        {
            "en": "Where the clipped term is the smaller one it is a constant: no gradient. "
            "That only holds with torch.min over the two terms and a clamp of the ratio.",
            "zh": "裁剪项更小时它是常数，没有梯度。"
            "只有对两项取 torch.min、并对 ratio 做 clamp 才成立。",
        },
        {
            "en": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)\n"
            "per_token = -torch.min(ratio * adv, clipped * adv)",
            "zh": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)\n"
            "per_token = -torch.min(ratio * adv, clipped * adv)",
        },
    ],
    "clip.asymmetric": [
        {
            "en": "Tokens whose ratio lies between 1 + eps_low and 1 + eps_high are treated "
            "wrongly: which eps bounds which side?",
            "zh": "ratio 落在 1 + eps_low 和 1 + eps_high 之间的 token 处理错了："
            "哪个 eps 管哪一侧？",
        },
        {
            "en": "Asymmetric clip (clip-higher, DAPO; 0.2 / 0.28): eps_low bounds the ratio "
            "from below, 1 - eps_low; eps_high from above, 1 + eps_high. The larger upper "
            "bound encourages exploration.",
            "zh": "非对称 clip（DAPO 的 clip-higher，0.2 / 0.28）：eps_low 管下界 1 - eps_low，"
            "eps_high 管上界 1 + eps_high。更大的上界鼓励探索。",
        },
        {
            "en": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)",
            "zh": "clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)",
        },
    ],
    "clip.clip_frac": [
        {
            "en": "clip_frac does not match a direct count of the clipped tokens.",
            "zh": "clip_frac 和直接数出来的被裁剪 token 比例不一致。",
        },
        {
            "en": "clip_frac is the fraction of completion tokens where the clipped term is the "
            "active one: count over the mask only, divide by the number of masked tokens.",
            "zh": "clip_frac 是裁剪项起作用的 completion token 的比例：只在 mask 内计数，"
            "除以 mask 内的 token 数。",
        },
        {
            "en": "clip_frac = (((ratio * adv) > (clipped * adv)).float() * mask).sum() / "
            "mask.sum()",
            "zh": "clip_frac = (((ratio * adv) > (clipped * adv)).float() * mask).sum() / "
            "mask.sum()",
        },
    ],
    # --- Goal 5: KL -------------------------------------------------------------------------
    "kl.nonnegative": [
        {
            "en": "Your KL estimate is negative on some tokens; a KL never is.",
            "zh": "你的 KL 估计在一些 token 上为负；KL 应该恒非负。",
        },
        {
            "en": "The naive logp_new - logp_ref has high variance and can be negative. "
            "Schulman's k3, exp(d) - d - 1, is >= 0 for every d (exp(d) >= 1 + d).",
            "zh": "朴素做法 logp_new - logp_ref 方差很大，而且可能为负。Schulman 的 k3，"
            "exp(d) - d - 1，对任何 d 都 >= 0（因为 exp(d) >= 1 + d）。",
        },
        {
            "en": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
            "zh": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
        },
    ],
    "kl.identical": [
        {
            "en": "Two identical policies give a non-zero KL in your code.",
            "zh": "两个相同的策略，你的代码给出了非零的 KL。",
        },
        {
            "en": "With logp_new == logp_ref, d = 0 and k3 = exp(0) - 0 - 1 = 0 exactly.",
            "zh": "logp_new == logp_ref 时 d = 0，k3 = exp(0) - 0 - 1 = 0，严格为 0。",
        },
        {
            "en": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
            "zh": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
        },
    ],
    "kl.tracks_exact": [
        {
            "en": "The mean of your estimate over samples of the new policy is not the true "
            "KL(new || ref): look at the sign of d.",
            "zh": "在新策略的样本上，你的估计的均值不等于真实的 KL(new || ref)：看看 d 的符号。",
        },
        {
            "en": "k3 is unbiased only with d = logp_ref - logp_new: then E_new[exp(d)] = 1 and "
            "E_new[-d] = KL(new || ref). The other sign estimates something else.",
            "zh": "只有 d = logp_ref - logp_new 时 k3 才无偏：此时 E_new[exp(d)] = 1，"
            "E_new[-d] = KL(new || ref)。符号反了估计的就是别的东西。",
        },
        {
            "en": "d = logp_ref - logp_new",
            "zh": "d = logp_ref - logp_new",
        },
    ],
    "kl.gradient": [
        {
            "en": "Your KL has the right value but not the right gradient: the KL term would "
            "not pull the policy back towards the reference.",
            "zh": "你的 KL 取值对，梯度却不对：这样的 KL 项不会把策略拉回参考策略。",
        },
        {
            "en": "Nothing around the estimate may stop the gradient: no torch.no_grad, no "
            ".detach() on logp_new or on exp(d). d(k3)/d(logp_new) is 1 - exp(d); only "
            "logp_ref, the reference, is a constant.",
            "zh": "估计值周围不能有任何东西截断梯度：不要 torch.no_grad，也不要对 logp_new 或 "
            "exp(d) 调用 .detach()。d(k3)/d(logp_new) = 1 - exp(d)；只有参考策略的 logp_ref "
            "是常数。",
        },
        {
            "en": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
            "zh": "d = logp_ref - logp_new\nreturn torch.exp(d) - d - 1",
        },
    ],
    # --- Goal 6: normalisation --------------------------------------------------------------
    "norm.aggregation": [
        {
            "en": "On sequences of unequal length your loss is not the declared aggregation "
            "(the drill declares sequence-mean, the default).",
            "zh": "在长度不等的序列上，你的 loss 不是声明的归一化方式（drill 声明的是序列平权，"
            "也是 seed 的选择）。",
        },
        {
            "en": "Token-mean and sequence-mean are not equivalent: with token-mean long answers "
            "weigh more. Sequence-mean averages each sequence first (divide by its own length), "
            "then averages sequences. grpo_loss must use aggregate(..., loss_agg).",
            "zh": "token 平权和序列平权不等价：token 平权下长回答权重更大。序列平权先在每条序列"
            "内部平均（除以自己的长度），再对序列平均。grpo_loss 要用 aggregate(..., loss_agg)。",
        },
        {
            "en": "loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()",
            "zh": "loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()",
        },
    ],
    "norm.masked_gradient": [
        {
            "en": "Prompt or padding tokens get a gradient from your loss.",
            "zh": "prompt 或 padding token 从你的 loss 得到了梯度。",
        },
        {
            "en": "Only completion tokens are trained. The mask is completion_mask shifted by "
            "one, not attention_mask (which also covers the prompt).",
            "zh": "只训练 completion token。mask 是错一位的 completion_mask，不是 attention_mask"
            "（它还覆盖了 prompt）。",
        },
        {
            "en": "mask = completion_mask[:, 1:]",
            "zh": "mask = completion_mask[:, 1:]",
        },
    ],
    "norm.eos": [
        {
            "en": "The EOS that ends a completion is left out of your mask: the model would "
            "never learn to stop.",
            "zh": "结束 completion 的 EOS 不在你的 mask 里：模型永远学不会停下来。",
        },
        {
            "en": "The EOS is a sampled token like any other. Padding is whatever follows it, "
            "and many tokenizers pad with the EOS id itself: find padding with "
            "completion_mask, never by comparing token ids.",
            "zh": "EOS 和其他采样出的 token 一样。padding 是它后面的东西，而很多分词器就用 EOS "
            "的 id 做 padding：用 completion_mask 找 padding，不要比较 token id。",
        },
        {
            "en": "mask = completion_mask[:, 1:].float()",
            "zh": "mask = completion_mask[:, 1:].float()",
        },
    ],
    # --- Goal 7: the assembled loss ---------------------------------------------------------
    "loss.finite": [
        {
            "en": "grpo_loss does not return a finite scalar loss.",
            "zh": "grpo_loss 没有返回一个有限的标量 loss。",
        },
        {
            "en": "Return (loss, metrics) with loss a 0-dim tensor: aggregate reduces [B, T] to "
            "a scalar. inf or NaN usually come from a division by a zero count.",
            "zh": "返回 (loss, metrics)，loss 是 0 维张量：aggregate 把 [B, T] 归约成标量。"
            "inf 或 NaN 通常来自除以为 0 的计数。",
        },
        {
            "en": "loss = aggregate(per_token, mask, loss_agg, max_completion_length)\n"
            "return loss, metrics",
            "zh": "loss = aggregate(per_token, mask, loss_agg, max_completion_length)\n"
            "return loss, metrics",
        },
    ],
    "loss.metrics": [
        {
            "en": "A metric (loss, clip_frac, kl or ratio_mean) differs from a direct masked "
            "computation.",
            "zh": "某个指标（loss、clip_frac、kl 或 ratio_mean）和直接在 mask 内算的结果不一致。",
        },
        {
            "en": "Token statistics are means over completion tokens only: padding has ratio "
            "exp(0) = 1 and would pull ratio_mean toward 1. Multiply by the mask and divide "
            "by mask.sum().",
            "zh": "token 统计量只在 completion token 上平均：padding 的 ratio 是 exp(0) = 1，"
            "会把 ratio_mean 拉向 1。乘以 mask，再除以 mask.sum()。",
        },
        {
            "en": '"ratio_mean": ((torch.exp(logp_new - logp_old) * mask).sum() / mask.sum())'
            ".item()",
            "zh": '"ratio_mean": ((torch.exp(logp_new - logp_old) * mask).sum() / mask.sum())'
            ".item()",
        },
    ],
    "loss.sgd_direction": [
        {
            "en": "One SGD step on your loss lowers the log-probs of positive-advantage "
            "completions: the loss points the wrong way.",
            "zh": "用你的 loss 做一步 SGD，正优势回答的 logprob 反而下降了：loss 的方向反了。",
        },
        {
            "en": "We minimise the loss, so per_token must be minus the surrogate: lowering "
            "-ratio * A raises the ratio where A > 0.",
            "zh": "我们最小化 loss，所以 per_token 要取代理目标的负值：降低 -ratio * A 就会在 "
            "A > 0 处提高 ratio。",
        },
        {
            "en": "per_token = -torch.min(ratio * adv, clipped * adv)   # minus: we minimise",
            "zh": "per_token = -torch.min(ratio * adv, clipped * adv)   # 负号：要最小化",
        },
    ],
}

LEVELS = 3


def hint_text(key: str, level: int, lang: str) -> str:
    """The hint `key` at `level` (1..3)."""
    return HINTS[key][level - 1][lang]


def next_level(seen: int) -> int:
    """The level to show after `seen` levels were shown (stays at the last one)."""
    return min(seen + 1, LEVELS)
