"""GRPOTrainer's TRL arguments that are objects: a loaded causal LM as `model`, a tokenizer as
`processing_class`, a peft LoraConfig as `peft_config`. Each goes into grpolab's config as it
is (the model and its tokenizer, never saved and loaded back) or mapped onto grpolab's keys,
and is trained for real by grpolab's trainer; what grpolab cannot honour is refused, named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaForSequenceClassification,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2Processor,
)

from grpolab import GRPOConfig, GRPOTrainer
from grpolab.config import ConfigError, load_config
from grpolab.model.dist import Dist
from grpolab.model.policy import (
    GivenModel,
    build_char_tokenizer,
    build_tiny_model,
    load_policy,
    load_tokenizer,
)
from grpolab.train.setup import DEMO_MODEL_DIR, prepare_model

DEMO_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def rows(n: int, start: int = 10) -> list[dict]:
    return [{"prompt": f"{a}+11=", "answer": str(a + 11)} for a in range(start, start + n)]


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def fast(out: Path, **more) -> dict:
    """One step of 4 prompts x 4 samples, 8 held-out prompts, a checkpoint at the end."""
    return {"output_dir": str(out), "max_steps": 1, "per_device_train_batch_size": 16,
            "num_generations": 4, "eval_steps": 0, "save_steps": 1,
            "eval.eval_examples": 8, "logging.progress": False, **more}  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama and its character tokenizer, built here (no name_or_path)."""
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=3), tokenizer


@pytest.fixture
def loaded(demo_model, demo_tokenizer):
    """The demo model as a user loads one (this test's own copy), then changed in memory (so
    that only the object, not the directory it came from, has these weights), and its
    tokenizer."""
    model, tokenizer = demo_model, demo_tokenizer
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)
    return model, tokenizer


def saved_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def given(trainer: GRPOTrainer) -> GivenModel:
    """The model object the trainer's config holds (model.name_or_path)."""
    held = trainer.config.model.name_or_path
    assert isinstance(held, GivenModel)
    return held


def assert_same_weights(saved: dict[str, torch.Tensor], model: torch.nn.Module):
    given = model.state_dict()
    assert saved and set(saved) <= set(given)  # tied lm_head.weight is not stored twice
    for name, tensor in saved.items():
        assert torch.equal(tensor, given[name]), name


# --- model= a loaded causal LM ----------------------------------------------------------------


def test_a_model_object_is_trained_as_it_is_with_its_tokenizer(tmp_path, loaded):
    model, tokenizer = loaded
    start = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "run"
    # 8 prompts x 8 samples: some group's rewards vary, so the step changes the weights
    args = fast(out, per_device_train_batch_size=64, num_generations=8, learning_rate=1e-3)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=exact, args=args,
                          train_dataset=rows(40), eval_dataset=rows(8, start=70))  # fmt: skip
    # the objects themselves, not a copy saved somewhere and loaded back
    assert given(trainer).model is model and given(trainer).tokenizer is tokenizer
    assert trainer.model is model and trainer.processing_class is tokenizer
    summary = trainer.train(overwrite=True)
    assert summary["steps"] == 1 and summary["accuracy_after"] is not None
    assert json.loads((out / "preflight.json").read_text())["passed"]
    # trained in place, as TRL trains the model it is given: the checkpoint holds its weights
    assert trainer.model is model
    assert any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
    assert_same_weights(saved_weights(out / "checkpoint-1"), model)
    recorded = (out / "config.yaml").read_text()
    assert f"(LlamaForCausalLM given in Python, loaded from {DEMO_MODEL_DIR})" in recorded


def test_a_model_object_without_processing_class_uses_the_tokenizer_it_was_loaded_with(
    tmp_path, tiny
):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "mine")
    tokenizer.save_pretrained(tmp_path / "mine")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mine")
    trainer = GRPOTrainer(model=loaded, args=fast(tmp_path / "run"))
    assert given(trainer).model is loaded
    assert given(trainer).tokenizer.get_vocab() == tokenizer.get_vocab()


def test_a_model_object_grpolab_cannot_train_is_refused_naming_it(tiny):
    model, tokenizer = tiny
    with pytest.raises(ConfigError, match=r"model:.*no tokenizer.*pass processing_class"):
        GRPOTrainer(model=model)  # built here: no name_or_path to load a tokenizer from
    with pytest.raises(ConfigError, match=r"model:.*causal LM.*got Linear"):
        GRPOTrainer(model=torch.nn.Linear(2, 2), processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"model:.*got int"):
        GRPOTrainer(model=3)
    classifier = LlamaForSequenceClassification(model.config)
    with pytest.raises(
        ConfigError,
        match=r"model: LlamaForSequenceClassification is not a causal LM.*LlamaForCausalLM",
    ):
        GRPOTrainer(model=classifier, processing_class=tokenizer)
    wrapped = get_peft_model(build_tiny_model(tokenizer), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"model: PeftModel.*adapters.*merge_and_unload"):
        GRPOTrainer(model=wrapped, processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"processing_class:.*tokenizer.*got str"):
        GRPOTrainer(model=model, processing_class="gpt2")
    small = build_char_tokenizer("0123456789")
    with pytest.raises(ConfigError, match=r"processing_class:.*99 tokens.*embedding has 13 rows"):
        GRPOTrainer(model=build_tiny_model(small), processing_class=tokenizer)


# --- processing_class with a named model ------------------------------------------------------


def test_processing_class_replaces_a_named_models_tokenizer(tmp_path, demo_policy):
    tokenizer = load_tokenizer(str(DEMO_MODEL_DIR))
    tokenizer.model_max_length = 333  # what tells the given tokenizer from the model's own
    trainer = GRPOTrainer(model="demo", processing_class=tokenizer, reward_funcs=exact,
                          args=fast(tmp_path / "run"), train_dataset=rows(40))  # fmt: skip
    # the named model, loaded here to go with the given tokenizer (the object itself)
    assert given(trainer).tokenizer is tokenizer
    demo, _ = load_policy(str(DEMO_MODEL_DIR))
    assert_same_weights(demo.state_dict(), given(trainer).model)
    assert trainer.train(overwrite=True, skip_preflight=True)["steps"] == 1


def test_a_processors_tokenizer_is_used(tiny):
    model, tokenizer = tiny
    # a real multimodal processor (audio features + text), its tokenizer the tiny model's
    processor = Wav2Vec2Processor(feature_extractor=Wav2Vec2FeatureExtractor(), tokenizer=tokenizer)
    trainer = GRPOTrainer(model=model, processing_class=processor)
    assert given(trainer).tokenizer is tokenizer


def test_a_tokenizer_larger_than_the_named_models_vocabulary_is_refused():
    with pytest.raises(
        ConfigError, match=r"processing_class: the tokenizer has 99 tokens.*18 rows"
    ):
        GRPOTrainer(model="demo", processing_class=build_char_tokenizer())


# --- peft_config ------------------------------------------------------------------------------


def test_a_lora_config_becomes_grpolabs_lora_keys_and_trains_adapters(tmp_path, loaded):
    model, tokenizer = loaded
    out = tmp_path / "run"
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=exact,
                          args=fast(out), train_dataset=rows(40), peft_config=lora)  # fmt: skip
    lora = trainer.config.lora
    assert (lora.r, lora.alpha, lora.dropout) == (4, 8, 0.05)
    assert lora.target_modules == ["q_proj", "v_proj"]
    # the policy grpolab builds from this config trains the adapters alone (checked on a
    # copy: building it wraps the model in place, as training does next)
    policy, _ = prepare_model(copy.deepcopy(given(trainer).model), trainer.config, Dist())
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert trainer.train(overwrite=True, skip_preflight=True)["steps"] == 1
    adapter = out / "checkpoint-1" / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], set(saved["target_modules"])) == (
        4, 8, {"q_proj", "v_proj"},
    )  # fmt: skip
    adapter_weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert adapter_weights and all("lora_" in k for k in adapter_weights)


@pytest.mark.parametrize(
    ("target_modules", "expected"),
    [
        ("all-linear", DEMO_LINEAR),
        (None, ["q_proj", "v_proj"]),  # peft's default for llama
        ({"v_proj", "q_proj"}, ["q_proj", "v_proj"]),
        (r".*\.mlp\..*_proj", ["down_proj", "gate_proj", "up_proj"]),
        (r"model\.layers\.0\.self_attn\.[qv]_proj",
         ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]),
    ],
)  # fmt: skip
def test_target_modules_become_the_module_names_peft_would_adapt(
    target_modules, expected, demo_policy
):
    trainer = GRPOTrainer(model="demo", peft_config=LoraConfig(r=2, target_modules=target_modules))
    names = trainer.config.lora.target_modules
    assert names == expected
    # the same modules as peft itself picks with the LoraConfig as given
    demo = demo_policy[0]  # peft adapts a model in place: each gets a copy
    by_peft = get_peft_model(copy.deepcopy(demo), LoraConfig(r=2, target_modules=target_modules))
    by_grpolab = get_peft_model(copy.deepcopy(demo), LoraConfig(r=2, target_modules=names))
    assert set(by_peft.targeted_module_names) == set(by_grpolab.targeted_module_names)


def test_a_lora_config_grpolab_cannot_honour_is_refused_naming_the_field():
    refused = [
        (LoraConfig(target_modules=["q_proj"], bias="lora_only"), r"bias='lora_only'"),
        (LoraConfig(target_modules=["q_proj"], use_rslora=True), r"use_rslora=True"),
        (LoraConfig(target_modules=["q_proj"], use_dora=True), r"use_dora=True"),
        (LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]), r"modules_to_save="),
        (LoraConfig(target_modules=["q_proj"], layers_to_transform=[0]), r"layers_to_transform="),
        (LoraConfig(target_modules=["q_proj"], task_type="SEQ_CLS"), r"task_type=.*causal LM"),
        (LoraConfig(target_modules=r"nothing\.here"), r"target_modules=.*matches no module"),
        (IA3Config(target_modules=["q_proj"]), r"a peft\.LoraConfig is expected, got IA3Config"),
    ]
    for peft_config, words in refused:
        with pytest.raises(ConfigError, match=rf"peft_config.*{words}"):
            GRPOTrainer(peft_config=peft_config)
    with pytest.raises(ConfigError, match=r"peft_config and GRPOConfig\(lora\.r\)"):
        GRPOTrainer(args=GRPOConfig(**{"lora.r": 8}),
                    peft_config=LoraConfig(target_modules=["q_proj"]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"grpolab Config as args, peft_config"):
        GRPOTrainer(args=load_config(), peft_config=LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"grpolab Config as args, model, processing_class"):
        GRPOTrainer(model="x", args=load_config(), processing_class=object())
