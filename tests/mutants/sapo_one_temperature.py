"""Bug: SAPO's gate with one temperature for both signs of the advantage (tau_pos for every
token): tokens with A <= 0 are gated as sharply as those with A > 0, which the soft gate's
asymmetry (sapo_temperature_neg) exists to avoid."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2, loss="clip",
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
):  # fmt: skip
    if loss != "sapo":
        return core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    ratio = torch.exp(torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new)))
    tau = sapo_temperature_pos  # should be the negative one where A <= 0
    gate = torch.sigmoid(tau * (ratio - 1))
    per_token = -gate * 4 / tau * advantages.unsqueeze(1)
    halved = (4 * gate * (1 - gate) < 0.5).float()
    return per_token, core.masked_mean(halved, mask)
