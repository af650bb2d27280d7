"""Held-out accuracy and tool use of a model on the tool example, greedy and sampled:

    python examples/tool_calculator_eval.py [MODEL] [--examples N]

MODEL: a checkpoint directory (default: the shipped warm-start, tool-warmup). Prints one JSON
object: per decoding, `accuracy` (the last assistant turn is the product), `call_rate` (a
calculator call that worked), `right_call` (the call's result is the product: the operands
were copied right) and `correct_tool_use` (a right call and a right final answer), in %.
"""

import argparse
import json
from pathlib import Path

import torch

from grpolab.config import load_config
from grpolab.tasks import load_task
from grpolab.train.setup import load_start_model, task_engine

CONFIG = Path(__file__).with_name("tool-calculator.yaml")
CALCULATOR = Path(__file__).with_name("calculator.py")


def measure(model_path: str, n: int, seed: int = 123) -> dict:
    cfg = load_config(
        str(CONFIG),
        [f"model.name_or_path={model_path}", f"rollout.tools=[{CALCULATOR}:calculator]"],
    )
    torch.set_num_threads(1)
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    engine = task_engine(cfg, model, tokenizer)
    examples = load_task(cfg.task).eval[:n]
    out = {}
    for name, temperature, G in (("greedy", 0.0, 1), ("sampled T=1", 1.0, 4)):
        params = cfg.rollout.sampling(seed=seed)
        params.temperature = temperature
        r = engine.generate([e.prompt for e in examples], G, params)
        answers = [e.answer for e in examples for _ in range(G)]
        tools = [[t for t in ts if t.role == "tool" and not t.error] for ts in r.turns]
        correct = [c.strip() == a for c, a in zip(r.completions, answers, strict=True)]
        right_call = [any(t.text == a for t in ts) for ts, a in zip(tools, answers, strict=True)]
        k = len(correct)
        out[name] = {
            "accuracy": round(100 * sum(correct) / k, 1),
            "call_rate": round(100 * sum(bool(ts) for ts in tools) / k, 1),
            "right_call": round(100 * sum(right_call) / k, 1),
            "correct_tool_use": round(
                100 * sum(c and rc for c, rc in zip(correct, right_call, strict=True)) / k, 1
            ),
        }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="tool-warmup")
    parser.add_argument("--examples", type=int, default=500)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.examples)))
