"""The profiles and the menu in a real training step: config resolution, dynamic sampling,
truncated completions, and what a user's functions must take."""

import copy
import inspect
from pathlib import Path

import pytest
import torch

from grpolab import core
from grpolab.config import ConfigError, load_config
from grpolab.functions import as_called, load_impl
from grpolab.model.policy import build_char_tokenizer, build_tiny_model
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import cat_rollouts, grpo_step

MUTANTS = Path(__file__).parent / "mutants"
TINY = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "rollout.max_completion_length=6",
    "eval.eval_examples=0",
]


def _run(tmp_path, *overrides, functions=None):
    cfg = load_config(None, [f"output_dir={tmp_path}", *TINY, *overrides])
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    return build_run(cfg, model, tokenizer, functions=functions)


def test_a_profile_sets_its_conventions_and_explicit_keys_win():
    trl = load_config(None, ["objective.profile=trl"]).objective
    assert (trl.advantage_std, trl.zero_std_guard, trl.loss_type) == ("sample", False, "dapo")
    assert (trl.epsilon_high, trl.use_bias_correction_kl) == (0.2, True)
    mine = load_config(None, ["objective.epsilon_high=0.28", "objective.profile=verl"]).objective
    assert mine.epsilon_high == 0.28 and mine.dual_clip == 3.0 and mine.advantage_eps == 1e-6
    seed = load_config(None, []).objective
    assert (seed.advantage_std, seed.loss_type, seed.epsilon_high) == (
        "population",
        "sequence",
        0.28,
    )
    card = core.objective_card(load_config(None, ["objective.profile=openrlhf"]).objective)
    assert "profile openrlhf" in card and "1e-09" in card


@pytest.mark.parametrize(
    "override, key",
    [
        ("objective.profile=deepseek", "objective.profile"),
        ("objective.advantage_std=biased", "objective.advantage_std"),
        ("objective.loss_type=cispo", "objective.epsilon_high"),
        ("objective.dual_clip=1", "objective.dual_clip"),
        ("objective.tis_mode=sequence_mask", "objective.tis_mode"),
        ("objective.dynamic_sampling_max_rounds=-1", "objective.dynamic_sampling_max_rounds"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_rollouts_of_different_widths_concatenate_without_moving_a_logprob():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    engine = HFEngine(model, tokenizer)
    short = engine.generate(["1+1="], 2, SamplingParams(max_completion_length=3, seed=0))
    long = engine.generate(["37+48=", "5+5="], 2, SamplingParams(max_completion_length=7, seed=1))
    both = cat_rollouts([short, long.rows(slice(0, 2)), long.rows(slice(2, 4))])
    assert both.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.prompts == short.prompts + long.prompts
    with torch.no_grad():
        parts = [
            core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
            for r in (short, long)
        ]
        whole, mask = core.sequence_logprobs(
            model, both.input_ids, both.attention_mask, both.completion_mask
        )
    for rows, (logp, part_mask) in zip((slice(0, 2), slice(2, 6)), parts, strict=True):
        got = whole[rows][mask[rows].bool()]
        torch.testing.assert_close(got, logp[part_mask.bool()], atol=1e-5, rtol=0)
    assert torch.equal(both.completion_mask.sum(1)[2:], long.completion_mask.sum(1))


def test_dynamic_sampling_keeps_informative_groups_out_of_flat_ones(tmp_path):
    run = _run(
        tmp_path, "objective.dynamic_sampling=true", "objective.dynamic_sampling_max_rounds=3"
    )
    metrics, batch = grpo_step(run, 1)
    kept, filled = metrics["dynamic/groups_kept"], metrics["dynamic/groups_filled"]
    assert kept + filled == 4 and metrics["dynamic/groups_generated"] >= 4
    assert metrics["dynamic/groups_generated"] <= 4 * (1 + 3)
    std = batch.rewards.view(-1, 4).std(dim=1, unbiased=False)
    in_loss = batch.loss_rows.view(-1, 4)[:, 0].bool()
    assert in_loss.sum() == kept and bool((std[in_loss] > 1e-4).all())
    assert bool((std[~in_loss] <= 1e-4).all())  # the fill: no variance, out of the loss


NOISY = """
import random

def noisy(completions, **kwargs):
    with open({log!r}, "a") as f:
        f.write(f"{{len(completions)}}\\n")
    return [float(random.random() < 0.5) for _ in completions]
"""


def test_dynamic_sampling_trains_each_group_on_the_scores_it_was_kept_for(tmp_path):
    # A stochastic reward (a coin per sample: a group of 4 is flat 1 time in 8) scored
    # again after the choice could make a kept group flat in the loss; scored once, never.
    log = tmp_path / "calls.txt"
    (tmp_path / "noisy.py").write_text(NOISY.format(log=str(log)))
    run = _run(
        tmp_path / "run", "objective.dynamic_sampling=true",
        "objective.dynamic_sampling_max_rounds=3",
        f"rewards.functions=[{tmp_path / 'noisy.py'}:noisy]",
    )  # fmt: skip
    for step in (1, 2, 3):
        log.write_text("")
        metrics, batch = grpo_step(run, step)
        called = sum(int(n) for n in log.read_text().split())
        assert called == metrics["dynamic/groups_generated"] * 4  # each sample scored once
        in_loss = batch.loss_rows.view(-1, 4)[:, 0].bool()
        std = batch.rewards.view(-1, 4).std(dim=1, unbiased=False)
        assert in_loss.sum() == metrics["dynamic/groups_kept"]
        assert bool((std[in_loss] > 1e-4).all())  # a kept group varies in the loss


def test_a_step_whose_rows_all_lack_gradient_runs_under_a_token_budget(tmp_path):
    # Every group flat (a constant reward): every row is skipped, each micro-batch's cut is
    # left empty before it is packed; the step updates nothing and goes on.
    (tmp_path / "flat.py").write_text("def flat(completions, **kwargs):\n"
                                      "    return [1.0 for _ in completions]\n")  # fmt: skip
    run = _run(
        tmp_path / "run", "batch.max_tokens_per_microbatch=64",
        f"rewards.functions=[{tmp_path / 'flat.py'}:flat]",
    )  # fmt: skip
    before = [p.detach().clone() for p in run.model.parameters()]
    metrics, batch = grpo_step(run, 1)
    assert bool(batch.skip_rows.all()) and metrics["frac_reward_zero_std"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, run.model.parameters(), strict=True))


def test_truncated_completions_leave_the_loss(tmp_path):
    run = _run(
        tmp_path, "objective.mask_truncated_completions=true", "rollout.max_completion_length=3"
    )
    _, batch = grpo_step(run, 1)
    assert batch.rollout.truncated.any()
    assert batch.loss_rows.tolist() == (~batch.rollout.truncated).float().tolist()
    # Out of the loss, out of the vote: advantage exactly 0, and the rest centred without them.
    truncated = batch.rollout.truncated
    assert (batch.advantages[truncated] == 0).all()
    for g in range(4):
        rows = torch.arange(g * 4, g * 4 + 4)
        live = rows[~truncated[rows]]
        if len(live) >= 2:
            assert abs(float(batch.advantages[live].sum())) < 1e-5


def test_a_seed_signature_impl_runs_under_any_profile_but_not_a_menu_option(tmp_path):
    impl = load_impl(MUTANTS / "sign_flipped.py")  # grpo_loss with the seed's signature
    run = _run(tmp_path / "trl", "objective.profile=trl", functions=impl)
    metrics, _ = grpo_step(run, 1)  # its convention is its own: the preflight checks it
    assert "loss" in metrics
    with pytest.raises(ValueError, match=r"objective\.importance_sampling_level=sequence needs a "):
        _run(tmp_path / "gspo", "objective.importance_sampling_level=sequence", functions=impl)
    advantages = load_impl(MUTANTS / "population_std.py")
    with pytest.raises(ValueError, match=r"objective\.advantage_estimator=rloo"):
        _run(tmp_path / "rloo", "objective.advantage_estimator=rloo", functions=advantages)


def test_a_users_functions_are_adapted_once_and_keep_their_signature(tmp_path):
    impl = load_impl(Path(__file__).parent / "impls" / "trl_advantages.py")  # no std, no valid
    adapted = as_called(impl)
    written = inspect.signature(impl.group_advantages)
    assert inspect.signature(adapted.group_advantages) == written  # what the checks read
    assert adapted.grpo_loss is impl.grpo_loss  # grpolab's takes every keyword: not wrapped
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    passed_all = adapted.group_advantages(
        rewards, 4, std="sample", zero_std_guard=True, valid=torch.ones(8, dtype=torch.bool)
    )
    assert torch.equal(passed_all, impl.group_advantages(rewards, 4))
    with pytest.raises(TypeError):  # a keyword it may not leave out still reaches it
        adapted.group_advantages(rewards, 4, estimator="rloo")
    run = _run(tmp_path, functions=impl)
    metrics, _ = grpo_step(run, 1)
    assert run.functions.source["group_advantages"].endswith("trl_advantages.py")
    assert "loss" in metrics


def test_top_entropy_quantile_trains_the_top_share_of_the_sampling_policys_tokens(tmp_path):
    run = _run(tmp_path, "objective.top_entropy_quantile=0.25", "runtime.skip_zero_advantage=false")
    start = copy.deepcopy(run.model)  # the policy that sampled, before the step's update
    metrics, batch = grpo_step(run, 1)
    kept = batch.before["top_entropy"].bool()  # [B, T-1]
    # The reference: the naive float64 entropy of the start model over the loss's tokens.
    with torch.no_grad():
        logits = start(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].double() / run.objective.temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    mask = batch.completion_mask[:, 1:].bool()
    threshold = torch.quantile(entropy[mask], 0.75)
    expected = (entropy >= threshold) & mask
    near = (entropy - threshold).abs() <= 1e-4  # float32 rounding may put these either side
    assert int(((kept != expected) & ~near).sum()) == 0
    assert not (kept & ~mask).any()
    share = int(expected.sum()) / int(mask.sum())
    assert abs(metrics["entropy_quantile/kept_frac"] - share) <= 1 / int(mask.sum()) + 1e-9
    assert 0.15 < share < 0.35


def test_the_surrogate_is_its_own_key_apart_from_the_normaliser(tmp_path):
    run = _run(tmp_path / "sapo", "objective.surrogate=sapo", "objective.loss_type=token")
    assert (run.objective.policy_term, run.objective.aggregation) == ("sapo", "token")
    assert run.objective.loss_kwargs()["surrogate"] == "sapo"
    metrics, _ = grpo_step(run, 1)
    assert "clip_frac_low" not in metrics  # SAPO has no hard clip sides
    alias = load_config(None, ["objective.loss_type=sapo"]).objective
    assert (alias.surrogate, alias.policy_term, alias.aggregation) == (None, "sapo", "sequence")
    with pytest.raises(ConfigError, match=r"objective\.surrogate"):
        load_config(None, ["objective.loss_type=cispo", "objective.surrogate=sapo"])
