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
        (["rollout.sampler=gumbel"], "rollout.sampler"),
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
    "rewards.fallback=-1",
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


# --- Conflicts said, not swallowed ------------------------------------------------------------


def test_a_misspelt_key_suggests_the_close_one_in_overrides_and_in_files(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lerning_rate=1e-6"])
    assert str(err.value) == "unknown key trainer.lerning_rate: did you mean trainer.learning_rate?"
    path = tmp_path / "typo.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"config file {str(path)!r}: unknown key rollout.temprature: did you mean "
        "rollout.temperature?"
    )
    with pytest.raises(ConfigError, match=r"valid keys in trainer: \["):  # nothing close
        load_config(None, ["trainer.zzz=1"])


def test_a_profile_convention_yields_to_a_key_it_conflicts_with():
    from grpolab.config import load_notes

    cfg = load_config(None, ["trainer.profile=verl", "trainer.loss_type=cispo",
                             "trainer.epsilon_high=5"])  # fmt: skip
    assert cfg.trainer.dual_clip is None and cfg.objective.surrogate == "cispo"
    assert cfg.trainer.kl_clamp == 10.0  # the rest of verl's conventions stay
    assert load_notes(cfg) == [
        "profile verl's dual_clip=3.0 not applied: trainer.loss_type=cispo (CISPO has no "
        "clipped surrogate to bound)"
    ]
    with pytest.raises(ConfigError) as err:  # given by the user, it stays an error
        load_config(None, ["trainer.profile=verl", "trainer.loss_type=cispo",
                           "trainer.epsilon_high=5", "trainer.dual_clip=3"])  # fmt: skip
    assert str(err.value) == (
        "trainer.dual_clip=3.0 has no effect with trainer.loss_type=cispo: CISPO has no clipped "
        "surrogate for it to bound; remove it"
    )


def test_generation_batch_size_and_prompts_per_step_must_agree(tmp_path):
    with pytest.raises(ConfigError, match=r"disagree .*give one of them"):
        load_config(None, ["trainer.generation_batch_size=32", "trainer.prompts_per_step=8"])
    cfg = load_config(None, ["trainer.generation_batch_size=64", "trainer.prompts_per_step=8"])
    assert cfg.trainer.prompts_per_step == 8
    path = tmp_path / "x.yaml"
    path.write_text("trainer:\n  prompts_per_step: 8\n")
    from grpolab.config import load_notes

    cfg = load_config(path, ["trainer.generation_batch_size=32"])  # the later choice wins
    assert cfg.trainer.prompts_per_step == 4
    assert "prompts_per_step not applied" in load_notes(cfg)[0]


# Each rule of config.INERT: overrides whose first key has no effect in that setup.
INERT_CASES = [
    ["rollout.vllm_gpu_memory_utilization=0.5"],
    ["rollout.vllm_max_model_len=128"],
    ["rollout.vllm_enforce_eager=true"],
    ["rollout.vllm_sync_tolerance=0.01"],
    ["rollout.shared_prefill=false", "rollout.engine=vllm"],
    ["rollout.sampler=inverse_cdf", "rollout.engine=vllm"],
    ["rollout.max_turns=2"],
    ["rollout.max_episode_tokens=64"],
    ["rollout.tools=[x.py:f]", "rollout.environment=y.py:Env"],
    ["rollout.tool_timeout=3"],
    ["rewards.format_pattern=x"],
    ["rewards.overlong_buffer=4"],
    ["rewards.timeout=5"],
    ["model.gguf_file=x.gguf"],
    ["model.cache_dir=/tmp/x"],
    ["task.operators=+-", "task.name=jsonl", "task.path=x.jsonl"],
    ["task.path=x.jsonl"],
    ["task.split=test", "task.name=jsonl", "task.path=x.jsonl"],
    ["task.system_prompt=Be brief."],
    ["task.eval_fraction=0.1", "task.name=jsonl", "task.path=x.jsonl", "task.eval_path=y.jsonl"],
    ["trainer.scale_rewards=batch", "trainer.advantage_estimator=rloo"],
    ["trainer.advantage_eps=1e-6", "trainer.advantage_estimator=rloo",
     "trainer.zero_std_guard=false"],
    ["trainer.advantage_std=sample", "trainer.scale_rewards=none",
     "trainer.zero_std_guard=false"],
    ["trainer.epsilon=0.1", "trainer.loss_type=cispo", "trainer.epsilon_high=5"],
    ["trainer.delta=2", "trainer.loss_type=cispo", "trainer.epsilon_high=5"],
    ["trainer.kl_estimator=k1"],
    ["trainer.kl_clamp=10"],
    ["trainer.use_bias_correction_kl=true"],
    ["trainer.dynamic_sampling_max_rounds=2"],
    ["trainer.tis_cap=2", "rollout.engine=vllm", "rollout.top_k=20"],
    ["trainer.shared_prefix=false", "trainer.logprobs=naive"],
    ["trainer.lora_alpha=32"],
    ["trainer.skip_zero_advantage=false", "trainer.beta=0.04"],
    ["trainer.lora_dropout=0.1"],
    ["trainer.lora_target_modules=[q_proj]"],
    ["trainer.eval_steps=10", "trainer.eval_examples=0"],
    ["trainer.eval_max_completion_length=12", "trainer.eval_examples=0"],
    ["trainer.eval_examples=50", "task.num_eval=0"],
    ["trainer.log_completions_count=8", "trainer.log_completions_steps=0"],
    ["trainer.monitor_clip_frac_max=0.5", "trainer.monitor=off"],
    ["trainer.ddp_bucket_mb=5", "trainer.distributed=fsdp"],
]


@pytest.mark.parametrize("overrides", INERT_CASES, ids=lambda o: o[0])
def test_a_key_without_effect_is_refused_with_the_reason(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    key = overrides[0].split("=")[0]
    assert message.startswith(f"{key}=") and "has no effect" in message, message
    assert message.endswith("; remove it") and "\n" not in message


def test_every_inert_rule_has_a_case():
    from grpolab.config import INERT

    refused = {o[0].split("=")[0] for o in INERT_CASES}
    assert all(refused & set(rule.keys) for rule in INERT)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.vllm_gpu_memory_utilization=0.3"],  # the default
        ["trainer.profile=verl"],  # verl's kl_clamp=10 with beta=0: the profile's own
        ["trainer.profile=verl", "trainer.kl_clamp=10"],  # equal to the profile's
        ["trainer.beta=0.04", "trainer.kl_clamp=10"],  # acts with a KL term
        ["trainer.lora_r=8", "trainer.lora_alpha=32"],
        ["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.5"],
        ["trainer.precision=bf16", "rollout.vllm_sync_tolerance=0.01"],  # the hf bf16 copies
        ["trainer.precision=auto", "rollout.vllm_sync_tolerance=0.01"],
        ["rollout.sampler=inverse_cdf"],
    ],
)
def test_keys_that_act_or_equal_their_baseline_load(overrides):
    load_config(None, overrides)


def test_a_files_key_yields_to_a_later_override_that_makes_it_inert(tmp_path):
    from grpolab.config import load_notes

    path = tmp_path / "vllm.yaml"
    path.write_text("rollout:\n  engine: vllm\n  vllm_gpu_memory_utilization: 0.5\n")
    cfg = load_config(path, ["rollout.engine=hf"])
    assert cfg.rollout.vllm_gpu_memory_utilization == 0.3  # back to the default: no effect
    assert load_notes(cfg) == [
        "rollout.vllm_gpu_memory_utilization=0.5 not applied: it has no effect with "
        "rollout.engine=hf: it configures the vLLM engine (rollout.engine given after it)"
    ]
    again = tmp_path / "resolved.yaml"  # what it ran with loads as it is
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg
    path.write_text("rollout:\n  vllm_gpu_memory_utilization: 0.5\n")  # the file alone
    with pytest.raises(ConfigError, match=r"has no effect with rollout\.engine=hf"):
        load_config(path)


def test_every_shipped_example_loads_without_notes():
    from pathlib import Path

    from grpolab.config import load_notes

    for path in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")):
        assert load_notes(load_config(path)) == [], path
