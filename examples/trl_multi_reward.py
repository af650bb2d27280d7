"""A TRL GRPO script with two reward functions, run by grpolab: written for TRL (its names,
its callbacks, its trainer methods) with only the import changed, and the built-in "demo"
model (a tiny Llama that adds two-digit numbers) for a hub model.

    .venv/bin/python examples/trl_multi_reward.py [OUTPUT_DIR]

What it uses: two rewards weighted by reward_weights, one of which returns None for the rows it
cannot judge; a KL term (beta), DAPO's token-level loss, batch-scaled advantages, bf16, an
evaluation set evaluated during training and after it, a TrainerCallback, save_model,
save_state and log_history; the saved model is loaded back with transformers and generates.
"""

import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from grpolab import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

output_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/trl-multi-reward"


def sums(start: int, stop: int) -> Dataset:
    """a+b= prompts; every third row also says how many digits its answer has."""
    rows = []
    for i, a in enumerate(range(start, stop)):
        b = 10 + (7 * a) % 90
        total = str(a + b)
        rows.append(
            {"prompt": f"{a}+{b}=", "answer": total, "digits": len(total) if i % 3 == 0 else None}
        )
    return Dataset.from_list(rows)


train_dataset, eval_dataset = sums(10, 90), sums(90, 100)


def exact_sum(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def digit_count(completions, digits, **kwargs):
    """Only rows that say how many digits the answer has can be judged: None for the rest."""
    return [
        None if d is None else float(len(c.strip()) == d)
        for c, d in zip(completions, digits, strict=True)
    ]


class RewardLog(TrainerCallback):
    """What a user's callback sees: the logged rewards, the saves, the end."""

    def __init__(self):
        self.rewards, self.saves, self.ended_with = [], [], None

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"callback: training begins, {state.max_steps} steps")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.ended_with = type(model).__name__


training_args = GRPOConfig(
    output_dir=output_dir,
    learning_rate=3e-4,
    max_steps=6,
    per_device_train_batch_size=64,  # 8 prompts x 8 completions per step
    num_generations=8,
    max_completion_length=6,
    reward_weights=[1.0, 0.5],
    beta=0.04,
    loss_type="dapo",
    scale_rewards="batch",
    bf16=True,
    logging_steps=2,
    eval_strategy="steps",
    eval_steps=3,
    per_device_eval_batch_size=40,
    save_strategy="steps",
    save_steps=3,
    report_to="none",
)
log = RewardLog()
trainer = GRPOTrainer(
    model="demo",  # was: a hub model such as "Qwen/Qwen2-0.5B-Instruct"
    reward_funcs=[exact_sum, digit_count],
    args=training_args,
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,
    callbacks=[log],
)
trainer.train()
metrics = trainer.evaluate()
print(
    f"evaluation: reward {metrics['eval_reward']:.3f}, "
    f"exact_sum {metrics['eval_rewards/exact_sum/mean']:.3f}"
)
trainer.save_model(training_args.output_dir)
trainer.save_state()

steps = [e for e in trainer.state.log_history if "reward" in e]
print(f"logged steps {[e['step'] for e in steps]}, rewards {[round(r, 3) for r in log.rewards]}")
print(f"callback: saves at {log.saves}, ended with a {log.ended_with}")

# The saved directory is a plain transformers model: load it and generate.
model = AutoModelForCausalLM.from_pretrained(training_args.output_dir)
tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
inputs = tokenizer("23+45=", return_tensors="pt", add_special_tokens=False)
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
print(
    "23+45= ->", tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
)
