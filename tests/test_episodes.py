"""Multi-turn episodes on real tiny models: the token layout and the mask of an episode, tools
that fail, groups whose samples take different numbers of turns, the episode checks on
grpolab's own functions (the mutants that must fail them: tests/test_check_coverage.py)."""

import pytest
import torch
from tolerances import logprob_tolerance

from grpolab import core
from grpolab.checks.episodes import EPISODE_IDS
from grpolab.checks.runner import run_episode_checks
from grpolab.model.policy import DEFAULT_CHARS, build_char_tokenizer
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.episodes import (
    EpisodeSetup,
    ProbeEnvironment,
    template_glue,
)
from grpolab.rollout.hf import HFEngine
from grpolab.rollout.tools import Observation, ToolEnvironment, parse_call, run_tool


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[0]


class TwoTurns:
    """Every character ends a turn; the first turn is answered with "42", the second ends
    the episode: each episode is [a1][tool turn]["a2"] unless the model writes EOS first."""

    stop_strings = tuple(DEFAULT_CHARS)

    def __init__(self):
        self.turns = 0

    def reset(self, prompt):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return Observation("42", called=True, name="calc")
        return Observation(done=True)

    def reward(self):
        return float(self.turns)


def engine_for(model, tokenizer, factory, chat_template=False, tools=()):
    setup = EpisodeSetup(factory, tokenizer, chat_template, tools)
    return HFEngine(model, tokenizer, chat_template=chat_template, episodes=setup)


def params(seed=0, turn=8, turns=3, budget=64):
    return SamplingParams(
        max_completion_length=turn, seed=seed, max_turns=turns, max_episode_tokens=budget
    )


def test_a_two_turn_episode_has_the_exact_token_layout_and_mask(model, tokenizer):
    engine = engine_for(model, tokenizer, TwoTurns)
    r = engine.generate(["37+48=", "5+5="], 4, params())
    tool = tokenizer("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    P, k = r.prompt_length, len(tool)
    two_turn = 0
    for i in range(r.batch_size):
        roles = [t.role for t in r.turns[i]]
        if roles[0] == "assistant" and len(roles) == 1:  # EOS as the first token
            assert r.input_ids[i, P] == tokenizer.eos_token_id
            continue
        two_turn += 1
        assert roles == ["assistant", "tool", "assistant"]
        a1, t, a2 = r.turns[i]
        assert (a1.start, a1.end, t.start, t.end, a2.start, a2.end) == (
            0,
            1,
            1,
            1 + k,
            1 + k,
            2 + k,
        )
        assert r.input_ids[i, P + 1 : P + 1 + k].tolist() == tool  # the tool turn, as tokens
        expected_mask = [1] + [0] * k + [1]
        assert r.completion_mask[i, P : P + k + 2].tolist() == expected_mask
        assert r.completion_mask[i, P + k + 2 :].sum() == 0
        assert r.attention_mask[i].sum() == (r.attention_mask[i, :P].sum() + k + 2)
        # engine log-probs exactly on the sampled tokens (entry t: the token at t + 1)
        nonzero = (r.engine_logprobs[i] != 0).nonzero().squeeze(1).tolist()
        assert nonzero == [P - 1, P + k]
        assert r.completions[i] == tokenizer.decode(r.input_ids[i, P + k + 1 : P + k + 2])
        assert r.episode_rewards[i] == 2.0 and not r.truncated[i]
    assert two_turn >= 6
    # The trainer's log-probs of that very stream equal the engine's on the mask.
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    torch.testing.assert_close(
        r.engine_logprobs, logp * mask, atol=logprob_tolerance(model), rtol=0
    )


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def calc(expression: str) -> str:
    """Evaluate a product.

    Args:
        expression: like 2*3
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


def test_the_chat_template_renders_the_tools_and_the_tool_turn(model):
    tok = build_char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    assert template_glue(tok) == ("</assistant>\n<tool>", "</tool>\n<assistant>")
    engine = engine_for(model, tok, TwoTurns, chat_template=True, tools=[calc])
    r = engine.generate(["2*3"], 2, params())
    text = tok.decode(r.input_ids[0][r.attention_mask[0].bool()])
    assert text.startswith('<tools>[{"type": "function", "function": {"name": "calc"')
    if len(r.turns[0]) == 3:
        tool = r.turns[0][1]
        glue = tok("</assistant>\n<tool>42</tool>\n<assistant>", add_special_tokens=False)
        P = r.prompt_length
        assert r.input_ids[0, P + tool.start : P + tool.end].tolist() == glue["input_ids"]
    # A template that ignores tools=: the tools are listed in a system turn instead.
    plain = build_char_tokenizer()
    plain.chat_template = TOOL_TEMPLATE.replace("{% if tools %}", "{% if false %}")
    engine = engine_for(model, plain, TwoTurns, chat_template=True, tools=[calc])
    r = engine.generate(["2*3"], 1, params())
    text = plain.decode(r.input_ids[0][r.attention_mask[0].bool()])
    assert text.startswith("<system>You can call these tools:\n- calc(expression: string)")


def boom(expression: str) -> str:
    """Raises.

    Args:
        expression: anything
    """
    raise RuntimeError("boom")


def hang(expression: str) -> str:
    """Never returns in time.

    Args:
        expression: anything
    """
    import time

    time.sleep(20)
    return "late"


def nothing(expression: str) -> str:
    """Returns no text.

    Args:
        expression: anything
    """
    return None


def test_a_failing_tool_is_an_error_message_never_a_crash():
    assert run_tool(boom, {"expression": "1"}, 1.0) == (
        "error: boom raised RuntimeError: boom",
        True,
    )
    assert run_tool(hang, {"expression": "1"}, 0.1) == ("error: hang timed out after 0.1 s", True)
    assert run_tool(nothing, {"": "1"}, 1.0) == ("error: nothing returned NoneType, not text", True)
    assert run_tool(calc, {"": "2*3"}, 1.0) == ("6", False)
    assert parse_call('<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>')
    assert isinstance(parse_call("<tool_call>{oops</tool_call>"), str)
    assert parse_call("no call") is None


class CallsEachTool(ToolEnvironment):
    """Every character ends a turn; turn k calls tools[k] by name (the call text the model
    would write), so each failure meets the decode loop."""

    stop_strings = tuple(DEFAULT_CHARS)

    def __init__(self):
        super().__init__([boom, hang, nothing, calc], timeout=0.2)
        self.k = 0

    def step(self, text):
        names = ["boom", "hang", "nothing", "calc", "missing"]
        if self.k == len(names):
            return Observation(done=True)
        call = f"<tool_call>{names[self.k]}(6*7)</tool_call>"
        self.k += 1
        return super().step(call)


def test_tools_that_raise_hang_or_return_no_text_are_counted_and_the_episode_goes_on(
    model, tokenizer
):
    import time

    from grpolab.rollout.episodes import episode_metrics

    engine = engine_for(model, tokenizer, CallsEachTool)
    tic = time.time()
    r = engine.generate(["6*7="], 2, params(turns=6, budget=400, turn=4))
    assert time.time() - tic < 10  # the hanging tool (20 s) was not waited for
    for turns in r.turns:
        tools = [t for t in turns if t.role == "tool"]
        if len(tools) == 5:
            assert [t.error for t in tools] == [True, True, True, False, True]
            assert tools[0].text.startswith("error: boom raised RuntimeError")
            assert tools[3].text == "42"
            assert "no tool named 'missing'" in tools[4].text
    metrics = episode_metrics(r)
    assert metrics["episode/tool_errors"] > 0 and metrics["episode/tool_calls"] > 0


def test_the_samples_of_a_group_take_different_numbers_of_turns(model, tokenizer):
    engine = engine_for(model, tokenizer, ProbeEnvironment)
    r = engine.generate(["37+48=", "5+5=", "12+30="], 8, params(turns=4, budget=96))
    counts = [len(t) for t in r.turns]
    groups = [set(counts[g * 8 : (g + 1) * 8]) for g in range(3)]
    assert all(len(g) > 1 for g in groups), counts
    P = r.prompt_length
    for i, turns in enumerate(r.turns):  # every row: mask 1 exactly on its assistant turns
        mask = torch.zeros(r.input_ids.shape[1] - P, dtype=torch.long)
        for t in turns:
            if t.role == "assistant":
                mask[t.start : t.end] = 1
        assert torch.equal(r.completion_mask[i, P:], mask)
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    torch.testing.assert_close(
        r.engine_logprobs, logp * mask, atol=logprob_tolerance(model), rtol=0
    )


def by_id(results):
    return {r.id: r for r in results}


def test_grpolab_passes_every_episode_check(model, probe_batch):
    results = by_id(run_episode_checks(model, probe_batch))
    assert set(results) == set(EPISODE_IDS)
    failed = [(r.id, r.measured, r.error) for r in results.values() if not r.passed]
    assert not failed


def test_the_tool_warmup_rows_mask_the_tool_turn_as_training_does():
    from grpolab.commands.warmup import TOOL_CHARS, tool_sft_rows
    from grpolab.rollout.episodes import ToolTurnRenderer
    from grpolab.tasks.arithmetic import make_example

    tok = build_char_tokenizer(TOOL_CHARS)
    example = make_example(123, "*", 456)
    ids, labels = tool_sft_rows(tok, [example], 1.0, torch.Generator().manual_seed(0))
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = enc("<tool_call>calculator(123*456)</tool_call>")
    tool = ToolTurnRenderer(tok, chat_template=False)("56088")
    answer = [*enc("56088"), tok.eos_token_id]
    assert ids[0].tolist() == enc("123*456=") + call + tool + answer
    assert labels[0].tolist() == [-100] * 8 + call + [-100] * len(tool) + answer


def test_bad_tool_config_is_a_one_line_error(tmp_path):
    from grpolab.config import ConfigError, load_config
    from grpolab.rollout import RolloutConfig, episode_setup

    with pytest.raises(ConfigError, match=r"rollout\.max_turns"):
        load_config(None, ["rollout.max_turns=0"])
    with pytest.raises(ConfigError, match=r"rollout\.max_episode_tokens"):
        load_config(None, ["rollout.max_episode_tokens=2"])
    tok = build_char_tokenizer()
    for ref, message in [
        ("no_colon", "expected 'package.module:function'"),
        (f"{tmp_path}/missing.py:f", "does not exist"),
        ("grpolab.core:no_such_tool", "has no callable 'no_such_tool'"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            episode_setup(RolloutConfig(tools=[ref]), tok, False)
        assert "rollout.tools" in str(err.value) and "\n" not in str(err.value)
    untyped = tmp_path / "untyped.py"
    untyped.write_text("def f(x):\n    return x\n")
    with pytest.raises(ValueError, match="type hints"):
        episode_setup(RolloutConfig(tools=[f"{untyped}:f"]), tok, False)


def test_the_environment_reward_is_added_to_the_rewards(model, tokenizer):
    from grpolab.rewards import score
    from grpolab.tasks.base import Example

    r = engine_for(model, tokenizer, TwoTurns).generate(["5+5="], 4, params())
    result = score(r, [Example("5+5=", "10")], ["accuracy"])
    expected = torch.tensor([2.0 if len(t) == 3 else 1.0 for t in r.turns])
    assert torch.equal(result.per_function["environment"], expected)
    assert torch.equal(result.total, expected + result.per_function["accuracy"])
    assert result.metrics["episode/tool_calls"] == sum(len(t) == 3 for t in r.turns) / 4


def test_an_environment_class_from_the_config_runs_the_episodes(model, tokenizer, tmp_path):
    from grpolab.rollout import RolloutConfig, episode_setup

    cfg = RolloutConfig(environment="grpolab.rollout.episodes:ProbeEnvironment", max_turns=3)
    setup = episode_setup(cfg, tokenizer, False)
    assert setup.factory is ProbeEnvironment and setup.max_turns == 3
    r = HFEngine(model, tokenizer, episodes=setup).generate(["5+5="], 8, params())
    assert max(len(t) for t in r.turns) > 1
    broken = tmp_path / "env.py"
    broken.write_text("class Env:\n    def reset(self, prompt):\n        pass\n")
    with pytest.raises(ValueError, match="no step"):
        episode_setup(RolloutConfig(environment=f"{broken}:Env"), tokenizer, False)
