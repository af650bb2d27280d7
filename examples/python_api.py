"""A TRL-style GRPO script on grpolab: the built-in demo model learns two-digit sums from a
dataset built here, rewarded by a function that reads an extra column.

    .venv/bin/python examples/python_api.py            # 200 steps, ~15 s on one CPU thread
    .venv/bin/python examples/python_api.py --steps 2  # a smoke run

Measured (one thread, seed 0): held-out accuracy 32.0% -> 55.0% on 200 disjoint problems.
"""

import argparse
import random

from grpolab import GRPOConfig, GRPOTrainer


def rows(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows of "a+b=" sums."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    # "digits": an extra column; it reaches the reward as a keyword argument.
    out = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "digits": len(str(a + b))}
        for a, b in pairs[: n_train + n_eval]
    ]
    return out[:n_train], out[n_train:]


def exact_sum(prompts, completions, answer, digits, **kwargs):
    """TRL's call: one value per completion; None would mean "cannot judge this one"."""
    return [
        1.0 if text.strip() == ref else (0.1 if len(text.strip()) == n else 0.0)
        for text, ref, n in zip(completions, answer, digits, strict=True)
    ]


STEPS = 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--output-dir", default="runs/python-api")
    steps = parser.parse_args()
    args = GRPOConfig(
        output_dir=steps.output_dir,
        max_steps=steps.steps,
        learning_rate=3e-4,
        num_generations=8,
        per_device_train_batch_size=128,  # 16 prompts x 8 completions per step
        max_completion_length=6,
        beta=0.0,
        eval_steps=0,
        **{"eval.eval_examples": 200},  # any grpolab key, by its dotted name
    )
    train_rows, eval_rows = rows(2000, 200)
    trainer = GRPOTrainer(
        model="demo",  # the built-in tiny model; a hub id, a directory or a .gguf file work too
        reward_funcs=exact_sum,
        args=args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
    )
    summary = trainer.train(overwrite=True)
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"held-out accuracy {before:.1f}% -> {after:.1f}%")


if __name__ == "__main__":
    main()
