"""TRL's GRPOConfig names: each mapped onto grpolab's keys or refused with its reason, one
did-you-mean shared by the command line and the Python API, and one config constructor
(load_config's values) under both. No model is trained here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from grpolab import GRPOConfig, GRPOTrainer
from grpolab.config import ConfigError, load_config, load_warnings, to_dict, to_yaml
from grpolab.config.trl import (
    TRL_CONVERTED,
    TRL_DEFAULT,
    TRL_IGNORED,
    TRL_KEYS,
    grpolab_keys,
    trl_names,
)
from grpolab.tasks import GivenRows, load_task


def rows(n: int, start: int = 10) -> list[dict]:
    return [{"prompt": f"{a}+11=", "answer": str(a + 11)} for a in range(start, start + n)]


# --- the command line's did-you-mean ----------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rate=1e-4", "unknown key learning_rate: did you mean optim.learning_rate?"),
        ("learnig_rate=1e-4", "unknown key learnig_rate: did you mean optim.learning_rate?"),
        ("bf16=true", "unknown key bf16: did you mean runtime.precision=bf16?"),
        ("bf16=false", "unknown key bf16: did you mean runtime.precision=fp32?"),
        ("eval_examples=8", "unknown key eval_examples: did you mean eval.eval_examples?"),
        (
            "optim.learnig_rate=1",
            "unknown key optim.learnig_rate: did you mean optim.learning_rate?",
        ),
        ("optim.beta=0.1", "unknown key optim.beta: did you mean objective.beta?"),
        (
            "trainer.learnig_rate=1",
            "unknown key trainer.learnig_rate: did you mean optim.learning_rate?",
        ),
    ],
)
def test_an_unknown_key_on_the_command_line_gets_one_suggestion(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == message


def test_a_trl_name_grpolab_refuses_says_why_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["push_to_hub=true"])
    message = str(err.value)
    assert message.startswith("unknown key push_to_hub: TRL's name push_to_hub: grpolab does not")
    assert "save_model" in message and "\n" not in message


def test_a_config_files_unknown_key_gets_the_same_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.001\nmax_steps: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"config file {str(path)!r}: unknown key learning_rate: did you mean optim.learning_rate?"
    )


@pytest.mark.slow
def test_the_command_prints_the_suggestion_and_exits_2(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpolab",
            "train",
            "learning_rate=1e-4",
            "max_steps=1",
            f"output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "grpolab: error: unknown key learning_rate: did you mean optim.learning_rate?"
    )


# --- the Python API's did-you-mean ------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"learnig_rate": 1e-4},
            r"GRPOConfig\(learnig_rate=\.\.\.\): did you mean learning_rate\?",
        ),
        (
            {"eval_examples": 8},
            r"GRPOConfig\(eval_examples=\.\.\.\): did you mean "
            r"eval\.eval_examples\?",
        ),
        ({"num_generaitons": 4}, r"did you mean num_generations\?"),
        ({"zzz": 1}, r"GRPOConfig\(zzz=\.\.\.\): not a TRL name grpolab knows nor a grpolab key"),
        (
            {"optim.learnig_rate": 1},
            r"unknown key optim\.learnig_rate: did you mean "
            r"optim\.learning_rate\?",
        ),
    ],
)
def test_an_unknown_name_in_grpoconfig_gets_one_suggestion(given, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**given)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"fp16": True}, r"fp16=True.*bf16=True"),
        ({"push_to_hub": True}, r"push_to_hub=True.*does not push to the Hugging Face Hub"),
        ({"hub_model_id": "me/model"}, r"hub_model_id='me/model'.*Hub"),
        ({"repetition_penalty": 1.1}, r"repetition_penalty=1\.1.*distribution"),
        ({"min_p": 0.1}, r"min_p=0\.1.*truncate"),
        ({"lr_scheduler_type": "linear"}, r"lr_scheduler_type='linear'.*constant and cosine"),
        ({"optim": "adafactor"}, r"optim='adafactor'.*AdamW"),
        ({"report_to": "all"}, r"report_to='all'.*name the trackers"),
        (
            {"model_init_kwargs": {"attn_implementation": "sdpa"}},
            r"model_init_kwargs=\{'attn_implementation'.*load the model",
        ),
        ({"model_init_kwargs": {"dtype": "auto"}}, r"'auto' has no meaning here"),
        ({"entropy_coef": 0.01}, r"entropy_coef=0\.01.*objective\.entropy_coef"),
        ({"steps_per_generation": 2}, r"needs per_device_train_batch_size"),
    ],
)
def test_a_trl_value_grpolab_cannot_honour_is_refused_with_the_reason(given, words):
    with pytest.raises(ConfigError, match=words) as err:
        GRPOTrainer(args=GRPOConfig(**given), train_dataset=rows(40))
    assert "\n" not in str(err.value)


def test_push_to_hub_is_one_line_naming_what_to_do_instead():
    trainer = GRPOTrainer(args=GRPOConfig(max_steps=1, push_to_hub=False))
    with pytest.raises(ConfigError, match=r"^push_to_hub: grpolab does not push.*save_model"):
        trainer.push_to_hub()


def test_every_trl_name_is_in_one_table_and_every_mapped_key_exists():
    tables = [set(TRL_KEYS), set(TRL_CONVERTED), set(TRL_DEFAULT), set(TRL_IGNORED)]
    assert sum(len(t) for t in tables) == len(set().union(*tables))
    assert set(TRL_KEYS.values()) <= set(grpolab_keys())
    converted = {k for name, (keys, _) in TRL_CONVERTED.items() for k in keys.split(" / ")}
    assert converted - {"optim (AdamW)"} <= set(grpolab_keys())
    # the names a TRL user writes most are known
    assert {"bf16", "num_train_epochs", "gradient_checkpointing", "push_to_hub"} <= set(trl_names())


# --- TRL's names onto grpolab's keys ----------------------------------------------------------


def test_trl_names_map_onto_grpolab_keys():
    cfg = GRPOTrainer(
        args=GRPOConfig(
            bf16=True,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            gradient_checkpointing=True,
            per_device_eval_batch_size=24,
            logging_steps=3,
            report_to="none",
            model_init_kwargs={"torch_dtype": torch.bfloat16},
            scale_rewards="batch",
            lr_scheduler_type="cosine",
            eval_strategy="no",
            save_strategy="steps",
            save_steps=5,
            max_steps=20,
            fp16=False,
            push_to_hub=False,
            vllm_importance_sampling_correction=False,
        ),
    ).config
    r = cfg.rollout
    assert (cfg.runtime.precision, r.temperature, r.top_p, r.top_k) == ("bf16", 0.7, 0.9, 20)
    assert cfg.runtime.gradient_checkpointing and cfg.eval.eval_batch_size == 24
    assert (cfg.logging.logging_steps, cfg.logging.report_to, cfg.model.dtype) == (
        3,
        [],
        "bfloat16",
    )
    assert cfg.objective.scale_rewards == "batch" and cfg.schedule.lr_scheduler == "cosine"
    assert (cfg.eval.eval_steps, cfg.checkpoints.save_steps, cfg.max_steps) == (0, 5, 20)
    assert GRPOConfig(bf16=False).values == {"runtime.precision": "fp32"}


def test_trls_batch_names_give_the_generation_and_the_optimizer_step():
    def batch(**given):
        b = GRPOTrainer(args=GRPOConfig(num_generations=8, **given)).config.batch
        return b.generation_batch_size, b.mini_batch_size, b.gradient_accumulation_steps

    # TRL's default: one optimizer step per generation of per_device x accumulation
    assert batch(per_device_train_batch_size=16, gradient_accumulation_steps=2) == (32, None, 2)
    # steps_per_generation: a generation of per_device x steps, an optimizer step each
    # per_device x accumulation completions
    assert batch(
        per_device_train_batch_size=16, gradient_accumulation_steps=2, steps_per_generation=4
    ) == (64, 32, 2)
    assert batch(per_device_train_batch_size=16, generation_batch_size=64) == (64, 16, 1)
    with pytest.raises(ConfigError, match="multiple of per_device_train_batch_size"):
        GRPOConfig(per_device_train_batch_size=16, generation_batch_size=40)


def test_epochs_strategies_and_warmup_ratio_count_the_rows():
    # 40 rows, 4 prompts a step (16 completions / G=4): 10 steps an epoch
    args = dict(per_device_train_batch_size=16, num_generations=4)
    cfg = GRPOTrainer(
        args=GRPOConfig(
            num_train_epochs=2,
            eval_strategy="epoch",
            save_strategy="epoch",
            warmup_ratio=0.25,
            **args,
        ),
        train_dataset=rows(40),
        eval_dataset=rows(8, 70),
    ).config
    assert (cfg.max_steps, cfg.eval.eval_steps, cfg.checkpoints.save_steps) == (20, 10, 10)
    assert cfg.schedule.warmup_steps == 5  # a quarter of 20 optimizer steps
    # TRL's default: 3 epochs; a max_steps given wins over the epochs, as in TRL
    assert GRPOTrainer(args=GRPOConfig(**args), train_dataset=rows(40)).config.max_steps == 30
    both = GRPOConfig(num_train_epochs=2, max_steps=7, **args)
    assert GRPOTrainer(args=both, train_dataset=rows(40)).config.max_steps == 7
    with pytest.raises(
        ConfigError, match=r"num_train_epochs=\.\.\.\) counts epochs.*train_dataset"
    ):
        GRPOTrainer(args=GRPOConfig(num_train_epochs=2))


def test_a_trl_name_without_effect_is_a_warning_and_strict_refuses_it():
    cfg = GRPOTrainer(args=GRPOConfig(dataloader_num_workers=4, max_steps=2)).config
    assert any(
        w.startswith("GRPOConfig(dataloader_num_workers=...) has no effect: no data loader")
        for w in load_warnings(cfg)
    )
    with pytest.raises(ConfigError, match=r"dataloader_num_workers.*strict refuses it"):
        GRPOTrainer(args=GRPOConfig(dataloader_num_workers=4, strict=True))


def test_args_read_back_as_trls_attributes():
    args = GRPOConfig(output_dir="somewhere", learning_rate=1e-5, per_device_train_batch_size=64)
    assert (args.output_dir, args.learning_rate, args.per_device_train_batch_size) == (
        "somewhere",
        1e-5,
        64,
    )
    trainer = GRPOTrainer(args=args, train_dataset=rows(40))
    # 3 epochs of 40 rows, 8 prompts (64 completions of G=8) a step
    assert args.max_steps == trainer.config.max_steps == 15
    assert trainer.config.model.name_or_path is None  # the named model is not loaded yet
    assert trainer.model is not None and trainer.processing_class is not None  # now it is
    assert to_dict(trainer.config)["model"]["name_or_path"] is None  # and recorded by its name
    with pytest.raises(AttributeError, match="no 'not_a_field'"):
        args.not_a_field  # noqa: B018


# --- one constructor: values -------------------------------------------------------------------


def test_values_and_overrides_build_the_same_config():
    by_values = load_config(
        values={
            "optim.learning_rate": 1e-4,
            "batch.num_generations": 4,
            "trainer.lora_r": 4,
            "logging.report_to": ["tensorboard"],
        }
    )
    by_overrides = load_config(
        None,
        [
            "optim.learning_rate=1e-4",
            "batch.num_generations=4",
            "trainer.lora_r=4",
            "logging.report_to=tensorboard",
        ],
    )
    assert to_dict(by_values) == to_dict(by_overrides)
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        load_config(values={"optim.learning_rate": "fast"})


def test_rows_stay_objects_and_are_recorded_as_a_line():
    given = rows(30)
    cfg = load_config(values={"task.name": "jsonl", "task.rows": given, "task.num_eval": 5})
    assert isinstance(cfg.task.rows, GivenRows) and list(cfg.task.rows) == given
    task = load_task(cfg.task)
    assert (len(task.train), len(task.eval)) == (25, 5)
    recorded = yaml.safe_load(to_yaml(cfg))["task"]["rows"]
    assert recorded.startswith("(30 rows given in Python as task.rows, sha256 ")
    other = load_config(values={"task.name": "jsonl", "task.rows": rows(30, start=11)})
    assert yaml.safe_load(to_yaml(other))["task"]["rows"] != recorded  # other rows, other line


def test_rows_go_through_the_same_checks_as_a_files():
    with pytest.raises(
        ValueError,
        match=r"train_dataset: no row has a field 'prompt'.*"
        r"task\.prompt_field=question",
    ):
        load_task(
            GRPOTrainer(
                train_dataset=[{"question": "1+1=", "answer": "2"}] * 20,
                args=GRPOConfig(max_steps=1),
            ).config.task
        )
    with pytest.raises(ValueError, match=r"train_dataset row 2: expected a dict, got list"):
        GRPOTrainer(train_dataset=[{"prompt": "1+1=", "answer": "2"}, [1, 2]])
    with pytest.raises(ValueError, match=r"task.rows and task.path='x.jsonl' both give rows"):
        load_task(
            load_config(
                values={"task.name": "jsonl", "task.rows": rows(20), "task.path": "x.jsonl"}
            ).task
        )


def test_a_run_whose_rows_were_given_in_python_says_they_are_not_on_disk(tmp_path):
    trainer = GRPOTrainer(
        args=GRPOConfig(max_steps=1), train_dataset=rows(40), eval_dataset=rows(8, 70)
    )
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(trainer.config))
    cfg = load_config(saved)  # the record reads back
    with pytest.raises(
        ValueError,
        match=r"task\.eval_rows: \(8 rows given in Python as "
        r"eval_dataset.*not on disk.*task\.eval_path=FILE",
    ):
        load_task(cfg.task)
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "71+13=", "answer": "84"}\n')
    task = load_task(load_config(saved, [f"task.eval_path={held}"]).task)  # grpolab eval's case
    assert (len(task.train), len(task.eval)) == (0, 1) and "not on disk" in task.split_reason
