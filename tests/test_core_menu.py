"""The profiles' conventions and the algorithm menu in the core: hand-derived values."""

import math

import pytest
import torch

from grpolab import core

# --- advantages --------------------------------------------------------------------------


def test_sample_std_divides_by_g_minus_1():
    # [0, 1]: sample std sqrt(0.5) = 0.7071068 -> adv = +-0.5 / (0.7071068 + 1e-4) = +-0.707007.
    adv = core.group_advantages(torch.tensor([0.0, 1.0]), 2, std="sample")
    torch.testing.assert_close(adv, torch.tensor([-0.707007, 0.707007]), atol=1e-6, rtol=0)


def test_without_the_zero_std_guard_a_noise_group_is_divided_by_std_plus_eps():
    # [0.5, 0.5 + 1e-9] x 2: population std 5e-10; (+-5e-10) / (5e-10 + 1e-4) = +-5.0e-6.
    r = torch.tensor([0.5, 0.5 + 1e-9, 0.5, 0.5 + 1e-9], dtype=torch.float64)
    assert torch.equal(core.group_advantages(r, 4), torch.zeros(4, dtype=torch.float64))
    adv = core.group_advantages(r, 4, zero_std_guard=False)
    torch.testing.assert_close(adv, torch.tensor([-5e-6, 5e-6, -5e-6, 5e-6], dtype=torch.float64))
    # An equal-reward group is exactly 0 either way: r - mean is 0.
    flat = core.group_advantages(torch.ones(4), 4, zero_std_guard=False)
    assert torch.equal(flat, torch.zeros(4))


def test_rloo_leaves_the_sample_out_of_its_baseline():
    # [1, 0, 0, 0]: A_0 = 1 - mean(0, 0, 0) = 1; A_i = 0 - mean(1, 0, 0) = -1/3.
    adv = core.group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_reinforce_pp_whitens_over_the_batch_weighted_by_tokens():
    # Groups [1, 0] and [3, 3]: centred [0.5, -0.5, 0, 0]. Equal weights: mean 0, variance
    # 0.5 / 4 = 0.125 -> [+-1.414214, 0, 0]. Lengths [1, 3, 1, 1]: mean (0.5 - 1.5) / 6 = -1/6,
    # variance (1 * (2/3)^2 + 3 * (1/3)^2 + 2 * (1/6)^2) / 6 = 0.138889, std 0.372678 ->
    # [1.788854, -0.894427, 0.447214, 0.447214] (no guard: the flat group moves too).
    r = torch.tensor([1.0, 0, 3, 3])
    adv = core.group_advantages(r, 2, estimator="reinforce_pp")
    torch.testing.assert_close(adv, torch.tensor([1.414214, -1.414214, 0, 0]), atol=1e-5, rtol=0)
    lengths = torch.tensor([1.0, 3, 1, 1])
    adv = core.group_advantages(
        r, 2, estimator="reinforce_pp", lengths=lengths, zero_std_guard=False
    )
    expected = torch.tensor([1.788854, -0.894427, 0.447214, 0.447214])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_informative_groups_and_truncation_mask():
    r = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0.5, 0.5 + 1e-9, 0.5, 0.5])
    assert core.informative_groups(r, 4).tolist() == [False, True, False]
    mask = torch.ones(3, 2)
    got = core.truncation_mask(mask, torch.tensor([False, True, False]))
    assert torch.equal(got, torch.tensor([[1.0, 1], [0, 0], [1, 1]]))


# --- the surrogate -----------------------------------------------------------------------


def test_gspo_one_clipped_ratio_per_sequence_from_the_mean_log_ratio():
    # Row 0: log-ratios 0.2 and 0.4 -> s = exp(0.3) = 1.349859, A = -1: the unclipped term
    # is active, -min(-1.349859, -1.2) = 1.349859 on both tokens (exp of the sum would be
    # exp(0.6)). Row 1: log-ratio -0.1 (one token), A = +1: s = 0.904837 -> -0.904837.
    logp_new = torch.tensor([[0.2, 0.4], [-0.1, 9.0]])
    mask = torch.tensor([[1.0, 1], [1, 0]])
    per_token, _ = core.policy_loss(
        logp_new, torch.zeros(2, 2), torch.tensor([-1.0, 1]), mask, 0.2, 0.2,
        importance_sampling_level="sequence",
    )  # fmt: skip
    torch.testing.assert_close(per_token[0], torch.tensor([1.349859, 1.349859]))
    assert per_token[1, 0].item() == pytest.approx(-0.904837, abs=1e-6)


def test_cispo_weight_is_the_detached_capped_ratio():
    # ratios e^0.5 = 1.648721 and e^2 = 7.389056 (capped at 5), A = 1, logp_new = -1 + log r:
    # per_token = -w * A * logp_new; d/dlogp_new = -w.
    log_r = torch.tensor([[0.5, 2.0]])
    logp_old = torch.full((1, 2), -1.0)
    logp_new = (logp_old + log_r).requires_grad_(True)
    per_token, capped = core.policy_loss(
        logp_new, logp_old, torch.ones(1), torch.ones(1, 2), 0.2, 5.0, loss="cispo"
    )
    w = torch.tensor([[1.648721, 5.0]])
    torch.testing.assert_close(per_token.detach(), -w * (logp_old + log_r), atol=1e-5, rtol=0)
    per_token.sum().backward()
    torch.testing.assert_close(logp_new.grad, -w, atol=1e-5, rtol=0)
    assert capped.item() == 0.5


def test_delta_and_dual_clip():
    # ratio 2.5 with A = -1: plain -min(-2.5, -1.2) = 2.5; delta 2 -> -min(-2, -1.2) = 2;
    # dual_clip 3 with ratio 4, A = -1 -> min(4, 3) = 3; with A = +1 untouched (-1.2).
    logp_new = torch.log(torch.tensor([[2.5], [4.0], [4.0]]))
    A, mask, old = torch.tensor([-1.0, -1, 1]), torch.ones(3, 1), torch.zeros(3, 1)
    plain, _ = core.policy_loss(logp_new, old, A, mask)
    with_delta, _ = core.policy_loss(logp_new, old, A, mask, delta=2.0)
    with_dual, _ = core.policy_loss(logp_new, old, A, mask, dual_clip=3.0)
    torch.testing.assert_close(plain.flatten(), torch.tensor([2.5, 4.0, -1.2]))
    torch.testing.assert_close(with_delta.flatten(), torch.tensor([2.0, 2.0, -1.2]))
    torch.testing.assert_close(with_dual.flatten(), torch.tensor([2.5, 3.0, -1.2]))


def test_log_ratio_clamp():
    # log-ratio 30 clamped to 20: the A = -1 token's loss is e^20 = 4.851652e8, finite.
    per_token, _ = core.policy_loss(
        torch.tensor([[30.0]]), torch.zeros(1, 1), -torch.ones(1), torch.ones(1, 1),
        log_ratio_clamp=20.0,
    )  # fmt: skip
    assert per_token.item() == pytest.approx(math.exp(20), rel=1e-6)


# --- KL, entropy, engine weights ----------------------------------------------------------


def test_kl_estimators_hand_values_and_clamp():
    # d = log 2: k1 = -log 2, k2 = (log 2)^2 / 2, k3 = 1 - log 2.
    new, ref = torch.zeros(1), torch.full((1,), math.log(2))
    assert core.kl_estimate(new, ref, "k1").item() == pytest.approx(-math.log(2), abs=1e-6)
    assert core.kl_estimate(new, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    assert core.kl_estimate(new, ref, "k3").item() == pytest.approx(1 - math.log(2), abs=1e-6)
    # d = 15 and 200: clamped to 10; d clamped to 20 first, so no overflow reaches the grad.
    new = torch.zeros(2, requires_grad=True)
    value = core.kl_estimate(new, torch.tensor([15.0, 200.0]), "k3", clamp=10.0)
    assert value.tolist() == [10.0, 10.0]
    value.sum().backward()
    assert torch.equal(new.grad, torch.zeros(2))


def test_bias_corrected_kl_is_k3_times_the_ratio():
    # One token: ratio 2 (logp_new = log 2, logp_old = 0), A = 0, d = ref - new = log 2:
    # loss = beta * 2 * (1 - log 2).
    new = torch.full((1, 1), math.log(2))
    ref = torch.full((1, 1), 2 * math.log(2))
    loss, m = core.grpo_loss(
        new, torch.zeros(1, 1), ref, torch.zeros(1), torch.ones(1, 1), beta=0.1,
        use_bias_correction_kl=True,
    )  # fmt: skip
    assert loss.item() == pytest.approx(0.1 * 2 * (1 - math.log(2)), abs=1e-6)
    assert m["kl"] == pytest.approx(1 - math.log(2), abs=1e-6)  # the metric is plain KL


def test_entropy_bonus_is_subtracted_and_reported():
    # One token at ratio 1 with A = 0: loss = -0.1 * 0.7 = -0.07; metric 0.7 (masked).
    entropy = torch.tensor([[0.7, 5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, m = core.grpo_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), None, torch.zeros(1), mask, entropy=entropy,
        entropy_coef=0.1,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-0.07, abs=1e-7)
    assert m["entropy"] == pytest.approx(0.7)
    assert core.token_entropy(torch.zeros(3, 4)).tolist() == pytest.approx([math.log(4)] * 3)


def test_tis_weight_modes():
    # Log-ratios trainer - engine: row 0 [0.5, 0.5] (sum 1: e = 2.718 <= 3), row 1 [1, 1.5]
    # (sum 2.5: e^2.5 = 12.18 > 3; per token e and e^1.5 = 4.48).
    trainer = torch.tensor([[0.5, 0.5], [1.0, 1.5]])
    engine, mask, e = torch.zeros(2, 2), torch.ones(2, 2), math.e
    seq_mask = core.tis_weights(trainer, engine, mask, 3.0, "sequence_mask")
    torch.testing.assert_close(seq_mask, torch.tensor([[e, e], [0.0, 0.0]]))
    seq_trunc = core.tis_weights(trainer, engine, mask, 3.0, "sequence_truncate")
    torch.testing.assert_close(seq_trunc, torch.tensor([[e, e], [3.0, 3.0]]))
    tok_mask = core.tis_weights(trainer, engine, mask, 3.0, "token_mask")
    torch.testing.assert_close(tok_mask, torch.tensor([[e**0.5, e**0.5], [e, 0.0]]))


# --- the objective --------------------------------------------------------------------------


def test_each_profile_resolves_to_a_valid_objective_and_card():
    for name, conventions in core.PROFILES.items():
        o = core.Objective(profile=name, **conventions, beta=0.04)
        card = core.objective_card(o)
        assert f"profile {name}" in card
        body = card.split("\n", 1)[1]  # below the header and its legend
        assert (" *" in body) == (name != "seed")
    trl = core.objective_card(core.Objective(profile="trl", **core.PROFILES["trl"], beta=0.1))
    assert "sample std" in trl and "G - 1" in trl and "importance ratio" in trl


def test_kwargs_name_only_what_differs_from_the_seed():
    seed = core.Objective()
    assert set(seed.loss_kwargs()) == {
        "eps_low", "eps_high", "beta", "loss_agg", "max_completion_length"
    }  # fmt: skip
    assert seed.advantage_kwargs() == {"scale": "group", "eps": 1e-4}
    trl = core.Objective(profile="trl", **core.PROFILES["trl"])
    assert trl.advantage_kwargs() == {
        "scale": "group", "eps": 1e-4, "std": "sample", "zero_std_guard": False
    }  # fmt: skip
    assert trl.loss_kwargs()["use_bias_correction_kl"] is True


def test_accepted_kwargs_drop_conventions_a_function_does_not_take():
    def seed_signature(rewards, group_size, scale="group", eps=1e-4):
        return rewards

    kwargs = {"scale": "group", "std": "sample", "estimator": "rloo"}
    # The convention is the function's own (the preflight checks it); the menu's option is
    # passed and fails loudly.
    assert core.accepted_kwargs(seed_signature, kwargs) == {"scale": "group", "estimator": "rloo"}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loss_type": "cispo"}, "epsilon_high=0.28: expected > 1 with loss_type=cispo"),
        ({"advantage_std": "biased"}, "advantage_std='biased'"),
        ({"advantage_estimator": "gae"}, "advantage_estimator='gae'"),
        ({"dual_clip": 0.5}, "dual_clip=0.5: expected a number > 1"),
        ({"delta": 1.0}, "delta=1.0: expected a number > 1"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level='batch'"),
        ({"kl_estimator": "k4"}, "kl_estimator='k4'"),
        ({"profile": "deepspeed"}, "profile='deepspeed'"),
        ({"tis_mode": "sequence"}, "tis_mode='sequence'"),
        ({"loss_type": "cispo", "epsilon_high": 5.0, "dual_clip": 3.0}, "dual_clip=3.0: expected"),
        ({"loss_type": "sapo", "delta": 2.0}, "delta=2.0: expected null with loss_type=sapo"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg=0.0"),
    ],
)
def test_objective_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        core.Objective(**fields)
