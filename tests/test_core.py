"""The core on small tensors: hand-derived values, properties, and every input error."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import EPS64

from grpolab import core, objective

# --- group_advantages ---------------------------------------------------------------------


def test_group_advantages_hand_values():
    # Group [1, 0, 0, 0]: mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330127.
    # adv = (r - 0.25) / (0.4330127 + 1e-4) -> 0.75 / 0.4331127 = 1.731650, -0.25 / ... = -0.577217.
    # Group [2, 2, 2, 2]: std 0 -> exactly 0.
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2])
    adv = core.group_advantages(rewards, group_size=4)
    expected = torch.tensor([1.731650, -0.577217, -0.577217, -0.577217, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert adv.shape == (8,)


def test_group_advantages_population_not_sample_std():
    # [0, 1]: population std 0.5 -> adv = +-0.5 / 0.5001 = +-0.99980; sample std would give 0.7070.
    adv = core.group_advantages(torch.tensor([0.0, 1.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([-0.99980, 0.99980]), atol=1e-5, rtol=0)


def test_group_advantages_float_noise_group_is_exactly_zero():
    # Rewards differing by 1e-9 (float64 keeps the difference): std 5e-10 <= eps -> exactly 0,
    # where the unguarded formula would give +-5e-10 / (5e-10 + ...) noise.
    rewards = torch.tensor([0.5, 0.5 + 1e-9, 0.5, 0.5 + 1e-9], dtype=torch.float64)
    adv = core.group_advantages(rewards, group_size=4, eps=1e-12)
    assert adv.abs().max() > 0.5  # with a tiny eps the noise group blows up...
    adv = core.group_advantages(rewards, group_size=4)
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))  # ...the default guard zeroes it


def test_group_advantages_batch_and_none_scales():
    # Batch [1, 0, 3, 3]: group means 0.5 and 3; centred [0.5, -0.5, 0, 0].
    # Batch population std: mean 1.75; squared deviations 0.5625, 3.0625, 1.5625, 1.5625 -> var
    # 1.6875, std 1.299038. "batch": 0.5 / (1.299038 + 1e-4) = 0.384870. "none": centred only.
    rewards = torch.tensor([1.0, 0, 3, 3])
    batch = core.group_advantages(rewards, 2, scale="batch")
    torch.testing.assert_close(batch, torch.tensor([0.384870, -0.384870, 0, 0]), atol=1e-5, rtol=0)
    none = core.group_advantages(rewards, 2, scale="none")
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, 0, 0]))


def test_group_advantages_groups_are_contiguous():
    # Group 0 is the first G entries: an interleaved layout gives a different answer.
    rewards = torch.tensor([1.0, 1, 0, 0])  # groups [1, 1] and [0, 0] -> all zero
    assert torch.equal(core.group_advantages(rewards, 2), torch.zeros(4))


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 6),
    G=st.integers(2, 8),
    data=st.data(),
    scale=st.sampled_from(objective.choices("scale_rewards")),
)
def test_group_sums_are_zero(groups, G, data, scale):
    values = data.draw(st.lists(st.floats(-10, 10), min_size=groups * G, max_size=groups * G))
    rewards = torch.tensor(values, dtype=torch.float64)
    adv = core.group_advantages(rewards, G, scale=scale).view(groups, G)
    assert adv.sum(dim=1).abs().max() < 1e-9 * max(1.0, adv.abs().max().item() * G)
    stds = rewards.view(groups, G).std(dim=1, unbiased=False)
    if scale == "group":  # groups that teach something have population std ~1
        for std, row in zip(stds, adv, strict=True):
            if std > 1e-2:
                assert abs(row.std(unbiased=False).item() - 1) < 1e-2


# --- policy_loss --------------------------------------------------------------------------


def _clip_case():
    # Four tokens of four sequences, ratios 1.5 / 0.5 / 1.5 / 0.5, advantages +1 / -1 / -1 / +1.
    # eps_low 0.2, eps_high 0.2 -> clip to [0.8, 1.2]:
    #   A=+1, r=1.5: -min(1.5, 1.2) = -1.2  (clipped, high side)
    #   A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped, low side)
    #   A=-1, r=1.5: -min(-1.5, -1.2) = 1.5 (unclipped term active)
    #   A=+1, r=0.5: -min(0.5, 0.8) = -0.5 (unclipped term active)
    logp_old = torch.zeros(4, 1)
    logp_new = torch.log(torch.tensor([[1.5], [0.5], [1.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    return logp_new, logp_old, adv, torch.ones(4, 1)


def test_policy_loss_hand_values():
    logp_new, logp_old, adv, mask = _clip_case()
    per_token, clip_frac = core.policy_loss(logp_new, logp_old, adv, mask)
    torch.testing.assert_close(per_token, torch.tensor([[-1.2], [0.8], [1.5], [-0.5]]))
    assert clip_frac.item() == pytest.approx(0.5)


def test_policy_loss_clipped_tokens_get_zero_gradient():
    logp_new, logp_old, adv, mask = _clip_case()
    logp_new.requires_grad_(True)
    per_token, _ = core.policy_loss(logp_new, logp_old, adv, mask)
    per_token.sum().backward()
    grad = logp_new.grad.flatten()
    # d(-A * r)/dlogp = -A * r for the active unclipped term; 0 where the clip is active.
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1.5, -0.5]))


def test_policy_loss_asymmetric_eps_applies_to_the_right_side():
    # eps_low 0.1, eps_high 0.3: r=1.25 with A>0 is inside [0.9, 1.3] (not clipped);
    # r=0.85 with A<0 is below 0.9 (clipped). Swapping the eps would flip both.
    logp_new = torch.log(torch.tensor([[1.25], [0.85]]))
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    per_token, clip_frac = core.policy_loss(logp_new, torch.zeros(2, 1), adv, mask, 0.1, 0.3)
    torch.testing.assert_close(per_token, torch.tensor([[-1.25], [0.9]]))
    assert clip_frac.item() == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
)
def test_clipped_side_has_zero_gradient_other_side_not(B, T, seed, eps_low, eps_high):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp_new = (logp_old + torch.randn(B, T, generator=g) * 0.5).requires_grad_(True)
    adv = torch.randn(B, generator=g)
    per_token, _ = core.policy_loss(logp_new, logp_old, adv, torch.ones(B, T), eps_low, eps_high)
    per_token.sum().backward()
    ratio = torch.exp(logp_new - logp_old).detach()
    A = adv.unsqueeze(1).expand(B, T)
    high = (A > 0) & (ratio > 1 + eps_high)  # pushing a good answer up too far: clipped
    low = (A < 0) & (ratio < 1 - eps_low)  # pushing a bad answer down too hard: clipped
    active = high | low
    assert torch.all(logp_new.grad[active] == 0)
    # Everywhere else the unclipped term is active: gradient -A * ratio.
    torch.testing.assert_close(logp_new.grad[~active], (-A * ratio)[~active])


# --- kl_k3 --------------------------------------------------------------------------------


def test_kl_k3_hand_value():
    # d = log 2 - 0: exp(log 2) - log 2 - 1 = 1 - ln 2 = 0.3068528.
    kl = core.kl_k3(torch.zeros(1, 1), torch.full((1, 1), math.log(2)))
    assert kl.item() == pytest.approx(1 - math.log(2), abs=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(-20, 0), min_size=1, max_size=16),
    st.lists(st.floats(-20, 0), min_size=16, max_size=16),
)
def test_kl_k3_nonnegative_and_zero_when_equal(new, ref):
    logp_new = torch.tensor(new, dtype=torch.float64)
    logp_ref = torch.tensor(ref[: len(new)], dtype=torch.float64)
    # exp(d) - d - 1 >= 0 exactly; in float64 its three terms (e^d, |d|, 1) round by up to eps64
    # each, and near d = 0 the true value d^2 / 2 is smaller than that (d = 7e-11 gave -1e-16).
    d = logp_ref - logp_new
    assert torch.all(core.kl_k3(logp_new, logp_ref) >= -2 * EPS64 * (d.exp() + d.abs() + 1))
    assert torch.all(core.kl_k3(logp_new, logp_new) == 0)  # d = 0: exp(0) - 0 - 1 is exact


def test_kl_k3_is_unbiased_for_the_true_kl():
    # Samples from p = softmax(a); k3 with d = log q - log p averages to KL(p || q).
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(10, generator=g), 0)
    logq = torch.log_softmax(torch.randn(10, generator=g), 0)
    exact = (logp.exp() * (logp - logq)).sum()
    idx = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    estimate = core.kl_k3(logp[idx], logq[idx]).mean()
    # 2% of this KL is 8.6 standard errors of the 200,000-sample mean (float32 rounding of the
    # mean is ~1e-7 relative): a statistical tolerance, not a rounding one.
    assert estimate.item() == pytest.approx(exact.item(), rel=0.02)
    reversed_estimate = core.kl_k3(logq[idx], logp[idx]).mean()  # the classic sign bug
    assert abs(reversed_estimate.item() - exact.item()) > 0.05 * exact.item()


# --- aggregate ----------------------------------------------------------------------------


def test_aggregate_hand_values():
    # Rows [1, 2, 3] (3 tokens) and [4, x, x] (1 token):
    # sequence = (6/3 + 4/1) / 2 = 3; token = 10 / 4 = 2.5; constant (L=3) = 10 / (2 * 3).
    per_token = torch.tensor([[1.0, 2, 3], [4, 99, -99]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert core.aggregate(per_token, mask, "sequence").item() == pytest.approx(3.0)
    assert core.aggregate(per_token, mask, "token").item() == pytest.approx(2.5)
    assert core.aggregate(per_token, mask, "constant", 3).item() == pytest.approx(10 / 6)
    # TRL's names map onto the same normalisers.
    assert core.aggregate(per_token, mask, "grpo").item() == pytest.approx(3.0)
    assert core.aggregate(per_token, mask, "dapo").item() == pytest.approx(2.5)
    assert core.aggregate(per_token, mask, "dr_grpo", 3).item() == pytest.approx(10 / 6)


def test_aggregate_empty_sequence_counts_as_zero_not_nan():
    per_token, mask = torch.ones(2, 3), torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert core.aggregate(per_token, mask, "sequence").item() == pytest.approx(0.5)
    assert core.aggregate(per_token, mask, "token").item() == pytest.approx(1.0)


# --- grpo_loss ----------------------------------------------------------------------------


def test_grpo_loss_hand_values_and_masked_metrics():
    # Sequence 0: tokens with ratio 1.5 (A=+1) and padding; sequence 1: ratio 0.5 (A=-1)
    # and ratio 1 (A=-1). eps 0.2 / 0.28 -> clip [0.8, 1.28].
    # per-token: seq0 -min(1.5, 1.28) = -1.28; seq1 -min(-0.5, -0.8) = 0.8 and -min(-1, -1) = 1.
    # sequence mean: (-1.28 + (0.8 + 1) / 2) / 2 = -0.19.
    # clip: 2 of 3 tokens clipped (1 high, 1 low). ratio_mean over 3 tokens = 1.0.
    logp_old = torch.zeros(2, 2)
    logp_new = torch.log(torch.tensor([[1.5, 50.0], [0.5, 1.0]]))  # 50 sits on padding
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = core.grpo_loss(logp_new, logp_old, None, adv, mask)
    assert loss.item() == pytest.approx(-0.19, abs=1e-6)
    assert m["loss"] == pytest.approx(-0.19, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["clip_frac_low"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx(1.0)  # the seed's unmasked mean would be 13.25
    assert m["kl"] == 0.0
    assert m["adv_std"] == pytest.approx(math.sqrt(2))


def test_grpo_loss_with_kl_penalty():
    # One token, ratio 1 (no clip), A = 0 -> policy term 0; d = log(2): k3 = 1 - ln 2.
    # loss = beta * k3 = 0.1 * 0.3068528.
    logp = torch.zeros(1, 1)
    logp_ref = torch.full((1, 1), math.log(2))
    loss, m = core.grpo_loss(logp, logp, logp_ref, torch.zeros(1), torch.ones(1, 1), beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)), abs=1e-6)
    assert m["kl"] == pytest.approx(1 - math.log(2), abs=1e-6)


def test_grpo_loss_aggregations_differ_on_unequal_lengths():
    logp_old = torch.zeros(2, 4)
    logp_new = torch.full((2, 4), 0.1)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5])
    losses = {
        mode: core.grpo_loss(
            logp_new, logp_old, None, adv, mask, loss_agg=mode, max_completion_length=4
        )[0].item()
        for mode in core.AGGREGATIONS
    }
    assert len({round(v, 6) for v in losses.values()}) == 3, losses


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(core.AGGREGATIONS),
    beta=st.sampled_from([0.0, 0.05]),
    garbage=st.sampled_from([1e3, -1e3, float("inf"), float("nan")]),
)
def test_masked_positions_change_neither_loss_nor_gradient(seed, mode, beta, garbage):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    logp_old = -torch.rand(B, T, generator=g) * 2
    logp_new = logp_old + 0.3 * torch.randn(B, T, generator=g)
    logp_ref = logp_old + 0.2 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[:, 0] = 1
    adv = torch.randn(B, generator=g)

    def loss_and_grad(fill):
        new = torch.where(mask.bool(), logp_new, torch.full_like(logp_new, fill))
        new.requires_grad_(True)
        old = torch.where(mask.bool(), logp_old, torch.full_like(logp_old, -fill))
        ref = torch.where(mask.bool(), logp_ref, torch.full_like(logp_ref, fill))
        loss, _ = core.grpo_loss(
            new, old, ref, adv, mask, beta=beta, loss_agg=mode, max_completion_length=T
        )
        loss.backward()
        return loss.detach(), new.grad

    loss_a, grad_a = loss_and_grad(0.0)
    loss_b, grad_b = loss_and_grad(garbage)
    assert torch.isfinite(loss_b)
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(grad_a, grad_b)
    assert torch.all(grad_b[~mask.bool()] == 0)


def test_one_sgd_step_raises_positive_and_lowers_negative_advantage_logprobs():
    logits = torch.zeros(2, 3, 5, requires_grad=True)  # a free "policy" over 5 tokens
    targets = torch.tensor([[1, 2, 3], [1, 2, 3]])
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss, _ = core.grpo_loss(logp, logp.detach(), None, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss.backward()
    with torch.no_grad():
        new = torch.log_softmax(logits - 0.5 * logits.grad, -1).gather(-1, targets.unsqueeze(-1))
    new = new.squeeze(-1)
    assert torch.all(new[0] > logp[0]) and torch.all(new[1] < logp[1])


# --- objective card -----------------------------------------------------------------------


def test_objective_card_states_the_resolved_objective():
    card = core.objective_card(
        {"loss_type": "dr_grpo", "max_completion_length": 64, "beta": 0.04, "epsilon_high": 0.3}
    )
    for fact in [
        "constant",
        "B * 64",
        "population std",
        "k3",
        "0.04",
        "[0.8, 1.3]",
        "extra forward",
    ]:
        assert fact in card, fact
    assert "off" in core.objective_card(core.Objective())


def test_objective_card_reads_any_config_object():
    class TrainerConfig:  # a trainer config carrying some of the fields under TRL's names
        num_generations = 16
        scale_rewards = "none"
        logprob_source = "engine"

    card = core.objective_card(TrainerConfig())
    assert "G = 16" in card and "Dr. GRPO" in card and "engine's log-probs" in card


# --- input errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: core.group_advantages(torch.ones(10), 4), "rewards.numel()=10"),
        (lambda: core.group_advantages(torch.ones(10), 4), "group_size=4"),
        (lambda: core.group_advantages(torch.ones(4), 1), "group_size must be an int >= 2, got 1"),
        (lambda: core.group_advantages(torch.tensor([1.0, float("nan")]), 2), "indices [1]"),
        (lambda: core.group_advantages(torch.tensor([1.0, float("inf")]), 2), "finite"),
        (lambda: core.group_advantages(torch.ones(4), 2, scale="std"), "'group', 'batch', 'none'"),
        (lambda: core.group_advantages(torch.ones(2, 2), 2), "1-D"),
        (
            lambda: core.policy_loss(
                torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3)
            ),
            "logp_old (2, 4)",
        ),
        (
            lambda: core.policy_loss(
                torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3)
            ),
            "advantages (3,)",
        ),
        (
            lambda: core.grpo_loss(
                torch.zeros(2, 3), torch.zeros(2, 3), None, torch.zeros(2), torch.ones(2, 2)
            ),
            "mask (2, 2)",
        ),
        (
            lambda: core.grpo_loss(
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                None,
                torch.zeros(2),
                torch.ones(2, 3),
                beta=0.1,
            ),
            "beta=0.1 > 0 needs logp_ref",
        ),
        (
            lambda: core.aggregate(torch.zeros(2, 3), torch.ones(2, 3), "mean"),
            "'sequence', 'token', 'constant'",
        ),
        (
            lambda: core.aggregate(torch.zeros(2, 3), torch.ones(2, 3), "constant"),
            "max_completion_length",
        ),
        (
            lambda: core.grpo_loss(
                torch.zeros(1, 2),
                torch.zeros(1, 2),
                None,
                torch.zeros(1),
                torch.ones(1, 2),
                loss_agg="constant",
            ),
            "max_completion_length",
        ),
        (lambda: core.kl_k3(torch.zeros(2), torch.zeros(3)), "logp_ref (3,)"),
        (lambda: core.policy_loss(*_clip_case(), eps_low=1.5), "eps_low"),
        (lambda: core.objective_card({"loss_typ": "token"}), "unknown objective keys ['loss_typ']"),
        (lambda: core.objective_card({"scale_rewards": "median"}), "scale_rewards='median'"),
    ],
)
def test_errors_name_the_values(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


# --- truncated importance sampling ------------------------------------------------------------


def test_tis_weights_hand_values():
    # pi_trainer / pi_engine = exp(0.5), exp(-0.5), exp(2) -> 1.6487, 0.6065, capped at 2;
    # the masked position is 1.
    trainer = torch.tensor([[0.5, -0.5, 2.0, 7.0]])
    engine = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = core.tis_weights(trainer, engine, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.648721, 0.606531, 2.0, 1.0]]))


def test_grpo_loss_token_weights_scale_the_policy_term_only():
    # Ratio 1, A = +1 -> policy term -1 per token; weights 0.5 and 2 -> -0.5 and -2;
    # sequence mean -1.25. The KL term (beta 0.1, d = log 2) is not weighted: + 0.1 * 0.30685.
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(2))
    weights = torch.tensor([[0.5, 2.0]])
    mask, adv = torch.ones(1, 2), torch.ones(1)
    loss, _ = core.grpo_loss(logp, logp, ref, adv, mask, beta=0.1, token_weights=weights)
    assert loss.item() == pytest.approx(-1.25 + 0.1 * (1 - math.log(2)), abs=1e-6)
    plain, _ = core.grpo_loss(logp, logp, ref, adv, mask, beta=0.1)
    same, _ = core.grpo_loss(logp, logp, ref, adv, mask, beta=0.1, token_weights=torch.ones(1, 2))
    assert same.item() == plain.item()  # x * 1.0 is exact: the same value, bit for bit
    with pytest.raises(ValueError, match=r"token_weights \(1, 3\)"):
        core.grpo_loss(logp, logp, ref, adv, mask, beta=0.1, token_weights=torch.ones(1, 3))


def test_excluded_rows_do_not_vote():
    # NeMo-RL PR #4160's case: [1, 0, 0] and a masked row that must not move the statistics.
    valid = torch.tensor([True, True, True, False])
    centred = core.group_advantages(torch.tensor([1.0, 0, 0, 9]), 4, scale="none", valid=valid)
    assert torch.allclose(centred, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0]), atol=1e-7)
    assert centred[3] == 0.0
    # The valid rows get what a group of only them gets, under every estimator; the
    # excluded rows exactly 0, whatever their reward.
    rewards = torch.tensor([1.0, 0, 0, 5, -3, 0.5, 1, 0], dtype=torch.float64)
    valid = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    for kwargs in ({}, {"std": "sample", "zero_std_guard": False}, {"estimator": "rloo"}):
        adv = core.group_advantages(rewards, 4, valid=valid, **kwargs)
        alone = core.group_advantages(rewards[valid], 3, **kwargs)
        assert torch.allclose(adv[valid], alone, atol=1e-12, rtol=0)
        assert (adv[~valid] == 0).all()
    # A group with one valid row has no spread to learn from; all valid = the plain call.
    one = core.group_advantages(rewards, 4, valid=torch.tensor([1, 0, 0, 0] * 2).bool())
    assert (one == 0).all()
    assert torch.equal(
        core.group_advantages(rewards, 4, valid=torch.ones(8, dtype=torch.bool)),
        core.group_advantages(rewards, 4),
    )


@pytest.mark.parametrize("loss_type", ["sequence", "token", "constant"])
@pytest.mark.parametrize("micro", [1, 2, 3, 5])
def test_micro_batches_with_rows_out_of_the_loss_equal_the_loss_over_its_rows(loss_type, micro):
    # Rows 1 and 4 are out of the loss (truncation masking, dynamic sampling's fill): their
    # mask is 0. Accumulating the micro-batches' losses with the trainer's scaling must give
    # the gradient of the declared loss over the rows in the loss alone, in float64.
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([4, 6, 1, 3, 5, 2])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()  # [6, 6]
    mask[[1, 4]] = 0.0
    per_token = torch.randn(6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    in_loss = mask.sum(1) > 0
    L = 6
    core.aggregate(per_token[in_loss], mask[in_loss], loss_type, L).backward()
    expected, per_token.grad = per_token.grad.clone(), None
    for start in range(0, 6, micro):
        rows = slice(start, start + micro)
        share = core.micro_batch_scale(loss_type, mask[rows], mask)
        (core.aggregate(per_token[rows], mask[rows], loss_type, L) * share).backward()
    assert torch.allclose(per_token.grad, expected, rtol=0, atol=16 * EPS64)
