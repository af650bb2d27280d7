"""Padding-free micro-batches (batch.max_tokens_per_microbatch): rows packed into one sequence
(grpolab.model.packed) give the padded path's log-probs, entropy and gradients, each group's
prompt run once; the token budget cuts the rows; the preflight's packing.exact passes
grpolab's functions and catches rows packed without their mask.

Tolerances: float32 log-probs and gradients of two float32 computations of the same network
(other attention shapes, the same matmuls) agree to 1e-5 absolute and relative, as the fused
log-probs do against the plain ones (tests/test_logprobs.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from grpolab.checks.context import Context, PreflightSettings
from grpolab.checks.packing import check_budget
from grpolab.checks.registry import BY_ID, mutants
from grpolab.checks.runner import run_check
from grpolab.config import ConfigError, load_config, objective_of
from grpolab.config.tree import validate_world
from grpolab.functions import core_functions, load_impl
from grpolab.model.logprobs import token_logprobs
from grpolab.model.packed import pack_rows, packed_hidden, packed_sizes, token_budget_parts
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.model.precision import Precision
from grpolab.model.prefix import body_hidden
from grpolab.rollout import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.train.loop import train
from grpolab.train.setup import BatchPlan, StepSettings

FP32 = dict(atol=1e-5, rtol=1e-5)
MUTANTS = Path(__file__).parent / "mutants"
PACKING = BY_ID["packing.exact"]
PACK_CAUGHT_BY = {m: c.id for m, (c, _) in mutants().items() if c is PACKING}
PROMPTS = ["37+48=", "5+6=", "a longer prompt here:"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def rollout(model, tokenizer, G=3, length=24, seed=1):
    """A real rollout with completions of many lengths (a tenth of the vocabulary stops)."""
    engine = HFEngine(model, tokenizer)
    engine.stop_ids = list(range(len(tokenizer) - len(tokenizer) // 10, len(tokenizer)))
    return engine.generate(PROMPTS, G, SamplingParams(max_completion_length=length, seed=seed))


def values_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    logp, mask, entropy = token_logprobs(model, *args, return_entropy=True, **kwargs)
    ((logp * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_the_padded_values_and_gradients(tokenizer, arch, attention):
    model = build_tiny_model(tokenizer, TinyModelSpec(arch=arch), seed=3).train()
    model.config._attn_implementation = attention
    batch = rollout(model, tokenizer)
    padded = values_and_grads(model, batch)
    packed = values_and_grads(model, batch, packed=True)
    torch.testing.assert_close(packed[0], padded[0], **FP32)
    torch.testing.assert_close(packed[1], padded[1], **FP32)
    for a, b in zip(packed[2], padded[2], strict=True):
        torch.testing.assert_close(a, b, **FP32)
    # No padding, each group's prompt once, each row's last token left out.
    p = pack_rows(batch.input_ids, batch.attention_mask, batch.completion_mask)
    prompts = batch.attention_mask[::3, : batch.prompt_length].sum()
    completions = batch.completion_mask.sum() - len(PROMPTS) * 3
    assert p.input_ids.shape[1] == int(prompts + completions) < batch.input_ids.numel() / 2


def test_rows_packed_by_position_ids_alone_give_the_padded_hidden_states(tokenizer):
    """The layout for attention that takes no mask (flash attention's variable-length
    kernels): each row with its own prompt, told apart by its positions restarting at 0;
    transformers' sdpa reads the same layout, which is what runs here."""
    model = build_tiny_model(tokenizer, seed=2)
    batch = rollout(model, tokenizer)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    p = pack_rows(*args, masked=False)
    assert p.attention is None
    assert (p.position_ids[0] == 0).sum() == batch.input_ids.shape[0]  # one start per row
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = body_hidden(model.model, *args[:2], positions)[:, :-1]
        got = packed_hidden(model.model, p)
    torch.testing.assert_close(got, expected[batch.completion_mask[:, 1:].bool()], **FP32)


@pytest.mark.parametrize("call_products", [0, 10**9])  # one call per row / per group
def test_group_by_group_attention_is_the_dense_masked_one(tokenizer, monkeypatch, call_products):
    import grpolab.model.packed as packed_module

    monkeypatch.setattr(packed_module, "CALL_PRODUCTS", call_products)
    batch = rollout(build_tiny_model(tokenizer, seed=0), tokenizer, G=4)
    p = pack_rows(batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert any(e == s for _, _, rows in p.spans for s, e in rows)  # an EOS-only completion
    N, gen = p.input_ids.shape[1], torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 8, generator=gen, requires_grad=True) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=p.attention.clone().as_subclass(torch.Tensor)
    )
    grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=p.attention)
    torch.testing.assert_close(got, dense, **FP32)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)


def test_the_budget_cuts_consecutive_rows_and_a_cut_group_pays_its_prompt_again(tokenizer):
    batch = rollout(build_tiny_model(tokenizer, seed=0), tokenizer, G=4)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    prompt, completion, first = (t.tolist() for t in packed_sizes(*args))
    assert first == [True, False, False, False] * 3
    budget = max(completion) + max(prompt) + 3
    parts = token_budget_parts(*args, budget)
    assert [r for part in parts for r in part] == list(range(12)) and len(parts) > 3
    for part in parts:
        cost = sum(completion[r] for r in part)
        cost += sum(prompt[r] for i, r in enumerate(part) if first[r] or i == 0)
        assert cost <= budget
        rows = torch.tensor(part)
        packed = pack_rows(*(a[rows] for a in args))
        assert packed.input_ids.shape[1] == cost  # what the budget counted is what runs
    # A row alone over the budget is a micro-batch of its own.
    assert token_budget_parts(*args, 2) == [[r] for r in range(12)]


def test_the_key_and_its_rules():
    cfg = load_config(None, ["batch.max_tokens_per_microbatch=4096"])
    assert cfg.batch.max_tokens_per_microbatch == 4096
    for bad in ("1", "0", "true", "2.5"):
        with pytest.raises(ConfigError, match="max_tokens_per_microbatch"):
            load_config(None, [f"batch.max_tokens_per_microbatch={bad}"])
    fsdp = load_config(None, ["batch.max_tokens_per_microbatch=512", "parallel.strategy=fsdp"])
    with pytest.raises(ConfigError, match=r"null under parallel\.strategy=fsdp"):
        validate_world(fsdp, 2)


def test_the_step_cuts_each_micro_batch_by_the_budget_and_skips_rows_as_padded(tokenizer):
    from grpolab.train.step import UpdateStats, micro_batches

    batch = rollout(build_tiny_model(tokenizer, seed=0), tokenizer, G=4)
    cfg = load_config(None, ["batch.prompts_per_step=3", "batch.num_generations=4",
                             "batch.gradient_accumulation_steps=2",
                             "batch.max_tokens_per_microbatch=40"])  # fmt: skip

    class Plan:
        micro = 6

    class Run:  # what micro_batches reads of a run
        plan = Plan()
        settings = StepSettings.of(cfg, BatchPlan.of(cfg))

    batch.skip_rows = torch.zeros(12, dtype=torch.bool)
    batch.skip_rows[[1, 7]] = True
    stats = UpdateStats()
    rows = torch.tensor([11, 3, 0, 5, 9, 1, 2, 4, 6, 8, 10, 7])
    cuts = micro_batches(Run, batch, rows, stats)
    assert stats.rows_skipped == 2
    kept = [r for cut, _ in cuts for r in cut.tolist()]
    # each half of the minibatch, ascending and without the skipped rows, cut by the budget
    assert kept == [0, 3, 5, 9, 11, 2, 4, 6, 8, 10] and len(cuts) > 2
    assert [last for _, last in cuts] == [False] * (len(cuts) - 1) + [True]
    fields = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    for cut, _ in cuts:
        packed = pack_rows(*(f[cut] for f in fields))
        assert packed.input_ids.shape[1] <= 40 or len(cut) == 1


class _Run:  # what the check reads of the preflight's run: its step settings
    def __init__(self, cfg):
        self.settings = StepSettings.of(cfg, BatchPlan.of(cfg))


def packing_exact(impl, model, batch, cfg, precision=None):
    s = PreflightSettings(objective=objective_of(cfg))
    if precision is not None:
        s = PreflightSettings(objective=objective_of(cfg), precision=precision)
    return run_check(PACKING, Context(impl, s, model, batch, run=_Run(cfg)))


@pytest.mark.parametrize("loss_type", ["sequence", "token", "dr_grpo"])
def test_grpolab_passes_packing_exact_and_rows_packed_across_fail_it(model_and_batch, loss_type):
    model, batch = model_and_batch
    cfg = load_config(None, ["batch.num_generations=4", "batch.prompts_per_step=4",
                             "rollout.max_completion_length=8", f"objective.loss_type={loss_type}",
                             "batch.max_tokens_per_microbatch=4096"])  # fmt: skip
    assert check_budget(batch, 4096) < 4096  # the check's few rows still make 3 micro-batches
    ours = packing_exact(core_functions("fused"), model, batch, cfg)
    assert ours.passed, ours
    parts = int(re.search(r"over (\d+) packed micro-batches", ours.what).group(1))
    assert parts >= 3  # cuts between groups and inside one
    (mutant,) = PACK_CAUGHT_BY
    theirs = packing_exact(load_impl(MUTANTS / f"{mutant}.py"), model, batch, cfg)
    assert not theirs.passed and theirs.hint
    assert PACKING.when(Context(core_functions("naive"), None, run=_Run(cfg))) is False


def test_packing_exact_holds_under_bf16(model_and_batch):
    model, batch = model_and_batch
    cfg = load_config(None, ["batch.num_generations=4", "batch.prompts_per_step=4",
                             "rollout.max_completion_length=8",
                             "batch.max_tokens_per_microbatch=64"])  # fmt: skip
    result = packing_exact(core_functions("fused"), model, batch, cfg, Precision("bf16", "test"))
    assert result.passed, result


def run(tmp_path, name, *overrides):
    out = tmp_path / name
    cfg = load_config(None, [f"output_dir={out}", "eval.eval_examples=0", *overrides])
    train(cfg, skip_preflight=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


@pytest.mark.slow
def test_training_packed_follows_training_padded(tmp_path):
    """Same seed, padded micro-batches of 16 rows and packed ones of at most 96 tokens: the
    same rewards, losses and gradient norms up to float32 rounding (sums taken in another
    order: relative differences of a few ulp a step, growing slowly over 5 steps; 1e-4
    leaves two orders of magnitude)."""
    steps = ["max_steps=5", "batch.prompts_per_step=8", "batch.num_generations=8"]
    padded = run(tmp_path, "padded", *steps, "batch.gradient_accumulation_steps=4")
    packed = run(tmp_path, "packed", *steps, "batch.max_tokens_per_microbatch=96")
    for a, b in zip(padded, packed, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-7)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
