"""A learned reward: a sequence-classification model scores (prompt, completion) in-process.

    rewards.functions: [accuracy, path/to/reward-model]        # or a hub id, "org/name"
    GRPOTrainer(..., reward_funcs=["org/reward-model", my_fn])  # or a loaded model

Each call scores the batch in chunks of `batch_size` with the model's own tokenizer: the
conversation [user: prompt, assistant: completion] through its chat template when it has
one, else the prompt followed by the completion; the reward is logits[:, 0] (TRL's
convention; a single-label head is the usual reward model). Texts longer than the model's
context are cut on the left, so the completion being judged is kept.

It is called like any reward function, so its failures and time go through the same
accounting (rewards.timeout, rewards.fallback, reward_errors/<name>). The preflight's reward
probes score it on every probe and report how often it ranks the reference above a wrong
answer, but hold it to none of the probes' demands: a learned preference is not a rule, and
an imperfect reward model is the user's choice, not a bug of the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpolab.model.policy import load_tokenizer

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"  # the architectures' suffix


def is_model_reference(ref: str) -> bool:
    """A reward name that can only be a model: a directory, or a hub id ("org/name")."""
    if ":" in ref:  # "module:function", "file.py:function"
        return False
    path = Path(ref).expanduser()
    if path.is_dir():
        return True
    if path.suffix == ".py" or path.exists():
        return False
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "~"))


def model_display_name(ref: str) -> str:
    """The name in metrics: the directory's or the hub id's last part ("rewards/<it>/mean")."""
    return Path(ref.rstrip("/")).name or ref


class RewardModel:
    """A reward function backed by a sequence-classification model (see the module doc).

    source: a local directory, a hub id, or a loaded `*ForSequenceClassification` model
    (then `tokenizer` or the model's name_or_path gives its tokenizer)."""

    learned = True  # the reward probes report it, and hold it to no demand

    def __init__(
        self,
        source: str | Path | torch.nn.Module,
        tokenizer: Any = None,
        batch_size: int = 16,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        from transformers import AutoModelForSequenceClassification

        if batch_size < 1:
            raise ValueError(f"reward model batch_size={batch_size!r}: expected an integer >= 1")
        if isinstance(source, torch.nn.Module):
            model = source
            self.source = str(getattr(model, "name_or_path", "") or type(model).__name__)
        else:
            self.source = str(source)
            check_reward_model_dir(self.source)
            local = Path(self.source).expanduser()
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    str(local) if local.is_dir() else self.source, dtype=dtype
                )
            except (OSError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(
                    f"reward {self.source!r}: cannot load a sequence-classification model ({first})"
                ) from None
        architecture = type(model).__name__
        if not architecture.endswith(SEQUENCE_CLASSIFICATION):
            raise ValueError(
                f"reward {self.source!r}: a {architecture} is not a reward model (expected a "
                f"*{SEQUENCE_CLASSIFICATION} model whose logits[:, 0] is the reward)"
            )
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(self.source)
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"reward {self.source!r}: its tokenizer has no pad or eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # keep the completion being judged
        # The head reads the last token that is not padding: the model must know the pad id.
        model.config.pad_token_id = self.tokenizer.pad_token_id
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.max_length = _context_length(self.model, self.tokenizer)
        self.__name__ = self.__qualname__ = model_display_name(self.source)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model reads for each (prompt, completion)."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            completion = _text(completion)
            if not self.chat:
                out.append(_text(prompt) + completion)
                continue
            turns = (
                list(prompt)
                if isinstance(prompt, list)
                else [{"role": "user", "content": str(prompt)}]
            )
            turns.append({"role": "assistant", "content": completion})
            out.append(self.tokenizer.apply_chat_template(turns, tokenize=False))
        return out

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        values: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=not self.chat,  # a chat template writes its own
                ).to(self.device)
                logits = self.model(**batch).logits  # [b, num_labels]
                values += logits[:, 0].float().tolist()
        return values

    def __deepcopy__(self, memo: dict) -> RewardModel:
        return self  # a loaded scorer: copies of a config share it

    def __repr__(self) -> str:
        return f"RewardModel({self.source!r})"


def check_reward_model_dir(ref: str) -> None:
    """A local directory must hold a sequence-classification model's config: a one-line error
    names what it holds instead (a causal LM, no config.json)."""
    path = Path(ref).expanduser()
    if not path.is_dir():
        return  # a hub id: from_pretrained says what it finds
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"reward {ref!r}: the directory has no config.json (not a model)")
    architectures = json.loads(config.read_text()).get("architectures") or []
    if architectures and not any(a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures):
        raise ValueError(
            f"reward {ref!r}: the model there is a {', '.join(architectures)}, not a reward "
            f"model (expected a *{SEQUENCE_CLASSIFICATION} model whose logits[:, 0] is the "
            "reward)"
        )


def _load_tokenizer(source: str):
    path = Path(source).expanduser()
    try:
        return load_tokenizer(str(path) if path.is_dir() else source)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"reward {source!r}: cannot load its tokenizer ({e}); pass one: "
            "grpolab.rewards.RewardModel(model, tokenizer=...)"
        ) from None


def _context_length(model: torch.nn.Module, tokenizer: Any) -> int | None:
    limits = [getattr(model.config, "max_position_embeddings", None)]
    limit = getattr(tokenizer, "model_max_length", None)
    limits.append(limit if isinstance(limit, int) and limit < 1_000_000 else None)
    limits = [n for n in limits if n]
    return min(limits) if limits else None


def _text(value: Any) -> str:
    """A completion or prompt as text: TRL's conversational form is a list of messages."""
    if isinstance(value, list):
        return "".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
    return str(value)
