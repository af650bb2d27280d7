"""LoRA (peft) on the real demo model: only the adapters train, the reference is the base model,
the checkpoint is a plain merged model plus the adapter (its resume is bit-exact:
tests/test_trainer.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_float32_close, float32_tolerance, logprob_tolerance

pytest.importorskip("peft")

from grpolab import core
from grpolab.config import ConfigError, load_config, validate_world
from grpolab.model.lora import is_lora
from grpolab.model.policy import load_policy
from grpolab.train.checkpoint import ADAPTER_DIR, save_checkpoint
from grpolab.train.preflight import preflight
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import grpo_step

TINY = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "rollout.max_completion_length=6",
    "eval.eval_examples=0",
    "logging.progress=false",
    "lora.r=4",
    "objective.beta=0.04",
]


def lora_config(tmp_path, *extra: str, name: str = "run"):
    return load_config(None, [f"output_dir={tmp_path / name}", "max_steps=2", *TINY, *extra])


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights LoRA must leave untouched (peft's base_layer names included)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_two_steps_train_only_the_adapters_against_the_base_reference(tmp_path):
    cfg = lora_config(tmp_path)
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    start = copy.deepcopy(model)
    run = build_run(cfg, model, tokenizer)
    assert is_lora(run.model) and run.ref_model is None
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before_base = base_weights(run.model)
    trained = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
    before_lora = {n: p.detach().clone() for n, p in trained}

    for step in (1, 2):
        metrics, batch = grpo_step(run, step)
        assert metrics["skipped"] == 0
        for key in ("loss", "grad_norm", "kl"):
            assert torch.isfinite(torch.tensor(metrics[key])), key
        # The reference is the starting model: its log-probs, computed on the unwrapped copy.
        expected, mask = core.sequence_logprobs(
            start, batch.input_ids, batch.attention_mask, batch.completion_mask
        )
        gap = (batch.logp_ref - expected).abs()[mask.bool()].max()
        tol = logprob_tolerance(start)  # the adapters switched off against a plain forward
        assert gap <= tol, f"step {step}: logp_ref differs from the base model by {gap}"

    after_base = base_weights(run.model)
    assert after_base.keys() == before_base.keys()
    for name, value in before_base.items():
        assert torch.equal(value, after_base[name]), f"base weight {name} changed"
    params = dict(run.model.named_parameters())
    moved = [n for n, v in before_lora.items() if not torch.equal(v, params[n])]
    assert moved, "no adapter parameter changed in two steps"


def test_preflight_passes_on_a_lora_model(tmp_path):
    cfg = lora_config(tmp_path)
    results = preflight(cfg)
    failed = [r.id for r in results if not r.passed]
    assert results and not failed, failed
    fused = [r for r in results if r.id == "logprobs.fused_vs_naive"]
    assert fused and fused[0].what.startswith("fused,"), fused[0].what  # no naive fallback


def test_the_checkpoint_is_the_merged_policy(tmp_path):
    cfg = lora_config(tmp_path, "max_steps=1")
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    _, batch = grpo_step(run, 1)
    path = save_checkpoint(tmp_path / "saved", 1, run.model, tokenizer, {}, {})
    assert (path / ADAPTER_DIR / "adapter_config.json").is_file()
    assert is_lora(run.model)  # saving merged a copy, not the training model

    merged, _ = load_policy(path)  # plain transformers, as vLLM would read it
    assert not is_lora(merged)
    assert not any("lora_" in k for k in merged.state_dict())
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        ours, mask = core.sequence_logprobs(run.model.eval(), *args)
        theirs, _ = core.sequence_logprobs(merged, *args)
    gap = (ours - theirs).abs()[mask.bool()].max()
    tol = logprob_tolerance(merged)  # W x + s B A x against (W + s B A) x
    assert gap <= tol, f"merged checkpoint differs from the trained adapter model by {gap}"
    # and the merge is not a no-op: the base model gives other log-probs
    with torch.no_grad(), run.model.disable_adapter():
        base, _ = core.sequence_logprobs(run.model, *args)
    assert (base - theirs).abs()[mask.bool()].max() > tol


@pytest.mark.parametrize(
    "override, key",
    [
        ("lora.r=-1", "lora.r"),
        ("lora.dropout=1.0", "lora.dropout"),
        ("lora.dropout=-0.1", "lora.dropout"),
    ],
)
def test_config_errors_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key) as e:
        lora_config(tmp_path, override)
    assert "\n" not in str(e.value)


def test_lora_under_fsdp_is_refused_and_allowed_under_ddp(tmp_path):
    cfg = lora_config(tmp_path, "parallel.strategy=fsdp")
    with pytest.raises(ConfigError, match=r"lora\.r.*parallel\.strategy=fsdp"):
        validate_world(cfg, 2)
    validate_world(lora_config(tmp_path, "parallel.strategy=ddp"), 2)
    validate_world(lora_config(tmp_path, "lora.r=0", "parallel.strategy=fsdp"), 2)


@pytest.mark.slow
def test_vllm_rollouts_sample_the_merged_policy(tmp_path):
    """The engine gets W + scaling * B @ A for every adapted layer, checked by the canary after
    every sync; a sync that forgets the adapters is caught by that check."""
    from need_vllm import require_vllm

    require_vllm()
    from grpolab.rollout.vllm import WeightSyncError, engine_state_dict

    cfg = lora_config(tmp_path, "rollout.engine=vllm", "rollout.vllm.max_model_len=64")
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    try:
        for step in (1, 2):
            metrics, _ = grpo_step(run, step)
            # The canary: vLLM's log-probs of the merged weights against the trainer's.
            tol = logprob_tolerance(run.model)
            assert metrics["skipped"] == 0 and metrics["engine/sync_gap"] <= tol
        merged = engine_state_dict(run.model)
        reference = copy.deepcopy(run.model).merge_and_unload().state_dict()  # peft's own merge
        assert merged.keys() == reference.keys()
        r = cfg.lora.r  # W + s * B @ A: an r-term product added to W, in another order
        for name, tensor in reference.items():
            assert_float32_close(merged[name], tensor, terms=r, name=name)
        inner = base_weights(run.model.get_base_model())
        base = {k.replace(".base_layer.", "."): v for k, v in inner.items()}
        name = "model.layers.0.self_attn.q_proj.weight"
        moved = (merged[name] - base[name]).abs().max()
        assert moved > float32_tolerance(float(base[name].abs().max()), r)  # the adapters moved
        run.engine.load_weights(base)  # the adapters left out
        with pytest.raises(WeightSyncError, match="not running the trainer's weights"):
            run.engine.check_sync(run.model)
    finally:
        run.engine.close()


def test_engine_prefills_once_per_prompt_on_a_lora_model(tmp_path):
    """peft's forward hides logits_to_keep in **kwargs: the engine looks at the base model's,
    so LoRA runs get the shared prefill too, with the model's own log-probs."""
    from grpolab.rollout import SamplingParams
    from grpolab.rollout.hf import HFEngine

    cfg = lora_config(tmp_path)
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    with torch.no_grad():  # adapters away from zero: the LoRA path changes the outputs
        for name, p in run.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    params = SamplingParams(max_completion_length=8, seed=1)
    rows = []  # batch size of each forward of the base model
    hook = run.model.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    shared = HFEngine(run.model, tokenizer).generate(["12+34=", "5+6="], 4, params)
    hook.remove()
    assert rows[0] == 2  # the prefill: one row per prompt, not 2 x 4
    plain = HFEngine(run.model, tokenizer, shared_prefill=False).generate(
        ["12+34=", "5+6="], 4, params
    )
    # The same draws pick the same tokens: the two prefills' logits are float32 rounding apart,
    # which changes a token only for a draw within ~1e-6 of the boundary between two.
    assert torch.equal(shared.input_ids, plain.input_ids)
    logp, mask = core.sequence_logprobs(
        run.model, shared.input_ids, shared.attention_mask, shared.completion_mask
    )
    tol = logprob_tolerance(run.model)
    torch.testing.assert_close(shared.engine_logprobs, logp * mask, atol=tol, rtol=0)
