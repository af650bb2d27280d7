"""A Python API with TRL's names, over grpolab's own trainer:

    from grpolab import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="demo", reward_funcs=my_reward, train_dataset=rows,
                          args=GRPOConfig(learning_rate=3e-4, num_generations=8, max_steps=20))
    summary = trainer.train()   # preflight, then grpolab.train.loop.train
    trainer.save_model("out")   # a transformers directory, tokenizer included

The arguments become one config through load_config's `values` (the command line's overrides
meet it there): TRL's names as grpolab.config.trl maps them, grpolab's dotted keys as they
are, and objects as they are (reward callables, rows, a loaded model and its tokenizer), each
recorded in the run directory's config.yaml by one line.

    args.py     GRPOConfig: TRL's names and grpolab's keys -> values
    objects.py  model objects, tokenizers, rows, reward functions, peft's LoraConfig -> values
    events.py   trainer.state (log_history in TRL's names) and the TrainerCallbacks
    trainer.py  GRPOTrainer: train, evaluate, save_model, preflight
"""

from grpolab.api.args import GRPOConfig
from grpolab.api.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
