"""A TRL-style GRPO script on grpolab: the built-in demo model learns two-digit sums from a
dataset built here, rewarded by a function that reads an extra column.

    .venv/bin/python examples/python_api.py            # 30 steps, a few minutes on a CPU
    .venv/bin/python examples/python_api.py --steps 2  # a smoke run
"""

import argparse
import random

from grpolab import GRPOConfig, GRPOTrainer


def rows(n: int, seed: int) -> list[dict]:
    pairs = random.Random(seed).sample([(a, b) for a in range(10, 100) for b in range(10, 100)], n)
    # "digits": an extra column; it reaches the reward as a keyword argument.
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "digits": len(str(a + b))} for a, b in pairs
    ]


def exact_sum(prompts, completions, answer, digits, **kwargs):
    """TRL's call: one value per completion; None would mean "cannot judge this one"."""
    return [
        1.0 if text.strip() == ref else (0.1 if len(text.strip()) == n else 0.0)
        for text, ref, n in zip(completions, answer, digits, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/python-api")
    steps = parser.parse_args()
    args = GRPOConfig(
        output_dir=steps.output_dir,
        max_steps=steps.steps,
        learning_rate=3e-4,
        num_generations=8,
        per_device_train_batch_size=64,  # 8 prompts x 8 completions per step
        max_completion_length=6,
        beta=0.0,
        eval_steps=0,
        **{"trainer.eval_examples": 64},  # any grpolab key, by its dotted name
    )
    trainer = GRPOTrainer(
        model="demo",  # the built-in tiny model; a hub id, a directory or a .gguf file work too
        reward_funcs=exact_sum,
        args=args,
        train_dataset=rows(400, seed=0),
        eval_dataset=rows(64, seed=1),
    )
    summary = trainer.train(overwrite=True)
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"held-out accuracy {before:.1f}% -> {after:.1f}%")


if __name__ == "__main__":
    main()
