"""TRL's GRPO quickstart, run by grpolab: the script of TRL's documentation with `trl`
replaced by `grpolab` in the import. Three changes the machine asks for: rows of the same
shape as trl-lib/tldr (a prompt column and nothing else, so no reference answer) built here
instead of downloaded, the packaged SmolLM2-135M-Instruct instead of Qwen2-0.5B-Instruct, and
max_steps with short completions so that it runs on a CPU.

    .venv/bin/python examples/trl_quickstart.py [MODEL] [STEPS]

Measured on 2 CPU cores (full fine-tuning as in TRL's script, fp32, with another job
running): the preflight 483 s, then 77-95 s a step; the reward (distinct characters) rose
from 21.6 at step 1 to 28.1 at step 5.
"""

import sys

from datasets import Dataset

from grpolab import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
topics = ["a lost cat", "a new bakery", "a rainy weekend", "learning to swim", "a broken phone",
          "a first job", "moving house", "a long flight", "a chess club", "a garden"]  # fmt: skip
dataset = Dataset.from_list(
    [{"prompt": f"Summarise in one line a post about {topic}."} for topic in topics * 4]
)


def reward_num_unique_chars(completions, **kwargs):
    return [len(set(c)) for c in completions]


training_args = GRPOConfig(
    output_dir="runs/trl-quickstart", logging_steps=1, max_steps=steps, max_completion_length=24
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward_num_unique_chars,
    args=training_args,
    train_dataset=dataset,
)
summary = trainer.train(overwrite=True)
print(f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s")
