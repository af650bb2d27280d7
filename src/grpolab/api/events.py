"""What a TRL script reads during and after training: `trainer.state` (transformers'
TrainerState; its log_history under TRL's metric names) and its TrainerCallbacks, called at
transformers' events with transformers' arguments, from grpolab's loop events
(train.loop.Session.listeners)."""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState

# grpolab's metric -> TRL's name for the same quantity (rewards/<name>/mean|std are the same
# in both). The rest of a step's numbers keep grpolab's names.
TRL_METRICS = {
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "kl": "kl",
    "entropy": "entropy",
    "clip_frac_low": "clip_ratio/low_mean",
    "clip_frac_high": "clip_ratio/high_mean",
    "clip_frac": "clip_ratio/region_mean",
    "completion_length/mean": "completions/mean_length",
    "completion_length/min": "completions/min_length",
    "completion_length/max": "completions/max_length",
    "truncated_frac": "completions/clipped_ratio",
    "loss": "loss",
    "lr": "learning_rate",
    "grad_norm": "grad_norm",
}
# Logged as the last step's value, as transformers does; the rest is the window's mean.
LAST_VALUE = ("learning_rate", "grad_norm")
# The held-out accuracy measured at a step (eval.eval_steps): logged as an entry of its own.
HELD_OUT = ("eval_accuracy", "eval_strict_accuracy")


def trl_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's numbers under TRL's names where TRL logs the same quantity, the others under
    grpolab's; text (the monitors' warnings) left out."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[TRL_METRICS.get(key, key)] = float(value)
    return out


def window_mean(window: list[dict[str, float]]) -> dict[str, float]:
    """The logs of several steps as one (TRL's logging_steps > 1): each number's mean over
    the steps that have a finite one, the learning rate and gradient norm the last step's."""
    keys = dict.fromkeys(k for logs in window for k in logs)
    out = {}
    for key in keys:
        values = [logs[key] for logs in window if key in logs and math.isfinite(logs[key])]
        if key in LAST_VALUE:
            values = values[-1:]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


def callback_instances(callbacks) -> list[TrainerCallback]:
    """TRL's callbacks argument: TrainerCallback instances or classes (instantiated, as
    transformers' CallbackHandler does)."""
    out = []
    for cb in callbacks or ():
        cb = cb() if isinstance(cb, type) else cb
        if not isinstance(cb, TrainerCallback):
            raise TypeError(
                f"callbacks: a transformers.TrainerCallback (or its class) is expected, got "
                f"{type(cb).__name__}"
            )
        out.append(cb)
    return out


class TrainerEvents:
    """A listener of grpolab's loop (Session.listeners) that keeps `state` as transformers'
    Trainer does and calls the callbacks: on_train_begin, on_step_end, on_log (every
    logging.logging_steps, and the last step), on_evaluate (the held-out accuracy of
    eval.eval_steps), on_save, on_train_end. A callback's control.should_training_stop ends
    the run after that step; its other control flags change nothing."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.state: TrainerState = trainer.state
        self.control = TrainerControl()
        self.window: list[dict[str, float]] = []
        self.losses: list[float] = []  # every step's, for train_loss
        self.session = None

    def __call__(self, event: str, session, data: dict[str, Any]) -> None:
        self.session = session
        getattr(self, event)(session, **data)

    def call(self, event: str, **kwargs: Any) -> TrainerControl:
        """transformers' CallbackHandler.call_event: each callback with (args, state,
        control) and the run's model, tokenizer, optimizer and schedule; a returned control
        replaces it."""
        if not self.trainer.callbacks:
            return self.control
        run = self.session.run if self.session is not None else None
        objects = {
            "model": run.model if run else self.trainer.model,
            "processing_class": run.tokenizer if run else self.trainer.processing_class,
            "optimizer": run.optimizer if run else None,
            "lr_scheduler": run.scheduler if run else None,
            "train_dataloader": None,
            "eval_dataloader": None,
        }
        for callback in self.trainer.callbacks:
            result = getattr(callback, event)(
                self.trainer.args, self.state, self.control, **objects, **kwargs
            )
            if result is not None:
                self.control = result
        return self.control

    def epoch(self, step: int) -> float:
        return step / self.trainer.steps_per_epoch if self.trainer.steps_per_epoch else 0.0

    def train_begin(self, session) -> None:
        cfg = session.run.cfg
        self.state.global_step = session.start_step
        self.state.max_steps = cfg.max_steps
        self.state.epoch = self.epoch(session.start_step)
        self.state.logging_steps = cfg.logging.logging_steps
        self.state.eval_steps = cfg.eval.eval_steps
        self.state.save_steps = cfg.checkpoints.save_steps
        self.state.train_batch_size = cfg.batch_size
        self.trainer.run_dir = session.run_dir
        self.call("on_train_begin")

    def step(self, session, step: int, metrics: dict[str, Any]) -> None:
        cfg = session.run.cfg
        self.state.global_step, self.state.epoch = step, self.epoch(step)
        logs = trl_metrics(metrics)
        held_out = {k: logs.pop(k) for k in HELD_OUT if k in logs}  # an entry of its own
        self.window.append(logs)
        self.losses.append(float(metrics["loss"]))
        self.call("on_step_end")
        last = step == cfg.max_steps or self.control.should_training_stop
        if step % cfg.logging.logging_steps == 0 or last:
            self.log(window_mean(self.window))
            self.window.clear()
        if held_out:
            self.log(held_out)
            self.call("on_evaluate", metrics=held_out)
        if self.control.should_training_stop:
            session.stop = True

    def log(self, logs: dict[str, float]) -> None:
        """An entry of log_history (with the epoch and step, as transformers writes it),
        and the callbacks' on_log."""
        self.state.log_history.append({**logs, "epoch": self.state.epoch,
                                       "step": self.state.global_step})  # fmt: skip
        self.call("on_log", logs=logs)

    def save(self, session, step: int, path) -> None:
        self.call("on_save")

    def train_end(self, session, summary: dict[str, Any]) -> None:
        losses = self.losses
        final = {"train_runtime": summary["wall_seconds"],
                 "train_loss": sum(losses) / len(losses) if losses else math.nan,
                 "epoch": self.state.epoch, "step": self.state.global_step}  # fmt: skip
        self.state.log_history.append(final)
        self.trainer.trained(session.run.model, session.run.tokenizer)
        self.call("on_train_end")
