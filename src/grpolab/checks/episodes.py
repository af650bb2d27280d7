"""The checks of multi-turn episodes (`rollout.tools` / `rollout.environment`).

They run on real episodes from the configured engine and model: the configured tokenizer's
tool turns, in the probe environment (`ProbeEnvironment`: a turn ends at a common character
and is answered by a tool turn, so even a model that never calls a tool yields multi-turn
rows whose G samples take different numbers of turns). The engine's own record of each
episode (every token in the order fed to the model, which ones it sampled, their log-probs)
is the reference; the episode functions (`EpisodeFunctions`) build the Rollout from it, and
each check measures one way that Rollout can betray the record:

    episode.token_stream      the trained tokens are the engine's (not a re-tokenised text)
    episode.mask              the loss mask is 1 exactly on the sampled tokens
    episode.tool_gradient     tool / environment tokens get exactly zero gradient
    episode.engine_agreement  engine vs trainer log-probs on multi-turn rows
    episode.reward_turn       the rewards read the last assistant turn
    episode.normaliser        a token-mode normaliser counts the model's tokens only
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import signed_advantages
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.episodes import (
    Episode,
    EpisodeFunctions,
    ProbeEnvironment,
    assemble_episodes,
)


@dataclass
class EpisodeBatch:
    """The engine's record of G episodes per prompt, and what assembling it needs."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    episodes: list[Episode]
    group_size: int
    tokenizer: object
    pad_id: int

    def assemble(self, fns: EpisodeFunctions) -> Rollout:
        return assemble_episodes(
            self.prompts,
            self.prompt_ids,
            self.episodes,
            self.group_size,
            self.pad_id,
            self.tokenizer,
            fns,
        )


@dataclass
class Episodes:
    """What the episode checks read: the engine's record and the functions under test."""

    batch: EpisodeBatch
    functions: EpisodeFunctions


def probe_episodes(engine, prompts: list[str], G: int, params: SamplingParams) -> EpisodeBatch:
    """Episodes of the probe environment from the configured engine (its tokenizer, its tool
    turns, its decode loop) on the current model."""
    prompt_ids, episodes = engine.sample_episodes(prompts, G, params, factory=ProbeEnvironment)
    return EpisodeBatch(prompts, prompt_ids, episodes, G, engine.tokenizer, engine.pad_id)


def sampled_flags(episode: Episode) -> list[bool]:
    """The engine's record: which tokens of the stream it sampled (assistant turns)."""
    flags = [False] * len(episode.tokens)
    for turn in episode.turns:
        if turn.role == "assistant":
            flags[turn.start : turn.end] = [True] * (turn.end - turn.start)
    return flags


def _rollout(ctx) -> Rollout:
    e = ctx.episodes
    return ctx.memo("episodes.rollout", lambda: e.batch.assemble(e.functions))


def _sampled(batch: EpisodeBatch, rollout: Rollout) -> torch.Tensor:
    """[B, T] 1 where the engine's record says it sampled the token at that column."""
    P = rollout.prompt_length
    out = torch.zeros_like(rollout.attention_mask)
    for i, ep in enumerate(batch.episodes):
        flags = torch.tensor(sampled_flags(ep), dtype=out.dtype)[: out.shape[1] - P]
        out[i, P : P + len(flags)] = flags
    return out


def _retokenised_rows(batch: EpisodeBatch) -> int:
    """Rows whose decoded conversation does not tokenise back to the engine's tokens."""
    tok, differ = batch.tokenizer, 0
    for i, ep in enumerate(batch.episodes):
        ids = list(batch.prompt_ids[i // batch.group_size]) + ep.tokens
        text = tok.decode(ids, skip_special_tokens=False)
        differ += tok(text, add_special_tokens=False)["input_ids"] != ids
    return differ


def token_stream(ctx):
    batch, rollout = ctx.episodes.batch, _rollout(ctx)
    P, wrong = rollout.prompt_length, 0
    for i, ep in enumerate(batch.episodes):
        n = int(rollout.attention_mask[i, P:].sum())
        wrong += rollout.input_ids[i, P : P + n].tolist() != ep.tokens
    retok = _retokenised_rows(batch)
    return ctx.result(
        "rows whose trained tokens after the prompt differ from the engine's stream "
        f"(re-tokenising the decoded conversation would change {retok} of "
        f"{len(batch.episodes)} rows)",
        wrong,
        "0",
        wrong == 0,
    )


def mask(ctx):
    batch, rollout = ctx.episodes.batch, _rollout(ctx)
    P, wrong = rollout.prompt_length, 0
    for i, ep in enumerate(batch.episodes):
        flags = torch.tensor(sampled_flags(ep), dtype=torch.long)
        row = rollout.completion_mask[i, P:]
        width = min(len(flags), row.numel())
        wrong += int((row[:width] != flags[:width]).sum()) + int(row[width:].sum())
        wrong += int(flags[width:].sum())
    return ctx.result(
        "tokens where the loss mask differs from 'the engine sampled it'", wrong, "0", wrong == 0
    )


def _trainer_logprobs(ctx):
    """The trainer's log-probs of the assembled rows (with gradient) and their mask, once."""
    rollout = _rollout(ctx)
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_mask)
    return ctx.memo(
        "episodes.logp",
        lambda: ctx.impl.sequence_logprobs(ctx.model, *args, ctx.objective.temperature),
    )


def tool_gradient(ctx):
    """d loss / d logp at every position whose token a tool wrote: exactly 0."""
    rollout = _rollout(ctx)
    logp, loss_mask = _trainer_logprobs(ctx)  # [B, T-1]
    leaf = logp.detach().requires_grad_(True)
    advantages = signed_advantages(rollout.batch_size)
    loss, _ = ctx.loss(leaf, leaf.detach(), None, advantages, loss_mask)
    (grad,) = torch.autograd.grad(loss, leaf)
    context = (rollout.attention_mask[:, 1:] - _sampled(ctx.episodes.batch, rollout)[:, 1:]).bool()
    context[:, : rollout.prompt_length - 1] = False  # the prompt: its own checks
    worst = float(grad[context].abs().max()) if context.any() else 0.0
    tools = int(context.sum())
    return ctx.result(
        f"max |d loss / d logp| over the {tools} tool-turn tokens",
        worst,
        "== 0 exactly",
        tools > 0 and worst == 0.0,
    )


def engine_agreement(ctx):
    """The engine's log-probs of its sampled tokens against the trainer's, on the rows with
    more than one assistant turn."""
    batch, rollout = ctx.episodes.batch, _rollout(ctx)
    logp = _trainer_logprobs(ctx)[0].detach()
    multi = torch.tensor(
        [sum(t.role == "assistant" for t in ep.turns) > 1 for ep in batch.episodes]
    )
    sampled = _sampled(batch, rollout)[:, 1:].bool() & multi[:, None]
    gap = (rollout.engine_logprobs.double() - logp.double())[sampled].abs()
    worst = float(gap.max()) if gap.numel() else float("inf")
    bound = ctx.settings.engine_gap_max
    return ctx.result(
        f"engine vs trainer logp on the sampled tokens of {int(multi.sum())} multi-turn rows",
        worst,
        f"<= {bound:g}",
        worst <= bound,
    )


def reward_turn(ctx):
    """What the rewards read (Rollout.completions) against the last assistant turn decoded
    from the trained stream itself."""
    batch, rollout = ctx.episodes.batch, _rollout(ctx)
    P, tok, wrong = rollout.prompt_length, batch.tokenizer, 0
    for i, ep in enumerate(batch.episodes):
        last = [t for t in ep.turns if t.role == "assistant"][-1]
        ids = rollout.input_ids[i, P + last.start : P + last.end].tolist()
        wrong += rollout.completions[i] != tok.decode(ids, skip_special_tokens=True)
    return ctx.result(
        "rows whose reward input is not the last assistant turn", wrong, "0", wrong == 0
    )


def normaliser(ctx):
    batch, rollout = ctx.episodes.batch, _rollout(ctx)
    counted = core.normaliser_count("token", ctx.episodes.functions.normaliser_mask(rollout)[:, 1:])
    model_tokens = sum(sum(sampled_flags(ep)) for ep in batch.episodes)
    return ctx.result(
        f"token-mode normaliser minus the {model_tokens} tokens the model sampled",
        counted - model_tokens,
        "0",
        counted == model_tokens,
    )


def _episode_check(id: str, hint: str, run, mutant: str) -> Check:
    return Check(id, 0, hint, run, stage="episodes", mutants=(Mutant(mutant),))


CHECKS = (
    _episode_check(
        "episode.token_stream",
        "train on the token stream the engine fed the model (the prompt, each sampled token, "
        "each tool turn's tokens, in order); never re-tokenise the decoded conversation: tokens "
        "merge across turn boundaries and special tokens vanish",
        token_stream,
        "episode_retokenised",
    ),
    _episode_check(
        "episode.mask",
        "the loss mask is 1 on exactly the tokens the model sampled: each assistant turn's span, "
        "counted from the completion's first column; tool turns and padding are 0",
        mask,
        "episode_mask_shifted_turn",
    ),
    _episode_check(
        "episode.tool_gradient",
        "tool results and template glue are context: mask them out of the loss so they get "
        "exactly zero gradient",
        tool_gradient,
        "episode_tool_tokens_in_mask",
    ),
    Check(
        "episode.engine_agreement",
        0,
        "the engine's log-probs must cover the same tokens as the trainer's: its sampled "
        "tokens, at their columns in the trained stream",
        engine_agreement,
        stage="episodes",
    ),
    _episode_check(
        "episode.reward_turn",
        "the rewards read the last assistant turn (the final answer), not a tool's result or an "
        "earlier turn",
        reward_turn,
        "episode_reward_wrong_turn",
    ),
    _episode_check(
        "episode.normaliser",
        "a token-mode loss divides by the model's own tokens: tool tokens in the count shrink "
        "every gradient of episodes that call tools",
        normaliser,
        "episode_normaliser_counts_tools",
    ),
)
EPISODE_IDS = tuple(c.id for c in CHECKS)
