"""The drill's workspace: my_grpo.py with the six core functions to write, a README, and the
run directory that `train` writes."""

from __future__ import annotations

import shlex
from pathlib import Path

IMPL_FILE = "my_grpo.py"
RUN_DIR = "runs/drill"


def train_args(directory: str | Path, overrides: list[str] = ()) -> list[str]:
    """`grpolab train`'s arguments that train the demo model with the workspace's functions:
    what the session's `train` runs, and what `grpolab drill check` says to run."""
    directory = Path(directory)
    return [
        "--impl",
        str(directory / IMPL_FILE),
        "--overwrite",
        f"output_dir={directory / RUN_DIR}",
        *overrides,
    ]


def train_command(directory: str | Path) -> str:
    """The shell command that trains with the workspace's functions."""
    return shlex.join(["grpolab", "train", *train_args(directory)])


MY_GRPO = '''"""My GRPO core: the six functions of GRPO, written by hand.

Shapes: B sequences (= n_prompts * G, the G samples of one prompt contiguous), T tokens per
sequence (left-padded prompt + completion + right padding). Log-prob tensors are [B, T-1],
aligned with input_ids[:, 1:].

Replace each `raise NotImplementedError` with your code, then type `check` in the drill
(or save the file: the drill re-checks it). `hint N` gives a hint for goal N.
"""

import torch


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """Goal 1. Log-prob of each sampled token under `model` at the sampling temperature.

    input_ids, attention_mask, completion_mask: [B, T] (prompt + completion, padded).
    Returns (logp, mask), both [B, T-1] float32:
      logp[:, t] = log-prob of input_ids[:, t+1] (logits at position t predict token t+1),
      computed in float32 from logits / temperature;
      mask[:, t] = completion_mask[:, t+1] (1 on completion tokens, 0 on prompt and padding).
    Prompts are left-padded: pass position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    to the model, as generate() numbers the real tokens.
    """
    raise NotImplementedError


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """Goal 2. Each reward minus its group's mean, divided by the group's std + eps.

    rewards: [B], B = n_groups * group_size; the group_size samples of a prompt are
    contiguous. Use the population std (divide by group_size: the drill's declared
    convention; TRL and verl divide by group_size - 1). Where a group's std <= eps
    the advantage is exactly 0. Returns [B].
    scale: "group" (the drill checks this one); the trainer may also pass "batch" (the
    population std of the whole batch) or "none" (mean-centred only).
    """
    raise NotImplementedError


def policy_loss(logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2):
    """Goal 4. The per-token clipped surrogate.

    logp_new, logp_old, mask: [B, T]; advantages: [B], the same for every token of a sequence.
    ratio = exp(logp_new - logp_old); clipped = ratio clamped to [1 - eps_low, 1 + eps_high].
    Returns (per_token [B, T], clip_frac scalar tensor):
      per_token = -min(ratio * A, clipped * A)  (minus: we minimise);
      clip_frac = fraction of the masked tokens where (ratio * A) > (clipped * A).
    """
    raise NotImplementedError


def kl_k3(logp_new, logp_ref):
    """Goal 5. Schulman's k3 estimate of KL(new || ref) per token.

    logp_new, logp_ref: [B, T]. Returns [B, T]: exp(d) - d - 1 with d = logp_ref - logp_new.
    """
    raise NotImplementedError


def aggregate(per_token, mask, mode, max_completion_length=None):
    """Goal 6. Reduce per-token values [B, T] to a scalar over the masked tokens only.

    mode "sequence": mean over each sequence's tokens, then over sequences (the default);
    mode "token": sum over all masked tokens / number of masked tokens;
    mode "constant": sum over all masked tokens / (B * max_completion_length).
    Returns a scalar tensor.
    """
    raise NotImplementedError


def grpo_loss(
    logp_new,
    logp_old,
    logp_ref,
    advantages,
    mask,
    eps_low=0.2,
    eps_high=0.28,
    beta=0.0,
    loss_agg="sequence",
    max_completion_length=None,
):
    """Goals 3, 6 and 7. The assembled loss: clipped surrogate + beta * k3 KL per token.

    logp_new, logp_old, mask: [B, T]; logp_ref: [B, T] or None; advantages: [B].
    The KL term is added only when beta > 0 and logp_ref is given. Aggregate with
    aggregate(per_token, mask, loss_agg, max_completion_length).
    Returns (loss, metrics): loss a scalar tensor; metrics a dict of floats with
      loss, clip_frac, clip_frac_low (ratio < 1 - eps_low where A < 0),
      clip_frac_high (ratio > 1 + eps_high where A > 0), kl (0.0 without logp_ref),
      adv_std, ratio_mean;
    every token statistic a mean over the masked tokens only.
    """
    raise NotImplementedError
'''

README = """# My GRPO drill

`my_grpo.py` holds the six functions of GRPO's core with their contracts and no bodies.
Write them one by one; the drill measures every intermediate quantity on a real model and
a real rollout batch and tells you which goal passes.

    grpolab drill .            # the interactive drill in this directory
    grpolab drill check .      # the checks once (exit 0 when all seven goals pass)

In the drill: `goals` lists the seven goals, `check` runs the checks (saving my_grpo.py
re-runs them), `hint [N]` gives the next hint for goal N, `show N` prints goal N's
quantity on the real batch, and `train` (once every goal passes) trains the demo model
with your functions. Progress is kept in `.drill.json`; every session starts the hints at
hint 1, and `grpolab drill . --continue` goes on from the hints seen in earlier sessions.
"""

FILES = {"my_grpo.py": MY_GRPO, "README.md": README}


def init_workspace(directory: str | Path) -> tuple[list[Path], list[Path]]:
    """Write the workspace files that do not exist yet. Returns (written, kept)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for name, text in FILES.items():
        path = directory / name
        if path.exists():
            kept.append(path)
            continue
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written, kept
