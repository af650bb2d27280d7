"""A learner's correct solution: the seed's code, plus temperature, position ids, masked
metrics and the loss_agg / max_completion_length arguments."""

import torch


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    logits = out.logits  # [B, T, V]

    # the off-by-one: logits at position t predict the token at t+1
    logits = logits[:, :-1, :]  # [B, T-1, V]
    targets = input_ids[:, 1:]  # [B, T-1]
    mask = completion_mask[:, 1:].float()  # [B, T-1]

    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logprobs = torch.gather(logprobs, dim=-1, index=targets.unsqueeze(-1)).squeeze(-1)
    return token_logprobs, mask


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.float().view(-1, group_size)  # [n_groups, G]
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)  # population std: divide by G
    if scale == "batch":
        adv = (r - mean) / (rewards.float().std(unbiased=False) + eps)
    elif scale == "none":
        adv = r - mean
    else:
        adv = (r - mean) / (std + eps)
    # a group that is all right or all wrong teaches nothing: exactly 0
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


def policy_loss(logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2):
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = torch.exp(logp_new - logp_old)  # [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # minus: we minimise
    with torch.no_grad():
        clip_frac = (((ratio * adv) > (clipped * adv)).float() * mask).sum() / mask.sum()
    return per_token, clip_frac


def kl_k3(logp_new, logp_ref):
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1


def aggregate(per_token, mask, mode, max_completion_length=None):
    if mode in ("sequence", "grpo"):
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if mode in ("token", "bnpo", "dapo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if mode in ("constant", "dr_grpo"):
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"unknown aggregation {mode!r}")


def grpo_loss(
    logp_new,
    logp_old,
    logp_ref,
    advantages,
    mask,
    eps_low=0.2,
    eps_high=0.28,
    beta=0.0,
    loss_agg="sequence",
    max_completion_length=None,
):
    per_token, clip_frac = policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    if beta > 0.0 and logp_ref is not None:
        per_token = per_token + beta * kl_k3(logp_new, logp_ref)
    loss = aggregate(per_token, mask, loss_agg, max_completion_length)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        ratio = torch.exp(logp_new - logp_old)
        adv = advantages.unsqueeze(1)
        low = ((ratio < 1 - eps_low) & (adv < 0)).float()
        high = ((ratio > 1 + eps_high) & (adv > 0)).float()
        kl = (kl_k3(logp_new, logp_ref) * mask).sum() / n if logp_ref is not None else 0.0
    return loss, {
        "loss": loss.item(),
        "clip_frac": clip_frac.item(),
        "clip_frac_low": ((low * mask).sum() / n).item(),
        "clip_frac_high": ((high * mask).sum() / n).item(),
        "kl": float(kl),
        "adv_std": advantages.std().item(),
        "ratio_mean": ((ratio * mask).sum() / n).item(),
    }
