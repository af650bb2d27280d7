"""The training loop's config sections, each small and typed, its keys' constraints declared on
the fields (grpolab.schema.key) and its rules between keys beside it. Before these sections
every key here lived in one `trainer` section: each field names its old key (`legacy`) where
it is not trainer.<its name>, and the config reads the old names as aliases."""

from __future__ import annotations

from dataclasses import dataclass

from grpolab.model.precision import PRECISIONS
from grpolab.schema import SchemaError, above, at_least, fraction, key


def _int_at_least(n: int) -> dict:
    return {"check": lambda v: v >= n, "expected": f"an integer >= {n}"}


@dataclass(frozen=True)
class BatchConfig:
    """prompts_per_step prompts x num_generations samples = B sequences per step; one optimizer
    step per minibatch of mini_batch_size sequences, each accumulated over
    gradient_accumulation_steps micro-batches."""

    prompts_per_step: int = key(16, **_int_at_least(1))
    num_generations: int = key(8, **_int_at_least(2))  # G
    # TRL's name for B; when set, prompts_per_step = generation_batch_size / num_generations.
    generation_batch_size: int | None = None
    mini_batch_size: int | None = None  # sequences per optimizer step; None = the whole batch
    gradient_accumulation_steps: int = key(1, **_int_at_least(1))
    # Micro-batches cut by tokens too: each of the gradient_accumulation_steps micro-batches
    # cut again into consecutive rows that run at most this many positions packed into one
    # sequence without padding, each group's prompt once (model/packed.py; a row longer than
    # the budget runs alone). The same gradient as padded, to rounding (the preflight's
    # packing.exact); for long, uneven completions. null: the micro-batches padded.
    max_tokens_per_microbatch: int | None = key(
        None,
        check=lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 2),
        expected="null or an integer >= 2",
        resume_free=True,
    )

    @property
    def size(self) -> int:
        return self.prompts_per_step * self.num_generations

    def rules(self) -> None:
        batch, G = self.size, self.num_generations
        if self.generation_batch_size is not None and (
            self.generation_batch_size <= 0 or self.generation_batch_size % G
        ):
            raise SchemaError(
                "generation_batch_size",
                self.generation_batch_size,
                f"a positive multiple of batch.num_generations={G}",
            )
        mini = self.mini_batch_size
        if mini is not None and not 1 <= mini <= batch:
            raise SchemaError(
                "mini_batch_size",
                mini,
                f"between 1 and the batch size prompts_per_step * num_generations = {batch}",
            )
        if mini is not None and batch % mini:
            raise SchemaError("mini_batch_size", mini, f"a divisor of the batch size {batch}")
        if (mini or batch) % self.gradient_accumulation_steps:
            raise SchemaError(
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
                f"a positive divisor of the minibatch size {mini or batch}",
            )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW; gradients clipped to a global norm."""

    learning_rate: float = key(3e-4, **above(0))
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    max_grad_norm: float = key(1.0, **at_least(0))  # 0 = no clipping (the norm is still measured)


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning rate over optimizer steps."""

    lr_scheduler: str = key("constant", choices=("constant", "cosine"))
    warmup_steps: int = key(0, **_int_at_least(0))  # linear warm-up, in optimizer steps


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged, and how often."""

    # The console line every N steps (and the first, and any step with a problem);
    # metrics.jsonl has every step whatever it is (TRL: logging_steps).
    logging_steps: int = key(10, **_int_at_least(1), resume_free=True)
    # Sample completions to completions.jsonl every N steps; 0 = never.
    log_completions_steps: int = key(25, **_int_at_least(0), resume_free=True)
    log_completions_count: int = key(4, resume_free=True)
    # tensorboard | wandb | trackio
    report_to: list[str] = key(
        default_factory=list,
        check=lambda v: all(s in ("tensorboard", "wandb", "trackio") for s in v),
        expected="a list of tensorboard, wandb, trackio",
        resume_free=True,
    )
    progress: bool = key(True, resume_free=True)  # progress bar with ETA


@dataclass(frozen=True)
class CheckpointConfig:
    save_steps: int = key(0, **_int_at_least(0), resume_free=True)  # 0 = only at the end
    # Keep this many checkpoints; None = all.
    save_total_limit: int | None = key(
        2, check=lambda v: v is None or v >= 1, expected=">= 1", resume_free=True
    )


@dataclass(frozen=True)
class EvalConfig:
    """Greedy held-out accuracy: before training, every eval_steps, after."""

    eval_steps: int = key(100, **_int_at_least(0), resume_free=True)  # 0 = only before/after
    # Held-out problems per evaluation (at most the task's eval set).
    eval_examples: int = key(500, **_int_at_least(0), resume_free=True)
    # None = rollout.max_completion_length.
    eval_max_completion_length: int | None = key(None, resume_free=True)
    # Sequences per generate call of an evaluation (TRL: per_device_eval_batch_size); None: a
    # training step's batch (prompts_per_step x num_generations).
    eval_batch_size: int | None = key(
        None, check=lambda v: v is None or v >= 1, expected="an integer >= 1, or null",
        resume_free=True,
    )  # fmt: skip


@dataclass(frozen=True)
class MonitorsConfig:
    """The runtime monitors (grpolab.train.monitors) and the stops."""

    # warn (default), stop (checkpoint, then exit) or off.
    action: str = key(
        "warn", choices=("warn", "stop", "off"), legacy="trainer.monitor", resume_free=True
    )
    clip_frac_max: float = key(
        0.3, **fraction(), legacy="trainer.monitor_clip_frac_max", resume_free=True
    )
    zero_std_max: float = key(
        0.95, **fraction(), legacy="trainer.monitor_zero_std_max", resume_free=True
    )
    # Rewarded-as-right fraction minus strict accuracy, mean of the last 8 steps: above it,
    # the reward pays for answers that are not the reference (a gamed reward). Raise it for
    # tasks with symbolic answers, which math-verify matches and the text-exact strict check
    # does not.
    reward_strict_gap: float = key(0.1, **fraction(), legacy="trainer.monitor_reward_strict_gap")
    # objective.tis_cap: the share of tokens (or of sequences) whose importance weight the cap
    # truncated or dropped; above it the engine and the trainer are far apart. A step whose
    # every weight was dropped (a loss of exactly 0) always stops the run.
    tis_capped_max: float = key(0.2, **fraction(), resume_free=True)
    # Stop after this many skipped (non-finite) steps in a row.
    max_consecutive_nonfinite: int = key(3, **_int_at_least(1), resume_free=True)
    # Stop (with a checkpoint) when a reward function has failed on every sample of this many
    # steps in a row: its rewards are all the fallback, so GRPO learns nothing from it.
    max_consecutive_reward_failures: int = key(3, **_int_at_least(1), resume_free=True)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the same maths is computed: threads, precision, the log-prob path, memory and
    compute trade-offs. A resumed run may change any of these."""

    num_threads: int | None = key(None, resume_free=True)  # torch CPU threads; None: torch's
    # auto | fp32 | bf16 (grpolab.model.precision): bf16 runs the training forwards under bf16
    # autocast (matmuls in bfloat16, log-softmax still float32) while weights, gradients and
    # AdamW stay in model.dtype (fp32 master); auto is bf16 where the device multiplies bf16
    # natively (a CUDA GPU with bf16, a CPU with AMX or AVX512-BF16), fp32 elsewhere. The
    # default stays fp32: a tiny model's matmuls are too small to gain, and the demo's numbers
    # stay the same on every machine; the real-model example sets auto.
    precision: str = key("fp32", choices=PRECISIONS, resume_free=True)
    # fused (grpolab.model.logprobs) | naive (core.sequence_logprobs; "core" is its older name)
    logprobs: str = key("fused", choices=("fused", "naive", "core"), resume_free=True)
    # fused: run each group's shared prompt through the model once, its G completions against
    # that prompt's keys and values (exact; checked against one forward per row at first use).
    shared_prefix: bool = key(True, resume_free=True)
    # Rows whose advantage is exactly 0 (a group whose rewards are all equal, dynamic
    # sampling's filler) or that are out of the loss add exactly 0 to the gradient when
    # nothing else in the loss reads them (beta = 0, entropy_coef = 0): the update skips
    # their forward and backward, the normaliser unchanged (`skips_zero_advantage`).
    skip_zero_advantage: bool = key(True, resume_free=True)
    # Recompute each decoder layer's activations in backward: less memory, ~30% more compute.
    gradient_checkpointing: bool = key(False, resume_free=True)
    # torch.compile the MLP and norms of every decoder layer (dynamic shapes, one graph for
    # all layers; attention stays eager): fuses their elementwise ops. Pays on GPUs over a
    # long run; on a CPU the first steps spend seconds to minutes compiling (docs/SCALING.md).
    torch_compile: bool = key(False, resume_free=True)


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallel under torchrun (on one process these act on nothing)."""

    # ddp (a replica per rank, gradients summed) | fsdp (FSDP2 fully_shard).
    strategy: str = key(
        "ddp", choices=("ddp", "fsdp"), legacy="trainer.distributed", resume_free=True
    )
    # ddp: DistributedDataParallel's bucket_cap_mb: gradients are summed in buckets of this
    # many MiB, each starting as soon as backward has finished its gradients (communication
    # overlaps the rest of the backward pass).
    ddp_bucket_mb: float = key(25.0, **above(0), resume_free=True)
    # local: each rank samples only its prompts' groups | replicated: every rank samples the
    # whole global batch and keeps its groups (W x the rollout cost; the batch is exactly the
    # 1-process batch, for verifying a multi-rank setup against one process).
    rollout_split: str = key("local", choices=("local", "replicated"))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (needs the `lora` extra, peft): r > 0 trains low-rank adapters on target_modules
    and freezes the base weights; 0 = full fine-tuning."""

    r: int = key(0, **_int_at_least(0), legacy="trainer.lora_r")
    alpha: int = key(16, legacy="trainer.lora_alpha")
    dropout: float = key(
        0.0,
        check=lambda v: 0 <= v < 1,
        expected="a number in [0, 1)",
        legacy="trainer.lora_dropout",
    )
    target_modules: list[str] = key(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        legacy="trainer.lora_target_modules",
    )

    def rules(self) -> None:
        if self.r > 0 and not self.target_modules:
            raise SchemaError("target_modules", [], "module names")


# The sections above and their keys in the config tree, in its order.
TRAINER_SECTIONS = {
    "batch": BatchConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "logging": LoggingConfig,
    "checkpoints": CheckpointConfig,
    "eval": EvalConfig,
    "monitors": MonitorsConfig,
    "runtime": RuntimeConfig,
    "parallel": ParallelConfig,
    "lora": LoraConfig,
}
# Runs on one thread unless told otherwise: the demo's tiny model gains nothing from more, and
# on a shared CPU a second thread made steps 5-10x slower (measured: 0.6 s vs 6 s per step
# under load 6).
DEMO_RUNTIME = RuntimeConfig(num_threads=1)
