"""Multi-turn episodes: the model writes, a tool (or an environment) answers, the model goes
on, up to `rollout.max_turns` assistant turns and `rollout.max_episode_tokens` tokens.

Tokens in, tokens out. A row of the batch is one token stream: the prompt, then the
assistant's sampled tokens and the tool turns' tokens (the tool's result wrapped in the chat
template's glue, tokenised on its own) in the order the engine fed them to the model. That
stream is what the trainer trains on; the conversation is never re-tokenised. Layout of one
row (P: the prompt's column, as in a single-turn Rollout):

    | pad.. prompt | assistant turn 1 | tool turn 1 | assistant turn 2 | pad.. |
      attention      1 ...              1 ...         1 ...              0
      completion     1 (sampled)        0 (context)   1 (sampled)        0
      engine logp    its log-probs      0             its log-probs      0

The functions that build a Rollout from the engine's record (`EpisodeFunctions`: the
trained token stream, the loss mask, the text the rewards read, the mask the token-mode
normaliser counts) are a table, so the preflight can check them and a broken one can be
shown to fail its check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from grpolab.rollout.base import Rollout, Turn
from grpolab.rollout.tools import (
    RESULT_CLOSE,
    RESULT_OPEN,
    Environment,
    Observation,
    describe_tools,
    tool_schema,
)


@dataclass
class Episode:
    """One sample as the engine produced it: every token after the prompt, in order."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 on tool tokens
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False  # a budget ended it (turn length, total tokens, max_turns)
    reward: float | None = None  # the environment's, at the end


# --- The table of episode functions ---------------------------------------------------------


def episode_tokens(prompt_ids: Sequence[int], episode: Episode, tokenizer) -> list[int]:
    """The tokens after the prompt that the trainer trains on: exactly the engine's stream."""
    return list(episode.tokens)


def episode_mask(episode: Episode, length: int) -> list[float]:
    """The loss mask over the `length` tokens after the prompt: 1 on the tokens the model
    sampled (assistant turns), 0 on tool turns and padding."""
    mask = [0.0] * length
    for turn in episode.turns:
        if turn.role == "assistant":
            mask[turn.start : turn.end] = [1.0] * (turn.end - turn.start)
    return mask


def answer_text(episode: Episode) -> str:
    """What the rewards read: the text of the last assistant turn (the final answer; a tool's
    result is never the model's answer)."""
    assistant = [t for t in episode.turns if t.role == "assistant"]
    return assistant[-1].text if assistant else ""


def normaliser_mask(rollout: Rollout) -> torch.Tensor:
    """[B, T]: the tokens a token-mode loss is normalised by: the model's own (the loss
    mask itself), never the tool's."""
    return rollout.completion_mask


@dataclass
class EpisodeFunctions:
    episode_tokens: Callable = episode_tokens
    episode_mask: Callable = episode_mask
    answer_text: Callable = answer_text
    normaliser_mask: Callable = normaliser_mask
    source: dict[str, str] = field(default_factory=dict)


EPISODE_FUNCTIONS = ("episode_tokens", "episode_mask", "answer_text", "normaliser_mask")


# --- Rendering a tool turn ----------------------------------------------------------------------

_ASSISTANT_MARK = "\x1fASSISTANT_END\x1f"
_RESULT_MARK = "\x1fTOOL_RESULT\x1f"


class ToolTurnRenderer:
    """A tool's result -> the tokens of its turn: the chat template's glue around it (what
    the template writes after an assistant turn, the tool message, the next assistant
    header), or `<tool_response>result</tool_response>` without a template. Only this turn
    is tokenised, on its own."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer = tokenizer
        self.before, self.after = RESULT_OPEN, RESULT_CLOSE
        if chat_template:
            self.before, self.after = template_glue(tokenizer)

    def __call__(self, result: str) -> list[int]:
        text = self.before + result + self.after
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def template_glue(tokenizer) -> tuple[str, str]:
    """(text before the result, text after it) of a tool turn, read off the template's own
    rendering of a conversation with marks in it."""
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _ASSISTANT_MARK},
        {"role": "tool", "content": _RESULT_MARK},
    ]
    try:
        full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise ValueError(f"the chat template cannot render a tool message ({e})") from None
    start = full.find(_ASSISTANT_MARK)
    middle = full.find(_RESULT_MARK)
    if start < 0 or middle < start:
        raise ValueError("the chat template drops an assistant or tool message's content")
    return full[start + len(_ASSISTANT_MARK) : middle], full[middle + len(_RESULT_MARK) :]


def template_supports_tools(tokenizer, schemas: list[dict]) -> bool:
    """Whether the chat template writes the tools it is given (`tools=`) into the prompt."""
    messages = [{"role": "user", "content": "u"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
    except Exception:
        return False
    return plain != with_tools


# --- What an engine needs for episodes ---------------------------------------------------------


class EpisodeSetup:
    """The episodes of one engine: a new environment per episode, the tools' rendering into
    the prompt, the tool turns' tokens, and the functions that assemble the Rollout."""

    def __init__(
        self,
        factory: Callable[[], Environment],
        tokenizer,
        chat_template: bool,
        tools: Sequence[Callable] = (),
        functions: EpisodeFunctions | None = None,
        max_turns: int = 4,
        max_tokens: int = 256,
    ):
        self.factory = factory
        # The limits of a generate() whose SamplingParams leave them None (evaluation).
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.render = ToolTurnRenderer(tokenizer, chat_template)
        self.functions = functions or EpisodeFunctions()
        self.schemas = [tool_schema(t) for t in tools]
        self.tool_description = None  # a system prompt's fallback listing of the tools
        if chat_template and self.schemas and not template_supports_tools(tokenizer, self.schemas):
            self.schemas, self.tool_description = [], describe_tools(tools)
        elif not chat_template:
            self.schemas = []  # plain prompts carry no tool listing: the format is learned

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(getattr(self.factory(), "stop_strings", ()) or ())

    def new_rows(self, prompts, G: int, params, tokenizer, stop_ids, factory=None):
        """G fresh episode rows per prompt (a new environment each) and their limits: what
        both engines start a generate() from -> (rows [len(prompts) * G], EpisodeLimits)."""
        factory = factory or self.factory
        limits = EpisodeLimits(
            max_turns=params.max_turns or self.max_turns,
            max_turn_tokens=params.max_completion_length,
            max_tokens=params.max_episode_tokens or self.max_tokens,
        )
        text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        rows = [
            EpisodeRow(factory(), p, limits, text, self.render, stop_ids)
            for p in prompts
            for _ in range(G)
        ]
        return rows, limits


# --- The engine's side: one row's state while decoding ---------------------------------------


@dataclass
class EpisodeLimits:
    max_turns: int
    max_turn_tokens: int  # rollout.max_completion_length: sampled tokens per assistant turn
    max_tokens: int  # rollout.max_episode_tokens: every token after the prompt


class EpisodeRow:
    """One sample's episode while the decode loop runs: what it emits next (a sampled token,
    or the next token of a tool turn), and what happens at the end of each turn."""

    def __init__(
        self, env: Environment, prompt: str, limits: EpisodeLimits, decode, render, stop_ids
    ):
        self.env, self.limits, self.decode, self.render = env, limits, decode, render
        self.stop_ids = set(stop_ids)
        self.episode = Episode()
        self.pending: list[int] = []  # tool-turn tokens still to feed
        self.turn_start = 0
        self.done = False
        self.stop_strings = tuple(getattr(env, "stop_strings", ()) or ())
        self.env.reset(prompt)

    @property
    def forced(self) -> bool:
        return bool(self.pending)

    def emit(self, sampled: int, logp: float, may_stop: Callable[[int], bool]) -> int:
        """The token this row feeds the model next: a pending tool token, else `sampled`."""
        ep = self.episode
        if self.pending:
            token = self.pending.pop(0)
            ep.tokens.append(token)
            ep.logprobs.append(0.0)
            if not self.pending:
                self.turn_start = len(ep.tokens)  # the next assistant turn starts here
            return token
        ep.tokens.append(sampled)
        ep.logprobs.append(logp)
        turn_len = len(ep.tokens) - self.turn_start
        if sampled in self.stop_ids:
            self._close_assistant()
            self.env.step(ep.turns[-1].text)  # the final answer: the environment's to score
            self._finish(truncated=False)
        elif self.stop_strings and may_stop(sampled) and self._stopped():
            self._close_assistant()
            self._after_call()
        elif turn_len >= self.limits.max_turn_tokens or len(ep.tokens) >= self.limits.max_tokens:
            self._close_assistant()
            self._finish(truncated=True)
        return sampled

    def _stopped(self) -> bool:
        stops = tuple(getattr(self.env, "stop_strings", ()) or ())  # may change mid-episode
        text = self.decode(self.episode.tokens[self.turn_start :])
        return any(s in text for s in stops)

    def _close_assistant(self) -> None:
        ids = self.episode.tokens[self.turn_start :]
        if ids and ids[-1] in self.stop_ids:  # the stop token is not text
            ids = ids[:-1]
        turn = Turn("assistant", self.turn_start, len(self.episode.tokens), self.decode(ids))
        self.episode.turns.append(turn)

    def _after_call(self) -> None:
        """The turn ended at a stop string: the environment answers, or the episode ends."""
        ep = self.episode
        assistant_turns = sum(t.role == "assistant" for t in ep.turns)
        if assistant_turns >= self.limits.max_turns:
            self._finish(truncated=True)  # the turn limit: the call is not run
            return
        obs: Observation = self.env.step(ep.turns[-1].text)
        if obs.done or obs.text is None:
            self._finish(truncated=False)
            return
        ids = self.render(obs.text)
        # The tool turn and at least one sampled token must fit the budget.
        if not ids or len(ep.tokens) + len(ids) + 1 > self.limits.max_tokens:
            self._finish(truncated=True)
            return
        start = len(ep.tokens)
        text = obs.text
        ep.turns.append(Turn("tool", start, start + len(ids), text, name=obs.name, error=obs.error))
        self.pending = list(ids)

    def close_truncated(self) -> None:
        """The loop ran out of budget: the open turn (if any) is closed, the episode cut."""
        if not self.pending and len(self.episode.tokens) > self.turn_start:
            self._close_assistant()
        self._finish(truncated=True)

    def _finish(self, truncated: bool) -> None:
        self.done = True
        self.episode.truncated = truncated
        reward = getattr(self.env, "reward", None)
        self.episode.reward = reward() if callable(reward) else None


def stop_string_tokens(tokenizer, stop_strings: Sequence[str]) -> Callable[[int], bool]:
    """Whether a token can complete a stop string: its text holds a stop string's last
    character (only then is the turn's text decoded and searched)."""
    lasts = {s[-1] for s in stop_strings if s}
    cache: dict[int, bool] = {}

    def may_stop(token: int) -> bool:
        if token not in cache:
            piece = tokenizer.decode([token], skip_special_tokens=False)
            cache[token] = any(c in piece for c in lasts)
        return cache[token]

    return may_stop


# --- From the engine's record to a Rollout ---------------------------------------------------


def assemble_episodes(
    prompts: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    episodes: Sequence[Episode],
    num_generations: int,
    pad_id: int,
    tokenizer,
    functions: EpisodeFunctions | None = None,
) -> Rollout:
    """The padded Rollout of G episodes per prompt (prompts left-padded to P, episodes
    right-padded), with the loss mask over the model's own tokens and the turns."""
    fns = functions or EpisodeFunctions()
    G = num_generations
    streams = [
        list(fns.episode_tokens(prompt_ids[i // G], ep, tokenizer)) for i, ep in enumerate(episodes)
    ]
    if any(not s for s in streams):
        raise ValueError("an episode has no tokens")
    P = max(len(p) for p in prompt_ids)
    C = max(len(s) for s in streams)
    B = len(episodes)
    input_ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, P + C, dtype=torch.long)
    completion_mask = torch.zeros(B, P + C, dtype=torch.long)
    engine_logprobs = torch.zeros(B, P + C - 1)
    for i, (ep, stream) in enumerate(zip(episodes, streams, strict=True)):
        prompt = list(prompt_ids[i // G])
        input_ids[i, P - len(prompt) : P] = torch.tensor(prompt)
        input_ids[i, P : P + len(stream)] = torch.tensor(stream)
        attention_mask[i, P - len(prompt) : P + len(stream)] = 1
        mask = list(fns.episode_mask(ep, len(stream)))[: len(stream)]
        mask = torch.tensor(mask + [0.0] * (len(stream) - len(mask)), dtype=torch.float32)
        completion_mask[i, P : P + len(stream)] = mask.long()
        # entry t is the log-prob of input_ids[:, t+1]: stream token j sits at column P + j.
        n = min(len(stream), len(ep.logprobs))
        engine_logprobs[i, P - 1 : P - 1 + n] = torch.tensor(ep.logprobs[:n]) * mask[:n]
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        group_ids=torch.arange(len(prompts)).repeat_interleave(G),
        prompts=[p for p in prompts for _ in range(G)],
        completions=[fns.answer_text(ep) for ep in episodes],
        truncated=torch.tensor([ep.truncated for ep in episodes], dtype=torch.bool),
        prompt_length=P,
        engine_logprobs=engine_logprobs,
        turns=[list(ep.turns) for ep in episodes],
        episode_rewards=[ep.reward for ep in episodes],
    )


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """Per-episode means: turns (assistant and tool), tool calls, tool errors; the share of
    episodes a budget cut short; tokens the model sampled and tool tokens."""
    if rollout.turns is None:
        return {}
    B = max(1, len(rollout.turns))
    turns = [len(ts) for ts in rollout.turns]
    calls = [sum(t.role == "tool" for t in ts) for ts in rollout.turns]
    errors = [sum(t.role == "tool" and t.error for t in ts) for ts in rollout.turns]
    tool_tokens = (rollout.attention_mask - rollout.completion_mask)[:, rollout.prompt_length :]
    return {
        "episode/turns": sum(turns) / B,
        "episode/turns_max": float(max(turns, default=0)),
        "episode/tool_calls": sum(calls) / B,
        "episode/tool_errors": sum(errors) / B,
        "episode/tool_error_frac": sum(errors) / max(1, sum(calls)),
        "episode/truncated_frac": float(rollout.truncated.float().mean()),
        "episode/tool_tokens": float(tool_tokens.sum()) / B,
    }


class ProbeEnvironment:
    """The preflight's episodes on any model: every character in `stop_strings` ends an
    assistant turn, and the environment answers a turn with a tool turn unless the turn's
    last character's code is a multiple of 3 (so the G samples of a group take different
    numbers of turns); after `max_calls` answers the stop strings are dropped and the last
    turn runs to EOS or its limit (a special token in the stream, which a re-tokenised
    conversation loses). Real tokens, a real decode loop, real tool turns: the layout the
    trainer must get right, without a model that already calls a tool."""

    STOPS = tuple("0123456789 etaoinsr=+-*.,")
    max_calls = 1  # the second assistant turn is the last: fits any rollout.max_turns >= 2

    def __init__(self):
        self.calls = 0
        self.stop_strings = self.STOPS

    def reset(self, prompt: str) -> None:
        self.calls = 0
        self.stop_strings = self.STOPS

    def step(self, text: str) -> Observation:
        if not text or ord(text[-1]) % 3 == 0 or self.calls >= self.max_calls:
            return Observation(done=True)
        self.calls += 1
        if self.calls == self.max_calls:
            self.stop_strings = ()
        return Observation(f"probe {self.calls}", called=True, name="probe")

    def reward(self) -> float | None:
        return None
