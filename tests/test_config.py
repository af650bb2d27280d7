"""Config: YAML + dotted overrides, and one-line errors that name the key."""

from __future__ import annotations

import pytest

from grpolab.config import (
    Config,
    ConfigError,
    baseline,
    get,
    load_config,
    load_warnings,
    objective_of,
    to_yaml,
)


def test_defaults_are_the_cpu_demo():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.name_or_path is None
    assert cfg.task.name == "arithmetic"
    assert cfg.batch_size == cfg.batch.prompts_per_step * cfg.batch.num_generations


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("max_steps: 7\ntrainer:\n  learning_rate: 1.0e-5\n  num_generations: 4\n")
    cfg = load_config(path, ["optim.learning_rate=1e-6", "output_dir=runs/x", "seed=3"])
    assert cfg.max_steps == 7
    assert cfg.batch.num_generations == 4
    assert cfg.optim.learning_rate == 1e-6  # YAML 1.1 reads "1e-6" as a string: coerced
    assert (cfg.output_dir, cfg.seed) == ("runs/x", 3)


def test_string_fields_keep_their_text_and_null_means_none():
    cfg = load_config(None, ["model.name_or_path=123"])
    assert cfg.model.name_or_path == "123"
    cfg = load_config(None, ["model.name_or_path=null", "logging.report_to=tensorboard,wandb"])
    assert cfg.model.name_or_path is None
    assert cfg.logging.report_to == ["tensorboard", "wandb"]


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["objective.beta=0.04", "rollout.temperature=0.7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["trainer.lerning_rate=1e-6"], "trainer.lerning_rate"),
        (["nosuch=1"], "nosuch"),
        (["batch.num_generations=abc"], "batch.num_generations"),
        (["batch.num_generations=1"], "batch.num_generations"),
        (["optim.learning_rate=fast"], "optim.learning_rate"),
        (["logging.progress=maybe"], "logging.progress"),
        (["batch.generation_batch_size=10"], "batch.generation_batch_size"),
        (["batch.mini_batch_size=1000"], "batch.mini_batch_size"),
        (["batch.mini_batch_size=48"], "batch.mini_batch_size"),
        (["batch.gradient_accumulation_steps=3"], "batch.gradient_accumulation_steps"),
        (["objective.epsilon=1.5"], "objective.epsilon"),
        (["objective.beta=-1"], "objective.beta"),
        (["objective.loss_type=mean"], "objective.loss_type"),
        (["objective.scale_rewards=yes"], "objective.scale_rewards"),
        (["objective.logprob_source=vllm"], "objective.logprob_source"),
        (["schedule.lr_scheduler=linear"], "schedule.lr_scheduler"),
        (["logging.report_to=mlflow"], "logging.report_to"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["rollout.hf.sampler=gumbel"], "rollout.hf.sampler"),
        (["max_steps=-1"], "max_steps"),
        (["trainer=3"], "trainer"),
        (["optim.learning_rate"], "optim.learning_rate"),
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
    cfg = load_config(None, ["batch.generation_batch_size=32", "batch.num_generations=4"])
    assert cfg.batch.prompts_per_step == 8
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
    "checkpoints.save_steps=4",
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
    cfg = load_config(path, ["checkpoints.save_steps=4"])
    demo = load_config()
    assert cfg.rollout.max_completion_length == demo.rollout.max_completion_length == 6
    assert cfg.runtime.num_threads == demo.runtime.num_threads == 1
    got = (cfg.rollout.temperature, cfg.objective.beta, cfg.checkpoints.save_steps)
    assert got == (0.9, 0.1, 4)
    assert cfg.model == demo.model


def test_the_written_config_is_what_runs(tmp_path):
    cfg = load_config(None, ["rollout.temperature=0.9", "batch.generation_batch_size=32"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert cfg.batch.prompts_per_step == 4  # generation_batch_size / num_generations


def test_run_changes_name_what_changes_a_training_step():
    from grpolab.config import run_changes, to_dict

    saved = to_dict(load_config())
    assert run_changes(saved, load_config()) == []
    free = ["max_steps=9", "checkpoints.save_steps=3", "runtime.num_threads=2", "output_dir=x"]
    assert run_changes(saved, load_config(None, free)) == []
    changed = load_config(None, ["optim.learning_rate=1e-3", "seed=4", "task.max_operand=50"])
    assert run_changes(saved, changed) == [
        ("seed", 0, 4),
        ("task.max_operand", 99, 50),
        ("optim.learning_rate", 0.0003, 0.001),
    ]
    # With a cosine schedule, max_steps sets the learning rate of every later step.
    cosine = to_dict(load_config(None, ["schedule.lr_scheduler=cosine"]))
    longer = load_config(None, ["schedule.lr_scheduler=cosine", "max_steps=800"])
    assert run_changes(cosine, longer) == [("max_steps", 400, 800)]


def test_overrides_move_behind_the_flags_and_resume_takes_only_a_path():
    from grpolab.commands.cli import build_parser, overrides_last

    parser = build_parser()

    def parsed(*argv):
        return parser.parse_args(overrides_last(list(argv), parser))

    args = parsed("train", "--resume", "output_dir=X")
    assert (args.resume, args.overrides) == (True, ["output_dir=X"])
    args = parsed("train", "max_steps=5", "--skip-preflight", "objective.beta=0")
    assert args.skip_preflight and args.overrides == ["max_steps=5", "objective.beta=0"]
    args = parsed("train", "--resume", "runs/x/checkpoint-5", "a=1", "--config", "c.yaml")
    assert (args.resume, args.overrides, args.config) == ("runs/x/checkpoint-5", ["a=1"], "c.yaml")
    args = parsed("train", "a=1", "--resume")
    assert (args.resume, args.overrides) == (True, ["a=1"])
    assert parsed("report", "runs/x").run_dir == "runs/x"


# --- Conflicts said, not swallowed ------------------------------------------------------------


def test_a_misspelt_key_suggests_the_close_one_in_overrides_and_in_files(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lerning_rate=1e-6"])
    assert str(err.value) == "unknown key trainer.lerning_rate: did you mean optim.learning_rate?"
    path = tmp_path / "typo.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"config file {str(path)!r}: unknown key rollout.temprature: did you mean "
        "rollout.temperature?"
    )
    with pytest.raises(ConfigError, match=r"trainer section's keys are now in batch, objective"):
        load_config(None, ["trainer.zzz=1"])  # nothing close


def test_a_profile_convention_yields_to_a_key_it_conflicts_with():
    from grpolab.config import load_notes

    cfg = load_config(None, ["objective.profile=verl", "objective.loss_type=cispo",
                             "objective.epsilon_high=5"])  # fmt: skip
    assert cfg.objective.dual_clip is None and objective_of(cfg).policy_term == "cispo"
    assert cfg.objective.kl_clamp == 10.0  # the rest of verl's conventions stay
    assert load_notes(cfg) == [
        "profile verl's dual_clip=3.0 not applied: objective.loss_type=cispo (CISPO has no "
        "clipped surrogate to bound)"
    ]
    given = ["objective.profile=verl", "objective.loss_type=cispo", "objective.epsilon_high=5",
             "objective.dual_clip=3"]  # fmt: skip
    # Given by the user, it is said (ignored with a warning) or, under strict, refused.
    assert load_warnings(load_config(None, given)) == [
        "objective.dual_clip=3.0 has no effect with objective.loss_type=cispo: that loss has no "
        "clipped surrogate for it to bound: ignored (--strict refuses it)"
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*given, "strict=true"])
    assert str(err.value) == (
        "objective.dual_clip=3.0 has no effect with objective.loss_type=cispo: that loss has no "
        "clipped surrogate for it to bound; remove it (strict refuses it)"
    )


def test_generation_batch_size_and_prompts_per_step_must_agree(tmp_path):
    with pytest.raises(ConfigError, match=r"disagree .*give one of them"):
        load_config(None, ["batch.generation_batch_size=32", "batch.prompts_per_step=8"])
    cfg = load_config(None, ["batch.generation_batch_size=64", "batch.prompts_per_step=8"])
    assert cfg.batch.prompts_per_step == 8
    path = tmp_path / "x.yaml"
    path.write_text("trainer:\n  prompts_per_step: 8\n")
    from grpolab.config import load_notes

    cfg = load_config(path, ["batch.generation_batch_size=32"])  # the later choice wins
    assert cfg.batch.prompts_per_step == 4
    assert any("prompts_per_step not applied" in note for note in load_notes(cfg))


# Each rule of config.INERT: overrides whose first key has no effect in that setup.
INERT_CASES = [
    ["rollout.vllm.gpu_memory_utilization=0.5"],
    ["rollout.vllm.max_model_len=128"],
    ["rollout.vllm.enforce_eager=true"],
    ["rollout.sync_tolerance=0.01"],
    ["rollout.hf.shared_prefill=false", "rollout.engine=vllm"],
    ["rollout.hf.sampler=inverse_cdf", "rollout.engine=vllm"],
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
    ["objective.scale_rewards=batch", "objective.advantage_estimator=rloo"],
    [
        "objective.advantage_eps=1e-6",
        "objective.advantage_estimator=rloo",
        "objective.zero_std_guard=false",
    ],
    [
        "objective.advantage_std=sample",
        "objective.scale_rewards=none",
        "objective.zero_std_guard=false",
    ],
    ["objective.epsilon=0.1", "objective.loss_type=cispo", "objective.epsilon_high=5"],
    ["objective.delta=2", "objective.loss_type=cispo", "objective.epsilon_high=5"],
    ["objective.dual_clip=3", "objective.loss_type=sapo"],
    ["objective.kl_estimator=k1"],
    ["objective.kl_clamp=10"],
    ["objective.use_bias_correction_kl=true"],
    ["objective.dynamic_sampling_max_rounds=2"],
    ["objective.tis_cap=2", "rollout.engine=vllm", "rollout.top_k=20"],
    ["objective.sapo_temperature_neg=2"],
    ["objective.epsilon_high=0.3", "objective.loss_type=sapo"],
    ["runtime.shared_prefix=false", "runtime.logprobs=naive"],
    ["lora.alpha=32"],
    ["runtime.skip_zero_advantage=false", "objective.beta=0.04"],
    ["lora.dropout=0.1"],
    ["lora.target_modules=[q_proj]"],
    ["eval.eval_steps=10", "eval.eval_examples=0"],
    ["eval.eval_max_completion_length=12", "eval.eval_examples=0"],
    ["eval.eval_examples=50", "task.num_eval=0"],
    ["logging.log_completions_count=8", "logging.log_completions_steps=0"],
    ["monitors.clip_frac_max=0.5", "monitors.action=off"],
    ["monitors.tis_capped_max=0.5"],
    ["parallel.ddp_bucket_mb=5", "parallel.strategy=fsdp"],
    ["task.dataset=chain_sum"],
    ["task.dataset_config={min_terms: 3}", "task.name=reasoning_gym", "task.dataset=[chain_sum]"],
]


@pytest.mark.parametrize("overrides", INERT_CASES, ids=lambda o: o[0])
def test_a_key_without_effect_is_a_warning_and_refused_under_strict(overrides):
    key = overrides[0].split("=")[0]
    cfg = load_config(None, overrides)  # the run goes on: the key is said and ignored
    (warning,) = [w for w in load_warnings(cfg) if w.startswith(f"{key}=")]
    assert "has no effect" in warning and warning.endswith(": ignored (--strict refuses it)")
    assert get(cfg, key) == baseline(cfg, key)  # ignored: what a run without it holds
    with pytest.raises(ConfigError) as err:
        load_config(None, [*overrides, "strict=true"])
    message = str(err.value)
    assert message.startswith(f"{key}=") and "has no effect" in message, message
    assert message.endswith("; remove it (strict refuses it)") and "\n" not in message


def test_every_inert_rule_has_a_case():
    from grpolab.config import INERT

    refused = {o[0].split("=")[0] for o in INERT_CASES}
    assert all(refused & set(rule.keys) for rule in INERT)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.vllm.gpu_memory_utilization=0.3"],  # the default
        ["objective.profile=verl"],  # verl's kl_clamp=10 with beta=0: the profile's own
        ["objective.profile=verl", "objective.kl_clamp=10"],  # equal to the profile's
        ["objective.beta=0.04", "objective.kl_clamp=10"],  # acts with a KL term
        ["lora.r=8", "lora.alpha=32"],
        ["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.5"],
        ["runtime.precision=bf16", "rollout.sync_tolerance=0.01"],  # the hf bf16 copies
        ["runtime.precision=auto", "rollout.sync_tolerance=0.01"],
        ["rollout.hf.sampler=inverse_cdf"],
        ["objective.tis_cap=2", "monitors.tis_capped_max=0.5"],
    ],
)
def test_keys_that_act_or_equal_their_baseline_load(overrides):
    load_config(None, overrides)


def test_a_files_key_yields_to_a_later_override_that_makes_it_inert(tmp_path):
    from grpolab.config import load_notes

    path = tmp_path / "vllm.yaml"
    path.write_text("rollout:\n  engine: vllm\n  vllm:\n    gpu_memory_utilization: 0.5\n")
    cfg = load_config(path, ["rollout.engine=hf"])
    assert cfg.rollout.vllm.gpu_memory_utilization == 0.3  # back to the default: no effect
    assert load_notes(cfg) == [
        "rollout.vllm.gpu_memory_utilization=0.5 not applied: it has no effect with "
        "rollout.engine=hf: it configures the vLLM engine (rollout.engine given after it)"
    ]
    again = tmp_path / "resolved.yaml"  # what it ran with loads as it is
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg
    path.write_text("rollout:\n  vllm:\n    gpu_memory_utilization: 0.5\n")  # the file alone
    (warning,) = load_warnings(load_config(path))
    assert "has no effect with rollout.engine=hf" in warning
    with pytest.raises(ConfigError, match=r"has no effect with rollout\.engine=hf"):
        load_config(path, ["strict=true"])


def test_every_shipped_example_loads_without_notes():
    from pathlib import Path

    from grpolab.config import load_notes

    for path in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")):
        assert load_notes(load_config(path)) == [], path


# --- The older names ---------------------------------------------------------------------------


def test_every_older_key_is_read_as_its_new_one_with_a_note(tmp_path):
    from grpolab.config import aliases, canonical, load_notes

    # A file and overrides in the one-section layout of before: the same config as the new.
    old = tmp_path / "old.yaml"
    old.write_text(
        "trainer:\n  epsilon: 0.1\n  lora_r: 8\n  monitor: stop\n  distributed: fsdp\n"
        "  learning_rate: 1.0e-4\n  eval_steps: 7\nrollout:\n  sampler: inverse_cdf\n"
        "  vllm_max_model_len: 64\n  vllm_sync_tolerance: 0.2\n"
    )
    new = tmp_path / "new.yaml"
    new.write_text(
        "objective:\n  epsilon: 0.1\nlora:\n  r: 8\nmonitors:\n  action: stop\n"
        "parallel:\n  strategy: fsdp\noptim:\n  learning_rate: 1.0e-4\neval:\n  eval_steps: 7\n"
        "rollout:\n  sync_tolerance: 0.2\n  hf:\n    sampler: inverse_cdf\n  vllm:\n"
        "    max_model_len: 64\n"
    )
    from grpolab.config import to_dict

    try:
        load_config(old)
    except ConfigError as e:  # the vLLM key without engine=vllm: refused under either name
        assert "rollout.vllm.max_model_len=64 has no effect" in str(e)
    assert to_dict(load_config(old, ["rollout.engine=vllm"])) == to_dict(
        load_config(new, ["rollout.engine=vllm"])
    )
    cfg = load_config(None, ["trainer.beta=0.04", "trainer.autocast=bf16"])
    assert cfg.objective.beta == 0.04 and cfg.runtime.precision == "bf16"
    assert load_notes(cfg) == [
        "older key names read as their new ones: trainer.autocast=bf16 -> "
        "runtime.precision=bf16, trainer.beta -> objective.beta"
    ]
    # Every key of the trainer section of before has its new home.
    for key in ("trainer.num_generations", "trainer.max_consecutive_nonfinite",
                "trainer.monitor_reward_strict_gap", "trainer.lora_target_modules"):  # fmt: skip
        assert key in aliases()
    assert canonical("trainer.monitor_clip_frac_max") == "monitors.clip_frac_max"
    disagree = r"trainer\.beta=0\.04 \(now objective\.beta\) and objective\.beta=0\.1 disagree"
    with pytest.raises(ConfigError, match=disagree):
        load_config(None, ["trainer.beta=0.04", "objective.beta=0.1"])


def test_the_config_is_frozen_and_built_once():
    import dataclasses

    cfg = load_config(None, ["objective.profile=trl"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.objective.beta = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 3  # type: ignore[misc]
    # The profile is applied at load: the resolved values are in the config itself.
    assert cfg.objective.advantage_std == "sample" and cfg.objective.loss_type == "dapo"
    assert "advantage_std: sample" in to_yaml(cfg)
