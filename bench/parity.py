"""Certified parity: grpolab's objective under each profile against the peers' own code.

One batch: the shipped demo model's rollout of 4 arithmetic prompts x G = 4 (completions of
unequal lengths), its real log-probs (logp_new), a perturbed copy's (logp_ref, beta 0.04),
logp_old 0.5-sigma off logp_new (ratios leave 1: both clip sides act; two negative-advantage
tokens at ratio 4.5, where verl's dual-clip acts),
and designed rewards with ties and a zero-variance group. For each profile (and the menu's
options the peers share) grpolab computes its advantages, loss and d loss / d logp_new; the
peer computes its own from the same rewards and log-probs; the table is the max abs diff.

The peers' code, as installed (`scripts/setup.sh` puts verl and OpenRLHF without their
dependencies into .venv/peers; TRL is a test dependency):
  TRL 1.16      the advantages: `GRPOTrainer._generate_and_score_completions` itself, its
                `_generate` replaced by the batch's token ids and its reward function
                returning the batch's rewards; the loss and gradient: `compute_loss` itself,
                its log-prob forward replaced by the batch's log-probs, so both sides
                differentiate the same tensor.
  verl 0.9      `compute_grpo_outcome_advantage`, `compute_rloo_outcome_advantage`,
                `compute_reinforce_plus_plus_baseline_outcome_advantage`, the policy losses
                (`get_policy_loss_fn`: vanilla, gspo), `kl_penalty` and `agg_loss` from
                `verl.trainer.ppo.core_algos`, composed as `verl/workers/utils/losses.py`
                `ppo_loss` does (pg_loss + agg_loss(kl) * kl_loss_coef).
  OpenRLHF 0.11 the loss: `PolicyLoss`, `compute_approx_kl`, `aggregate_loss` and
                `compute_reward` from `openrlhf/models/loss.py` and `utils.py`, loaded from
                the installed files without `openrlhf/models/__init__.py`, which imports the
                actor and with it flash_attn (a CUDA build pip cannot make on a CPU machine);
                the composition is `ppo_actor.py`'s (actor_loss + kl_loss * kl_ctl). The
                advantages: the group_norm / rloo lines of
                `RemoteExperienceMaker.compute_advantages_and_returns` and its
                `get_cumulative_returns` (experience_maker.py), reproduced: that module
                imports the Ray launcher and the actor (flash_attn) at import time.

    python bench/parity.py                 # the table
    python bench/parity.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1e-6
G = 4
REWARDS = (1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.5, 0.2, 0.7, 0.7, 0.1)
BETA = 0.04


@dataclass
class Batch:
    """Completion-aligned tensors [B, L] (L = completion columns) and the rewards [B]."""

    logp: torch.Tensor  # logp_new, the model's own
    old: torch.Tensor
    ref: torch.Tensor
    mask: torch.Tensor  # float
    rewards: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor


def peers_path() -> Path:
    """Where scripts/setup.sh installs the peers (a pip --target directory)."""
    return Path(sys.prefix) / "peers"


def build_batch(seed: int = 0) -> Batch:
    from grpolab import core
    from grpolab.model.policy import load_policy
    from grpolab.rollout.base import SamplingParams
    from grpolab.rollout.hf import HFEngine
    from grpolab.tasks import TaskConfig, load_task
    from grpolab.train.setup import DEMO_MODEL_DIR

    torch.manual_seed(seed)
    model, tokenizer = load_policy(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")
    examples = load_task(TaskConfig()).sample(4, torch.Generator().manual_seed(seed))
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_completion_length=8, seed=seed)
    rollout = engine.generate([e.prompt for e in examples], G, params)
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_mask)
    ref_model, _ = load_policy(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        logp, mask = core.sequence_logprobs(model, *args)
        ref, _ = core.sequence_logprobs(ref_model, *args)
    P = rollout.prompt_length
    cols = slice(P - 1, None)  # entry t predicts token t + 1: the completion's columns
    mask = mask[:, cols]
    noise = torch.randn(mask.shape, generator=g)
    logp, ref = logp[:, cols] * mask, ref[:, cols] * mask
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) > 1, "the batch needs completions of unequal lengths"
    old = (logp + 0.5 * noise) * mask
    # Two negative-advantage samples with a ratio of e^1.5 = 4.5 on their first token: past
    # verl's dual-clip bound of 3.
    for row in (1, 15):
        old[row, int(mask[row].argmax())] -= 1.5
    return Batch(
        logp=logp,
        old=old,
        ref=ref,
        mask=mask,
        rewards=torch.tensor(REWARDS),
        prompt_ids=rollout.input_ids[:, :P],
        prompt_mask=rollout.attention_mask[:, :P],
        completion_ids=rollout.input_ids[:, P:],
    )


# --- grpolab ---------------------------------------------------------------------------------


def grpolab_side(batch: Batch, overrides: list[str]):
    """(advantages [B], loss, grad [B, L]) of grpolab's core under `overrides`."""
    from grpolab import core
    from grpolab.config import load_config, objective_of

    o = objective_of(
        load_config(None, [f"objective.beta={BETA}", "rollout.max_completion_length=8", *overrides])
    )
    kwargs = o.advantage_kwargs()
    if o.advantage_estimator == "reinforce_pp":
        kwargs["lengths"] = batch.mask.sum(1)
    unscorable = torch.isnan(batch.rewards)  # every reward function returned None
    if unscorable.any():
        kwargs["valid"] = ~unscorable
    advantages = core.group_advantages(torch.nan_to_num(batch.rewards), G, **kwargs)
    leaf = batch.logp.clone().requires_grad_(True)
    loss, _ = core.grpo_loss(leaf, batch.old, batch.ref, advantages, batch.mask, **o.loss_kwargs())
    loss.backward()
    return advantages.detach(), float(loss.detach()), leaf.grad


# --- TRL -------------------------------------------------------------------------------------


def trl_advantages(trainer, batch: Batch) -> torch.Tensor:
    """TRL's own GRPOTrainer._generate_and_score_completions on the batch: its generation
    replaced by the batch's token ids, its reward function returning the batch's rewards."""
    B = len(batch.rewards)
    rows = zip(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.mask, strict=True)
    prompts, completions = [], []
    for prompt_ids, prompt_mask, completion_ids, mask in rows:
        prompts.append(prompt_ids[prompt_mask.bool()].tolist())
        completions.append(completion_ids[mask.bool()].tolist())
    trainer._generate = lambda _: (prompts, completions, None, ["."] * B, None, {}, None, None)
    inputs = [{"prompt": ".", "reward": float(r)} for r in batch.rewards]
    return trainer._generate_and_score_completions(inputs)["advantages"]


def trl_side(batch: Batch, advantages: torch.Tensor | None = None, **config):
    """(advantages, loss, grad) of TRL's GRPOTrainer.compute_loss with GRPOConfig(**config)."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grpolab.model.policy import load_policy
    from grpolab.train.setup import DEMO_MODEL_DIR

    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = load_policy(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=len(batch.rewards),
            num_generations=G,
            max_completion_length=8,
            beta=BETA,
            use_vllm=False,
            use_cpu=True,
            report_to=[],
            **config,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, reward, **_: [
                None if np.isnan(r) else r for r in reward
            ],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["."] * G, "reward": [0.0] * G}),
            processing_class=tokenizer,
        )
        trainer.model.train()
        if advantages is None:
            advantages = trl_advantages(trainer, batch)
        leaf = batch.logp.clone().requires_grad_(True)
        entropies = torch.zeros_like(leaf)
        # TRL's own loss on the batch's log-probs: its forward replaced, nothing else.
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropies, None)
        trainer.current_gradient_accumulation_steps = 1
        inputs = {
            "prompt_ids": batch.prompt_ids,
            "prompt_mask": batch.prompt_mask,
            "completion_ids": batch.completion_ids,
            "completion_mask": batch.mask.long(),
            "advantages": advantages,
            "old_per_token_logps": batch.old,
            "ref_per_token_logps": batch.ref,
            "num_items_in_batch": batch.mask.sum(),
        }
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    return advantages, float(loss.detach()), leaf.grad


# --- verl ------------------------------------------------------------------------------------


def verl_modules():
    sys.path.insert(0, str(peers_path()))
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return core_algos, ActorConfig, PolicyLossConfig


def verl_advantages(batch: Batch, estimator: str) -> torch.Tensor:
    core_algos, *_ = verl_modules()
    mask = batch.mask
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & mask.bool()  # the reward's token
    token_rewards = torch.where(last, batch.rewards[:, None], torch.zeros_like(mask))
    index = np.array([i // G for i in range(len(batch.rewards))])
    fn = {
        "grpo": core_algos.compute_grpo_outcome_advantage,
        "rloo": core_algos.compute_rloo_outcome_advantage,
        "reinforce_pp": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage,
    }[estimator]
    advantages, _ = fn(token_level_rewards=token_rewards, response_mask=mask, index=index)
    return advantages  # [B, L]


def verl_side(batch: Batch, estimator: str = "grpo", loss_mode: str = "vanilla"):
    core_algos, ActorConfig, PolicyLossConfig = verl_modules()
    token_adv = verl_advantages(batch, estimator)
    agg = "seq-mean-token-mean" if loss_mode == "gspo" else "token-mean"
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=G,
        ppo_micro_batch_size_per_gpu=len(batch.rewards),
        loss_agg_mode=agg,
        use_kl_loss=True,
        kl_loss_coef=BETA,
        kl_loss_type="low_var_kl",
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    leaf = batch.logp.clone().requires_grad_(True)
    mask = batch.mask.bool()
    policy_loss_fn = core_algos.get_policy_loss_fn(loss_mode)
    pg_loss, _ = policy_loss_fn(
        old_log_prob=batch.old,
        log_prob=leaf,
        advantages=token_adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=config,
    )
    kld = core_algos.kl_penalty(logprob=leaf, ref_logprob=batch.ref, kl_penalty="low_var_kl")
    kl_loss = core_algos.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg)
    loss = pg_loss + kl_loss * config.kl_loss_coef
    loss.backward()
    return _per_sequence(token_adv, batch.mask), float(loss.detach()), leaf.grad


def _per_sequence(token_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-sequence value a peer broadcast over the sequence's tokens: [B, L] -> [B]."""
    first = mask.argmax(dim=1)
    return token_values.gather(1, first[:, None]).squeeze(1)


# --- OpenRLHF --------------------------------------------------------------------------------


def openrlhf_modules():
    """openrlhf.models.loss and .utils from the installed files, without the package's
    __init__ (it imports the actor and flash_attn)."""
    sys.path.insert(0, str(peers_path()))
    import openrlhf

    if "openrlhf.models" not in sys.modules:
        package = types.ModuleType("openrlhf.models")
        package.__path__ = [str(Path(openrlhf.__file__).parent / "models")]
        sys.modules["openrlhf.models"] = package
    from openrlhf.models import loss, utils

    return loss, utils


def openrlhf_advantages(batch: Batch, estimator: str) -> torch.Tensor:
    """experience_maker.py, compute_advantages_and_returns: the group baseline; then
    compute_reward puts it on the EOS token and get_cumulative_returns (gamma 1) spreads it
    over the completion. [B, L]."""
    _, utils = openrlhf_modules()
    rewards = batch.rewards.reshape(-1, G)
    if estimator == "rloo":
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (G - 1)
        rewards = rewards - baseline
    else:  # group_norm
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (
            rewards.std(-1, keepdim=True) + 1e-9
        )
    reward = utils.compute_reward(
        rewards.reshape(-1), 0.0, torch.zeros_like(batch.mask), action_mask=batch.mask
    )
    returns = torch.zeros_like(reward)
    cumulative = torch.zeros(reward.size(0))
    reward = batch.mask * reward
    for t in reversed(range(reward.size(1))):
        cumulative = reward[:, t] + cumulative
        returns[:, t] = cumulative
    return returns


def openrlhf_side(batch: Batch, estimator: str = "group_norm"):
    loss_module, utils = openrlhf_modules()
    token_adv = openrlhf_advantages(batch, estimator)
    leaf = batch.logp.clone().requires_grad_(True)
    policy = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, token_level_loss=True)
    actor_loss, *_ = policy(leaf, batch.old, token_adv, action_mask=batch.mask)
    kl = utils.compute_approx_kl(leaf, batch.ref, kl_estimator="k3")
    kl_loss = loss_module.aggregate_loss(kl, batch.mask)
    loss = actor_loss + kl_loss * BETA
    loss.backward()
    return _per_sequence(token_adv, batch.mask), float(loss.detach()), leaf.grad


# --- The table -------------------------------------------------------------------------------


def with_unscorable(batch: Batch) -> Batch:
    """The batch with rows no reward function could score (NaN here, None to TRL): one in
    the first group, two in the third, all but one in the fourth."""
    rewards = batch.rewards.clone()
    rewards[[1, 8, 10, 12, 13, 14]] = float("nan")
    return dataclasses.replace(batch, rewards=rewards)


def seed_advantages(batch: Batch) -> torch.Tensor:
    from grpolab import core

    return core.group_advantages(batch.rewards, G)


# (profile, peer, grpolab overrides, the peer's computation, note). TRL has no population
# std: the seed's row gives TRL grpolab's advantages and compares the loss and gradient.
CASES: list[tuple[str, str, list[str], Callable, str]] = [
    (
        "seed",
        "TRL 1.16 GRPOTrainer",
        [],
        lambda b: trl_side(
            b, seed_advantages(b), loss_type="grpo", epsilon_high=0.28, use_bias_correction_kl=False
        ),
        "grpolab's advantages",
    ),
    ("trl", "TRL 1.16 GRPOTrainer", ["objective.profile=trl"], lambda b: trl_side(b), "defaults"),
    (
        "trl",
        "TRL 1.16 GRPOTrainer",
        ["objective.profile=trl"],
        lambda b: trl_side(b),
        "None rewards (TRL PR #5902)",
        with_unscorable,
    ),
    (
        "trl",
        "TRL 1.16 GRPOTrainer",
        # Without the KL bias correction: under GSPO TRL 1.16 multiplies each token's KL by
        # the sequence ratio (TRL #6586, its fix PR #7188 unmerged), grpolab by the token's.
        [
            "objective.profile=trl",
            "objective.importance_sampling_level=sequence",
            "objective.loss_type=grpo",
            "objective.use_bias_correction_kl=false",
        ],
        lambda b: trl_side(
            b, importance_sampling_level="sequence", loss_type="grpo", use_bias_correction_kl=False
        ),
        "GSPO (KL without bias correction: TRL #6586)",
    ),
    (
        "trl",
        "TRL 1.16 GRPOTrainer",
        ["objective.profile=trl", "objective.loss_type=cispo", "objective.epsilon_high=5.0"],
        lambda b: trl_side(b, loss_type="cispo", epsilon_high=5.0),
        "CISPO",
    ),
    (
        "trl",
        "TRL 1.16 GRPOTrainer",
        ["objective.profile=trl", "objective.delta=1.5"],
        lambda b: trl_side(b, delta=1.5),
        "two-sided clip",
    ),
    ("verl", "verl 0.9 core_algos", ["objective.profile=verl"], lambda b: verl_side(b), "grpo"),
    (
        "verl",
        "verl 0.9 core_algos",
        [
            "objective.profile=verl",
            "objective.importance_sampling_level=sequence",
            "objective.loss_type=sequence",
            "objective.dual_clip=null",
        ],
        lambda b: verl_side(b, loss_mode="gspo"),
        "GSPO",
    ),
    (
        "verl",
        "verl 0.9 core_algos",
        ["objective.profile=verl", "objective.advantage_estimator=rloo"],
        lambda b: verl_side(b, estimator="rloo"),
        "RLOO",
    ),
    (
        "verl",
        "verl 0.9 core_algos",
        ["objective.profile=verl", "objective.advantage_estimator=reinforce_pp"],
        lambda b: verl_side(b, estimator="reinforce_pp"),
        "REINFORCE++ baseline",
    ),
    (
        "openrlhf",
        "OpenRLHF 0.11 loss code",
        ["objective.profile=openrlhf"],
        lambda b: openrlhf_side(b),
        "group_norm",
    ),
    (
        "openrlhf",
        "OpenRLHF 0.11 loss code",
        ["objective.profile=openrlhf", "objective.advantage_estimator=rloo"],
        lambda b: openrlhf_side(b, estimator="rloo"),
        "RLOO",
    ),
]


def run(batch: Batch) -> list[dict]:
    rows = []
    for profile, peer, overrides, peer_fn, note, *transform in CASES:
        case = transform[0](batch) if transform else batch
        ours = grpolab_side(case, overrides)
        theirs = peer_fn(case)
        valid = case.mask.bool()
        diffs = {
            "advantages": float((ours[0] - theirs[0]).abs().max()),
            "loss": abs(ours[1] - theirs[1]),
            "grad": float((ours[2] - theirs[2])[valid].abs().max()),
        }
        scale = {
            "advantages": ours[0].abs().max(),
            "loss": abs(ours[1]),
            "grad": ours[2].abs().max(),
        }
        if profile == "seed":  # the advantages were grpolab's on both sides
            del diffs["advantages"]
        for quantity, diff in diffs.items():
            rows.append(
                {
                    "profile": profile,
                    "peer": peer,
                    "options": note,
                    "overrides": overrides,
                    "quantity": quantity,
                    "max_abs_diff": diff,
                    "scale": float(scale[quantity]),
                    "within_target": diff <= TARGET,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"parity with the peers' own code | target max |diff| <= {TARGET:g} | beta {BETA}")
    width = max(len(r["options"]) for r in rows) + 2
    header = (
        f"{'profile':<10}{'peer':<26}{'options':<{width}}{'quantity':<12}{'max |diff|':>12}"
        f"{'scale':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        verdict = "" if r["within_target"] else "  OVER"
        print(
            f"{r['profile']:<10}{r['peer']:<26}{r['options']:<{width}}{r['quantity']:<12}"
            f"{r['max_abs_diff']:>12.2e}{r['scale']:>10.3g}{verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(build_batch(args.seed))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
