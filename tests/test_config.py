"""Config: YAML + dotted overrides, and one-line errors that name the key."""

from __future__ import annotations

import pytest

from grpolab.config import Config, ConfigError, load_config, to_yaml


def test_defaults_are_the_cpu_demo():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.name_or_path is None
    assert cfg.task.name == "arithmetic"
    assert cfg.batch_size == cfg.trainer.prompts_per_step * cfg.trainer.num_generations


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("max_steps: 7\ntrainer:\n  learning_rate: 1.0e-5\n  num_generations: 4\n")
    cfg = load_config(path, ["trainer.learning_rate=1e-6", "output_dir=runs/x", "seed=3"])
    assert cfg.max_steps == 7
    assert cfg.trainer.num_generations == 4
    assert cfg.trainer.learning_rate == 1e-6  # YAML 1.1 reads "1e-6" as a string: coerced
    assert (cfg.output_dir, cfg.seed) == ("runs/x", 3)


def test_string_fields_keep_their_text_and_null_means_none():
    cfg = load_config(None, ["model.name_or_path=123"])
    assert cfg.model.name_or_path == "123"
    cfg = load_config(None, ["model.name_or_path=null", "trainer.report_to=tensorboard,wandb"])
    assert cfg.model.name_or_path is None
    assert cfg.trainer.report_to == ["tensorboard", "wandb"]


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["trainer.beta=0.04", "rollout.temperature=0.7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["trainer.lerning_rate=1e-6"], "trainer.lerning_rate"),
        (["nosuch=1"], "nosuch"),
        (["trainer.num_generations=abc"], "trainer.num_generations"),
        (["trainer.num_generations=1"], "trainer.num_generations"),
        (["trainer.learning_rate=fast"], "trainer.learning_rate"),
        (["trainer.progress=maybe"], "trainer.progress"),
        (["trainer.generation_batch_size=10"], "trainer.generation_batch_size"),
        (["trainer.mini_batch_size=1000"], "trainer.mini_batch_size"),
        (["trainer.mini_batch_size=48"], "trainer.mini_batch_size"),
        (["trainer.gradient_accumulation_steps=3"], "trainer.gradient_accumulation_steps"),
        (["trainer.epsilon=1.5"], "trainer.epsilon"),
        (["trainer.beta=-1"], "trainer.beta"),
        (["trainer.loss_type=mean"], "trainer.loss_type"),
        (["trainer.scale_rewards=yes"], "trainer.scale_rewards"),
        (["trainer.logprob_source=vllm"], "trainer.logprob_source"),
        (["trainer.lr_scheduler=linear"], "trainer.lr_scheduler"),
        (["trainer.report_to=mlflow"], "trainer.report_to"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["max_steps=-1"], "max_steps"),
        (["trainer=3"], "trainer"),
        (["trainer.learning_rate"], "trainer.learning_rate"),
    ],
)
def test_bad_values_name_the_key_on_one_line(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert names in message
    assert "\n" not in message


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  num_generation: 4\n")
    with pytest.raises(ConfigError, match=r"trainer\.num_generation"):
        load_config(unknown)


def test_generation_batch_size_sets_prompts_per_step():
    cfg = load_config(None, ["trainer.generation_batch_size=32", "trainer.num_generations=4"])
    assert cfg.trainer.prompts_per_step == 8
    assert cfg.batch_size == 32


def test_shipped_example_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    configs = sorted(root.glob("*.yaml"))
    assert configs, "examples/*.yaml missing"
    for path in configs:
        cfg = load_config(path)
        assert cfg.max_steps > 0, path


# One override per section (and the top level): every other key keeps the default it had.
ONE_KEY_PER_SECTION = [
    "max_steps=3",
    "model.dtype=bfloat16",
    "task.num_eval=7",
    "rewards.timeout=5",
    "rollout.temperature=0.9",
    "trainer.save_steps=4",
]


@pytest.mark.parametrize("override", ONE_KEY_PER_SECTION)
def test_an_override_keeps_every_other_default_of_its_section(override):
    from grpolab.config import flatten, to_dict

    defaults = flatten(to_dict(load_config()))
    changed = flatten(to_dict(load_config(None, [override])))
    key = override.split("=")[0]
    assert {k for k in defaults if defaults[k] != changed[k]} == {key}


def test_a_yaml_section_with_some_keys_keeps_the_rest_of_the_defaults(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("rollout:\n  temperature: 0.9\ntrainer:\n  beta: 0.1\nmodel:\n")
    cfg = load_config(path, ["trainer.save_steps=4"])
    demo = load_config()
    assert cfg.rollout.max_completion_length == demo.rollout.max_completion_length == 6
    assert cfg.trainer.num_threads == demo.trainer.num_threads == 1
    assert (cfg.rollout.temperature, cfg.trainer.beta, cfg.trainer.save_steps) == (0.9, 0.1, 4)
    assert cfg.model == demo.model


def test_the_written_config_is_what_runs(tmp_path):
    cfg = load_config(None, ["rollout.temperature=0.9", "trainer.generation_batch_size=32"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert cfg.trainer.prompts_per_step == 4  # generation_batch_size / num_generations


def test_run_changes_name_what_changes_a_training_step():
    from grpolab.config import run_changes, to_dict

    saved = to_dict(load_config())
    assert run_changes(saved, load_config()) == []
    free = ["max_steps=9", "trainer.save_steps=3", "trainer.num_threads=2", "output_dir=x"]
    assert run_changes(saved, load_config(None, free)) == []
    changed = load_config(None, ["trainer.learning_rate=1e-3", "seed=4", "task.max_operand=50"])
    assert run_changes(saved, changed) == [
        ("seed", 0, 4),
        ("task.max_operand", 99, 50),
        ("trainer.learning_rate", 0.0003, 0.001),
    ]
    # With a cosine schedule, max_steps sets the learning rate of every later step.
    cosine = to_dict(load_config(None, ["trainer.lr_scheduler=cosine"]))
    longer = load_config(None, ["trainer.lr_scheduler=cosine", "max_steps=800"])
    assert run_changes(cosine, longer) == [("max_steps", 400, 800)]


def test_overrides_move_behind_the_flags_and_resume_takes_only_a_path():
    from grpolab.cli import build_parser, overrides_last

    parser = build_parser()

    def parsed(*argv):
        return parser.parse_args(overrides_last(list(argv), parser))

    args = parsed("train", "--resume", "output_dir=X")
    assert (args.resume, args.overrides) == (True, ["output_dir=X"])
    args = parsed("train", "max_steps=5", "--skip-preflight", "trainer.beta=0")
    assert args.skip_preflight and args.overrides == ["max_steps=5", "trainer.beta=0"]
    args = parsed("train", "--resume", "runs/x/checkpoint-5", "a=1", "--config", "c.yaml")
    assert (args.resume, args.overrides, args.config) == ("runs/x/checkpoint-5", ["a=1"], "c.yaml")
    args = parsed("train", "a=1", "--resume")
    assert (args.resume, args.overrides) == (True, ["a=1"])
    assert parsed("report", "runs/x").run_dir == "runs/x"
