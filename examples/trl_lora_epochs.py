"""A TRL GRPO script with LoRA, counted in epochs, run by grpolab: written for TRL with only the
import changed, and the built-in "demo" model (a tiny Llama that adds two-digit numbers) for a
hub model.

    .venv/bin/python examples/trl_lora_epochs.py [OUTPUT_DIR]

What it uses: peft's LoraConfig on every linear layer, num_train_epochs with a warm-up ratio
and a cosine schedule, TRL's batch (a micro-batch, gradient accumulation and several optimizer
steps per generation), gradient checkpointing, sampling with temperature / top_p / top_k,
evaluation and saving once an epoch, a callback that ends training early, evaluate(),
save_model (the adapters merged into a plain transformers model) and log_history.
"""

import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from grpolab import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

output_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/trl-lora-epochs"


def sums(pairs):
    return Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])


train_dataset = sums((a, 11 + a % 7) for a in range(20, 68))  # 48 rows
eval_dataset = sums((a, 13) for a in range(70, 86))  # 16 rows


def exact_sum(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def no_extra_text(completions, **kwargs):
    return [0.0 if c.strip().isdigit() else -1.0 for c in completions]


class StepBudget(TrainerCallback):
    """Ends training after a number of optimizer steps, whatever the epochs ask for."""

    def __init__(self, budget):
        self.budget = budget

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.budget:
            control.should_training_stop = True
        return control


training_args = GRPOConfig(
    output_dir=output_dir,
    num_train_epochs=2,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    warmup_ratio=0.1,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=2,
    steps_per_generation=4,  # 64 completions (8 prompts x 8) per generation, 2 updates each
    num_generations=8,
    max_completion_length=6,
    temperature=0.9,
    top_p=0.95,
    top_k=10,
    gradient_checkpointing=True,
    model_init_kwargs={"dtype": "float32"},
    eval_strategy="epoch",
    save_strategy="epoch",
    logging_steps=1,
    report_to="none",
)
trainer = GRPOTrainer(
    model="demo",  # was: a hub model such as "Qwen/Qwen2-0.5B-Instruct"
    reward_funcs=[exact_sum, no_extra_text],
    args=training_args,
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    callbacks=[StepBudget(8)],
)
result = trainer.train()
print(
    f"trained {result.global_step} of {trainer.state.max_steps} steps "
    f"(epoch {trainer.state.epoch:.2f}), training loss {result.training_loss:.4f}"
)
metrics = trainer.evaluate()
print(f"evaluation: reward {metrics['eval_reward']:.3f}, accuracy {metrics['eval_accuracy']:.1f}%")
trainer.save_model()
trainer.save_state()
rates = [round(e["learning_rate"], 6) for e in trainer.state.log_history if "learning_rate" in e]
print(f"learning rates {rates}")

# The adapters are merged into the saved weights: a plain transformers model.
model = AutoModelForCausalLM.from_pretrained(training_args.output_dir)
tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
inputs = tokenizer("71+13=", return_tensors="pt", add_special_tokens=False)
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
print(
    "71+13= ->", tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
)
