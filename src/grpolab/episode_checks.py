"""The preflight's checks of multi-turn episodes (`rollout.tools` / `rollout.environment`).

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
from grpolab.checks import (
    CheckResult,
    PreflightSettings,
    _loss,
    _signed_advantages,
    guarded,
)
from grpolab.core import CoreFunctions
from grpolab.models import eval_mode
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.episodes import (
    Episode,
    EpisodeFunctions,
    ProbeEnvironment,
    assemble_episodes,
)

EPISODE_IDS = (
    "episode.token_stream",
    "episode.mask",
    "episode.tool_gradient",
    "episode.engine_agreement",
    "episode.reward_turn",
    "episode.normaliser",
)

EPISODE_HINTS = {
    "episode.token_stream": "train on the token stream the engine fed the model (the prompt, "
    "each sampled token, each tool turn's tokens, in order); never re-tokenise the decoded "
    "conversation: tokens merge across turn boundaries and special tokens vanish",
    "episode.mask": "the loss mask is 1 on exactly the tokens the model sampled: each assistant "
    "turn's span, counted from the completion's first column; tool turns and padding are 0",
    "episode.tool_gradient": "tool results and template glue are context: mask them out of the "
    "loss so they get exactly zero gradient",
    "episode.engine_agreement": "the engine's log-probs must cover the same tokens as the "
    "trainer's: its sampled tokens, at their columns in the trained stream",
    "episode.reward_turn": "the rewards read the last assistant turn (the final answer), "
    "not a tool's result or an earlier turn",
    "episode.normaliser": "a token-mode loss divides by the model's own tokens: tool tokens in "
    "the count shrink every gradient of episodes that call tools",
}


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


def probe_episodes(engine, prompts: list[str], G: int, params: SamplingParams) -> EpisodeBatch:
    """Episodes of the probe environment from the configured engine (its tokenizer, its tool
    turns, its decode loop) on the current model."""
    prompt_ids, episodes = engine.sample_episodes(prompts, G, params, factory=ProbeEnvironment)
    return EpisodeBatch(prompts, prompt_ids, episodes, G, engine.tokenizer, engine.pad_id)


def _result(id: str, what: str, measured, expected: str, passed: bool) -> CheckResult:
    return CheckResult(id, 0, what, measured, expected, bool(passed), EPISODE_HINTS[id])


def sampled_flags(episode: Episode) -> list[bool]:
    """The engine's record: which tokens of the stream it sampled (assistant turns)."""
    flags = [False] * len(episode.tokens)
    for turn in episode.turns:
        if turn.role == "assistant":
            flags[turn.start : turn.end] = [True] * (turn.end - turn.start)
    return flags


def _retokenised_rows(batch: EpisodeBatch) -> int:
    """Rows whose decoded conversation does not tokenise back to the engine's tokens."""
    tok, differ = batch.tokenizer, 0
    for i, ep in enumerate(batch.episodes):
        ids = list(batch.prompt_ids[i // batch.group_size]) + ep.tokens
        text = tok.decode(ids, skip_special_tokens=False)
        differ += tok(text, add_special_tokens=False)["input_ids"] != ids
    return differ


def check_stream_and_mask(batch: EpisodeBatch, rollout: Rollout):
    P = rollout.prompt_length
    wrong_rows, wrong_mask = 0, 0
    for i, ep in enumerate(batch.episodes):
        n = int(rollout.attention_mask[i, P:].sum())
        wrong_rows += rollout.input_ids[i, P : P + n].tolist() != ep.tokens
        flags = torch.tensor(sampled_flags(ep), dtype=torch.long)
        mask = rollout.completion_mask[i, P:]
        width = min(len(flags), mask.numel())
        wrong_mask += int((mask[:width] != flags[:width]).sum()) + int(mask[width:].sum())
        wrong_mask += int(flags[width:].sum())
    retok = _retokenised_rows(batch)
    yield _result(
        "episode.token_stream",
        "rows whose trained tokens after the prompt differ from the engine's stream "
        f"(re-tokenising the decoded conversation would change {retok} of "
        f"{len(batch.episodes)} rows)",
        wrong_rows,
        "0",
        wrong_rows == 0,
    )
    yield _result(
        "episode.mask",
        "tokens where the loss mask differs from 'the engine sampled it'",
        wrong_mask,
        "0",
        wrong_mask == 0,
    )


def check_gradient(impl: CoreFunctions, model, batch, rollout: Rollout, s: PreflightSettings):
    """d loss / d logp at every position whose token a tool wrote: exactly 0."""
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_mask)
    logp, mask = impl.sequence_logprobs(model, *args, s.objective.temperature)  # [B, T-1]
    leaf = logp.detach().requires_grad_(True)
    advantages = _signed_advantages(rollout.batch_size)
    loss, _ = _loss(impl, leaf, leaf.detach(), None, advantages, mask, s)
    (grad,) = torch.autograd.grad(loss, leaf)
    context = (rollout.attention_mask[:, 1:] - _sampled(batch, rollout)[:, 1:]).bool()
    context[:, : rollout.prompt_length - 1] = False  # the prompt: its own checks
    worst = float(grad[context].abs().max()) if context.any() else 0.0
    tools = int(context.sum())
    yield _result(
        "episode.tool_gradient",
        f"max |d loss / d logp| over the {tools} tool-turn tokens",
        worst,
        "== 0 exactly",
        tools > 0 and worst == 0.0,
    )
    yield from check_agreement(batch, rollout, logp.detach(), s)


def _sampled(batch: EpisodeBatch, rollout: Rollout) -> torch.Tensor:
    """[B, T] 1 where the engine's record says it sampled the token at that column."""
    P = rollout.prompt_length
    out = torch.zeros_like(rollout.attention_mask)
    for i, ep in enumerate(batch.episodes):
        flags = torch.tensor(sampled_flags(ep), dtype=out.dtype)[: out.shape[1] - P]
        out[i, P : P + len(flags)] = flags
    return out


def check_agreement(batch: EpisodeBatch, rollout: Rollout, logp, s: PreflightSettings):
    """The engine's log-probs of its sampled tokens against the trainer's, on the rows with
    more than one assistant turn."""
    multi = torch.tensor(
        [sum(t.role == "assistant" for t in ep.turns) > 1 for ep in batch.episodes]
    )
    sampled = _sampled(batch, rollout)[:, 1:].bool() & multi[:, None]
    engine = rollout.engine_logprobs
    gap = (engine.double() - logp.double())[sampled].abs()
    worst = float(gap.max()) if gap.numel() else float("inf")
    yield _result(
        "episode.engine_agreement",
        f"engine vs trainer logp on the sampled tokens of {int(multi.sum())} multi-turn rows",
        worst,
        f"<= {s.engine_gap_max:g}",
        worst <= s.engine_gap_max,
    )


def check_reward_turn(batch: EpisodeBatch, rollout: Rollout):
    """What the rewards read (Rollout.completions) against the last assistant turn decoded
    from the trained stream itself."""
    P, tok, wrong = rollout.prompt_length, batch.tokenizer, 0
    for i, ep in enumerate(batch.episodes):
        last = [t for t in ep.turns if t.role == "assistant"][-1]
        ids = rollout.input_ids[i, P + last.start : P + last.end].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        wrong += rollout.completions[i] != text
    yield _result(
        "episode.reward_turn",
        "rows whose reward input is not the last assistant turn",
        wrong,
        "0",
        wrong == 0,
    )


def check_normaliser(batch: EpisodeBatch, rollout: Rollout, fns: EpisodeFunctions):
    counted = core.normaliser_count("token", fns.normaliser_mask(rollout)[:, 1:])
    model_tokens = sum(sum(sampled_flags(ep)) for ep in batch.episodes)
    yield _result(
        "episode.normaliser",
        f"token-mode normaliser minus the {model_tokens} tokens the model sampled",
        counted - model_tokens,
        "0",
        counted == model_tokens,
    )


def _checks(impl, model, batch: EpisodeBatch, s: PreflightSettings, fns: EpisodeFunctions):
    rollout = batch.assemble(fns)
    yield from check_stream_and_mask(batch, rollout)
    yield from check_gradient(impl, model, batch, rollout, s)
    yield from check_reward_turn(batch, rollout)
    yield from check_normaliser(batch, rollout, fns)


def run_episode_checks(
    model,
    batch: EpisodeBatch,
    settings: PreflightSettings | None = None,
    impl: CoreFunctions | None = None,
    fns: EpisodeFunctions | None = None,
) -> list[CheckResult]:
    """The episode checks, on the engine's record `batch`; the model left as found."""
    s = settings or PreflightSettings()
    impl = impl or CoreFunctions()
    fns = fns or EpisodeFunctions()
    with eval_mode(model, zero_grad=True):
        results = guarded(impl, EPISODE_IDS, 0, _checks, impl, model, batch, s, fns)
    for r in results:  # an exception's result names the check it interrupted
        r.hint = r.hint or EPISODE_HINTS.get(r.id, "")
    return results
