"""TRL's GRPO quickstart (its documentation's train_grpo.py), run by grpolab: TRL's script with
three lines changed, each marked "was:". The import; the dataset, built here (trl-lib/tldr
cannot be downloaded offline; the built-in demo model reads digits and "+-*=" only, so the
prompts are sums); the model, the built-in "demo" (a tiny Llama) for Qwen2-0.5B-Instruct.
Everything else is TRL's: GRPOConfig(output_dir=...) alone, TRL's default of 3 epochs.

    .venv/bin/python examples/trl_quickstart.py

With model="smollm2-135m-instruct" (the packaged SmolLM2-135M-Instruct) the same script trains
a real model, whose tokenizer also reads prompts in words; on a CPU that takes minutes.
"""

# train_grpo.py
from datasets import Dataset

from grpolab import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

# was: dataset = load_dataset("trl-lib/tldr", split="train")
dataset = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(10, 30) for b in (3, 40)])


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO")
trainer = GRPOTrainer(
    model="demo",  # was: model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
