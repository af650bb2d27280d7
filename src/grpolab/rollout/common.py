"""What every engine shares: prompt rendering and checks, and assembling a Rollout from
per-sample token lists (so that each engine only has to produce tokens and log-probs)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from grpolab import core
from grpolab.model.policy import eval_mode
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.tasks.conversation import Conversation


def draw_multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of probs [n, V] -> [n] long: torch.multinomial, which draws an
    exponential per entry and takes argmax(p / q)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw_inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of probs [n, V] -> [n] long, distributed as probs: the first index
    whose cumulative sum exceeds a uniform draw u in [0, total). In two levels, so that no
    [n, V] temporary is made (on a CPU each new 25 MB buffer costs more in page faults than
    the arithmetic): blocks of about sqrt(V) entries, the block whose float64 cumulative sum
    passes u, then the entry within it that passes what is left of u. An entry or block of
    probability 0 is never drawn (its cumulative sum equals its predecessor's)."""
    n, V = probs.shape
    width = max(1, math.isqrt(V))
    full = V // width * width
    sums = [probs[:, :full].reshape(n, -1, width).sum(-1, dtype=torch.float64)]  # [n, V // w]
    if full < V:
        sums.append(probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64))
    blocks = torch.cat(sums, dim=1).cumsum(dim=1)  # [n, blocks]
    u = torch.rand((n, 1), generator=generator, dtype=torch.float64, device=probs.device)
    u = below(u * blocks[:, -1:], blocks[:, -1:])  # [n, 1]
    block = torch.searchsorted(blocks, u, right=True)  # [n, 1]
    before = torch.where(block > 0, blocks.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * width + torch.arange(width, device=probs.device)  # [n, w]
    inside = probs.gather(1, columns.clamp(max=V - 1)).double()
    inside = inside.masked_fill(columns >= V, 0.0).cumsum(dim=1)  # [n, w]
    rest = below(u - before, inside[:, -1:])  # >= 0: before <= u
    return (block * width + torch.searchsorted(inside, rest, right=True)).squeeze(-1)


def below(value: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`value` kept strictly under `bound` (where rounding took it to the bound)."""
    return torch.minimum(value, torch.nextafter(bound, torch.zeros_like(bound)))


SAMPLERS = {"multinomial": draw_multinomial, "inverse_cdf": draw_inverse_cdf}


def check_sampling(num_generations: int, params: SamplingParams) -> None:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int):
        raise ValueError(f"num_generations must be an int, got {num_generations!r}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if not params.temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if params.sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {params.sampler!r}")
    if params.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {params.max_completion_length}")


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, model_eos: int | list[int] | None
) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (chat models end turns
    with a token of their own, e.g. <|im_end|>)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if model_eos is not None:
        ids.extend(int(i) for i in ([model_eos] if isinstance(model_eos, int) else model_eos))
    ids = list(dict.fromkeys(ids))
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model config names none")
    return ids


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token")
    return int(pad)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    chat_template: bool = False,
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The text the model sees: the prompt itself, or the chat template's rendering of it as
    the user turn (with a system turn first when system_prompt is set, and the tools' JSON
    schemas through the template's `tools=` when given). A Conversation (a conversational
    prompt) is always rendered through the template, as TRL does, with system_prompt first
    unless it has a system turn of its own."""
    conversation = isinstance(prompt, Conversation)
    if not chat_template and not conversation:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "task.chat_template is true but the tokenizer has no chat_template; "
            "set task.chat_template=false or use a chat model's tokenizer"
            if not conversation
            else "the task's prompts are conversations (lists of messages) but the tokenizer "
            "has no chat_template to render them: use a chat model's tokenizer, or text prompts"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if conversation:
        turns = prompt.as_list()
        messages = turns if turns[0]["role"] == "system" else messages + turns
    else:
        messages.append({"role": "user", "content": prompt})
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **extra
    )


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_completion_length: int,
    context_length: int | None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
) -> list[list[int]]:
    """Token ids of each (rendered) prompt, checked: non-empty and fitting the context with
    room for max_completion_length new tokens (an episode's whole budget)."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    encoded = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt {i} is empty: {prompt!r}")
        text = render_prompt(tokenizer, prompt, chat_template, system_prompt, tools)
        # A chat template writes its own special tokens (BOS included).
        ids = tokenizer(text, add_special_tokens=not chat_template)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens: {prompt!r}")
        if context_length is not None and len(ids) + max_completion_length > context_length:
            raise ValueError(
                f"prompt {i} ({_preview(prompt)}) is {len(ids)} tokens; with "
                f"max_completion_length={max_completion_length} that exceeds the model context "
                f"of {context_length} tokens"
            )
        encoded.append(list(ids))
    return encoded


def checked_prompt_ids(
    engine, prompts: Sequence[str], num_generations: int, params: SamplingParams
) -> list[list[int]]:
    """What every engine's generate() starts with: the sampling settings checked and the
    prompts rendered and encoded with the engine's tokenizer, chat template and context."""
    check_sampling(num_generations, params)
    episodes = engine.episodes
    new_tokens = params.max_completion_length
    if episodes is not None:
        new_tokens = params.max_episode_tokens or episodes.max_tokens
    system_prompt, tools = prompt_settings(engine)
    return encode_prompts(
        engine.tokenizer,
        prompts,
        new_tokens,
        engine.context_length,
        engine.chat_template,
        system_prompt,
        tools,
    )


def prompt_settings(engine) -> tuple[str | None, list[dict] | None]:
    """(system prompt, tool schemas) an engine renders its prompts with: an episode's tools
    go through the chat template's `tools=`, or into the system prompt for a template
    without tool support."""
    episodes = engine.episodes
    system_prompt, tools = engine.system_prompt, None
    if episodes is not None:
        tools = episodes.schemas or None
        if episodes.tool_description:  # a template without tool support: a system prompt
            system_prompt = "\n\n".join(filter(None, [system_prompt, episodes.tool_description]))
    return system_prompt, tools


def longest_prompt(engine, prompts: Sequence[str], room: int) -> tuple[int, int] | None:
    """(index, tokens) of the longest of `prompts` as the engine renders and encodes them,
    when it and `room` more tokens might not fit the engine's context; None when every
    prompt provably fits. A token holds at least one byte of the rendered text (byte-level
    BPE, SentencePiece, character vocabularies), so a prompt whose bytes plus the template's
    own and a few special tokens fit is not encoded: a large task costs no tokenizing."""
    context = engine.context_length
    if not context or not prompts:
        return None
    tokenizer, template = engine.tokenizer, engine.chat_template
    system_prompt, tools = prompt_settings(engine)
    frame = render_prompt(tokenizer, "x", template, system_prompt, tools)  # the template's text
    overhead = len(frame.encode()) + 8  # and the special tokens a tokenizer adds (BOS, ...)
    suspects = [i for i, p in enumerate(prompts) if len(p.encode()) + overhead + room > context]
    if not suspects:
        return None
    chosen = [prompts[i] for i in suspects]
    encoded = encode_prompts(tokenizer, chosen, 0, None, template, system_prompt, tools)
    longest = max(range(len(suspects)), key=lambda j: len(encoded[j]))
    return suspects[longest], len(encoded[longest])


def assemble_rollout(
    prompts: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    completion_logprobs: Sequence[Sequence[float]] | None,
    num_generations: int,
    stop_ids: Sequence[int],
    pad_id: int,
    tokenizer: PreTrainedTokenizerBase,
) -> Rollout:
    """Build the padded Rollout from per-sample lists in rollout order (sample i answers prompt
    i // G). A completion is cut after its first stop token (kept, masked 1); a completion
    without one is `truncated`. Prompts are left-padded, completions right-padded with pad_id."""
    G = num_generations
    B = len(prompts) * G
    if len(completion_ids) != B:
        raise ValueError(
            f"got {len(completion_ids)} completions for {len(prompts)} prompts x G={G}"
        )
    stops = set(stop_ids)
    cut_ids, cut_logps, truncated = [], [], []
    for i, ids in enumerate(completion_ids):
        ids = list(ids)
        end = next((j + 1 for j, t in enumerate(ids) if t in stops), None)
        truncated.append(end is None)
        end = len(ids) if end is None else end
        if end == 0:
            raise ValueError(f"sample {i} has an empty completion")
        cut_ids.append(ids[:end])
        if completion_logprobs is not None:
            cut_logps.append(list(completion_logprobs[i])[:end])
    P = max(len(p) for p in prompt_ids)
    C = max(len(c) for c in cut_ids)
    T = P + C
    # One tensor per field from padded lists, masks from lengths: no per-sample tensor ops.
    prompt_len = torch.tensor([len(p) for p in prompt_ids]).repeat_interleave(G)[:, None]  # [B,1]
    comp_len = torch.tensor([len(c) for c in cut_ids])[:, None]  # [B, 1]
    padded_prompts = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompt_ids])
    input_ids = torch.cat(
        [
            padded_prompts.repeat_interleave(G, dim=0),
            torch.tensor([c + [pad_id] * (C - len(c)) for c in cut_ids], dtype=torch.long),
        ],
        dim=1,
    )  # [B, T]
    cols = torch.arange(T)[None, :]
    completion_end = P + comp_len
    attention_mask = ((cols >= P - prompt_len) & (cols < completion_end)).long()
    completion_mask = ((cols >= P) & (cols < completion_end)).long()
    engine_logprobs = None
    if completion_logprobs is not None:
        # entry t is the log-prob of input_ids[:, t+1]: completion token j sits at P + j.
        engine_logprobs = torch.zeros(B, T - 1)
        engine_logprobs[:, P - 1 :] = torch.tensor(
            [lp + [0.0] * (C - len(lp)) for lp in cut_logps], dtype=torch.float32
        )
    # the stop token is not text
    text_ids = [c if cut else c[:-1] for c, cut in zip(cut_ids, truncated, strict=True)]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in text_ids]
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        group_ids=torch.arange(len(prompts)).repeat_interleave(G),
        prompts=[p for p in prompts for _ in range(G)],
        completions=texts,
        truncated=torch.tensor(truncated, dtype=torch.bool),
        prompt_length=P,
        engine_logprobs=engine_logprobs,
    )


def _preview(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


# --- The weight-sync canary ---------------------------------------------------------------------
# An engine that samples from its own copy of the weights (vLLM; the HF engine's bf16 copies)
# is checked after every sync: a canary sequence's log-probs from the engine and from the
# trainer's model must agree to the copy's precision.
CANARY_TEXT = "Canary 12+34=46; 7*8=56. The weights in both engines agree."


class WeightSyncError(RuntimeError):
    """The engine's weights after a sync do not give the trainer's log-probs."""


def default_sync_tolerance(dtype: str) -> float:
    """The largest canary gap a sync may leave for an engine copy in `dtype`."""
    return 1e-3 if dtype == "float32" else 0.1


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The trainer's log-prob of each token of `ids` after the first, temperature 1: [T-1]."""
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)  # [1, T]
    ones = torch.ones_like(input_ids)
    with eval_mode(model):
        logp, _ = core.sequence_logprobs(model, input_ids, ones, ones)  # [1, T-1]
    return logp[0].float().cpu()
