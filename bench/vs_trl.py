"""grpolab against TRL's GRPOTrainer on the same GRPO work, side by side.

Both trainers start from the shipped warm-up model (a tiny Llama, char tokenizer), see the
same arithmetic prompts in the same order (grpolab's draw for the seed, given to TRL as an
unshuffled dataset), score them with the same exact-match reward, and run with the same
settings: G, prompts per step, max completion length, temperature, learning rate (constant),
AdamW betas, grad clipping, epsilon / epsilon_high, beta, loss aggregation (TRL loss_type),
group reward scaling, one optimizer step per generation batch, float32 on the CPU. Two
pairings (PAIRINGS), each trainer computing its own advantages: grpolab's defaults against
TRL set to match them, and grpolab's `trainer.profile=trl` against TRL's own defaults.

Each (trainer, seed) runs in its own process, so peak RSS (ru_maxrss) is its own. Step time
is the median over the steps after the first; the split is generation / log-probs (+ reward)
/ update. For TRL the split comes from wrapping its own methods in the worker process:
generation = `_generate`, rewards = `_calculate_rewards`, log-probs = the rest of
`_generate_and_score_completions`, update = the rest of the step (loss forward, backward,
optimizer). A parity line checks, on one fixed batch (same weights, completions, advantages),
that grpolab's loss equals TRL's `compute_loss` for each matching loss_type.

    pip install -e '.[bench]'
    python bench/vs_trl.py                      # 10 steps each, seeds 0 1 2, ~3-5 minutes
    python bench/vs_trl.py --steps 20 --seeds 0 --json out.json
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

# grpolab loss aggregation -> TRL loss_type with the same formula.
LOSS_TYPES = {"sequence": "grpo", "token": "bnpo", "constant": "dr_grpo"}
# The fair pairings, each trainer computing its own advantages:
#   matched:      grpolab's defaults (the seed profile) against TRL configured to match as far
#                 as TRL can (loss_type, epsilon_high, no KL bias correction); TRL has no
#                 population std and no zero-std guard, so those two stay TRL's.
#   trl_defaults: grpolab with trainer.profile=trl against TRL's GRPOConfig defaults.
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
        None,
        [
            f"output_dir={output_dir}",
            f"max_steps={s.steps}",
            f"seed={seed}",
            "task.name=arithmetic",
            "rewards.functions=[accuracy]",
            f"rollout.temperature={s.temperature}",
            f"rollout.max_completion_length={s.max_completion_length}",
            f"trainer.prompts_per_step={s.prompts_per_step}",
            f"trainer.num_generations={s.num_generations}",
            *objective_overrides(s),
            f"trainer.beta={s.beta}",
            "trainer.num_iterations=1",
            "trainer.scale_rewards=group",
            f"trainer.learning_rate={s.learning_rate}",
            "trainer.lr_scheduler=constant",
            f"trainer.adam_beta2={s.adam_beta2}",
            f"trainer.max_grad_norm={s.max_grad_norm}",
            "trainer.eval_examples=0",
            f"trainer.num_threads={s.threads}",
            "trainer.progress=false",
        ],
    )


def objective_overrides(s: Settings) -> list[str]:
    """grpolab's side of the pairing: its profile, or the explicit clip and loss settings."""
    if s.pairing == "trl_defaults":
        return ["trainer.profile=trl"]
    return [
        f"trainer.epsilon={s.epsilon}",
        f"trainer.epsilon_high={s.epsilon_high}",
        f"trainer.loss_type={s.loss_agg}",
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

    from grpolab.models import load_policy
    from grpolab.setup import DEMO_MODEL_DIR

    transformers.utils.logging.disable_progress_bar()

    return load_policy(str(DEMO_MODEL_DIR), dtype="float32", device=torch.device("cpu"))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --- grpolab worker ---------------------------------------------------------------------------


def run_grpolab(s: Settings, seed: int) -> WorkerResult:
    from grpolab.setup import build_run
    from grpolab.step import grpo_step

    torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = grpolab_config(s, seed, tmp)
        torch.manual_seed(seed)
        model, tokenizer = load_demo_model()
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
    kwargs = dict(
        output_dir=output_dir,
        max_steps=s.steps,
        seed=seed,
        data_seed=seed,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
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
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
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


def make_trl_trainer(s: Settings, seed: int, output_dir: str, model, tokenizer, pairs, **over):
    from datasets import Dataset
    from trl import GRPOTrainer

    dataset = Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})
    return GRPOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=trl_args(s, seed, output_dir, **over),
        train_dataset=dataset,
        processing_class=tokenizer,
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
        model, tokenizer = load_demo_model()
        trainer = make_trl_trainer(s, seed, tmp, model, tokenizer, pairs)
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
    )


# --- Loss parity on one fixed batch -----------------------------------------------------------


def loss_parity(loss_agg: str, beta: float = 0.0, seed: int = 0, s: Settings | None = None):
    """(grpolab loss, TRL loss) on one fixed batch: the warm-up model's own rollout of the
    seed's first prompts, grpolab's rewards and advantages fed to both."""
    from grpolab import core
    from grpolab.functions import core_functions
    from grpolab.rewards import load_rewards, score
    from grpolab.rollout.hf import HFEngine
    from grpolab.tasks import load_task

    s = s or Settings(steps=1, prompts_per_step=4, num_generations=4)
    s = Settings(**{**asdict(s), "loss_agg": loss_agg, "beta": beta})
    cfg = grpolab_config(s, seed, "unused")
    torch.manual_seed(seed)
    model, tokenizer = load_demo_model()
    task = load_task(cfg.task)
    examples = task.sample(s.prompts_per_step, torch.Generator().manual_seed(seed))
    engine = HFEngine(model, tokenizer)
    G = s.num_generations
    rollout = engine.generate([e.prompt for e in examples], G, cfg.rollout.sampling(seed=seed))
    rewards = score(rollout, examples, load_rewards(cfg.rewards, task=cfg.task)).total
    advantages = core.group_advantages(rewards, G, scale="group")
    if not advantages.abs().sum() > 0:  # every group equal: a loss of 0 on both sides proves little
        advantages = torch.linspace(-1.0, 1.0, rewards.shape[0])
    # A second, perturbed model as the reference, so the KL term is not identically 0.
    ref = None
    if beta > 0:
        ref, _ = load_demo_model()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn_like(p))

    C = core_functions(cfg.trainer.logprobs)
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
    return float(ours), float(theirs)


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
        "trl_defaults": "grpolab trainer.profile=trl vs TRL's GRPOConfig defaults (dapo, "
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
    return {
        "grpolab": ours,
        "trl": theirs,
        "ratio": ratio,
        "reward_curves": curves,
        "final_reward_diff": ours["final_reward"] - theirs["final_reward"],
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--loss-type", default="sequence", choices=sorted(LOSS_TYPES))
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--prompts-per-step", type=int, default=Settings.prompts_per_step)
    p.add_argument("--num-generations", type=int, default=Settings.num_generations)
    p.add_argument("--max-completion-length", type=int, default=Settings.max_completion_length)
    p.add_argument("--temperature", type=float, default=Settings.temperature)
    p.add_argument(
        "--pairings", nargs="+", choices=PAIRINGS, default=list(PAIRINGS), help="see PAIRINGS"
    )
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--worker", choices=["grpolab", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        s = Settings(**json.loads(args.settings))
        result = (run_grpolab if args.worker == "grpolab" else run_trl)(s, args.seed)
        Path(args.out).write_text(json.dumps(asdict(result)))
        return 0

    s = Settings(
        steps=args.steps,
        threads=args.threads,
        loss_agg=args.loss_type,
        beta=args.beta,
        prompts_per_step=args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
    )
    import trl

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"grpolab vs TRL {trl.__version__} GRPOTrainer | tiny Llama (demo-warmup), CPU fp32, "
        f"{s.threads} thread(s) | {s.steps} steps, {s.prompts_per_step} prompts x G="
        f"{s.num_generations}, max_completion_length {s.max_completion_length}, "
        f"beta {s.beta} | seeds {args.seeds} | load average {load}"
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

    parity = {}
    for agg in LOSS_TYPES:
        a, b = loss_parity(agg, s.beta)
        parity[agg] = abs(a - b)
        print(
            f"loss parity {agg}/{LOSS_TYPES[agg]} (beta {s.beta}): grpolab {a:.8f} TRL {b:.8f} "
            f"|diff| {abs(a - b):.2e} {'ok' if abs(a - b) <= 1e-5 else 'MISMATCH'}"
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
