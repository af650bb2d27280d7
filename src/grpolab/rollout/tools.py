"""Tools and environments: what a multi-turn episode talks to.

A tool is a plain Python function with type hints and a Google-style docstring (TRL's
`tools` convention); the config lists it as "package.module:function" or
"path/to/file.py:function" (`rollout.tools`). Its JSON schema comes from transformers'
`get_json_schema` (the one a chat template's `tools=` receives).

The model calls a tool by writing

    <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>

(the Hermes / Qwen format that chat templates with tool support teach), or in the compact
fallback form `<tool_call>calculator(123*456)</tool_call>`, whose text between the
parentheses is the tool's only (or first required) argument. Generation stops when the
turn's text contains `</tool_call>`.

An environment (`rollout.environment`, "module:Class" or "file.py:Class") is the protocol
for stateful episodes: one instance per episode, `reset(prompt)` before the first turn,
`step(text)` after every assistant turn returning an `Observation` (the text appended to the
conversation as a tool turn, or `done`), and `reward()` at the end (the `environment`
reward). The functions of `rollout.tools` run through the built-in `ToolEnvironment`.

A tool that raises, runs past its timeout or returns something other than text (or a number,
written with `str`) is a tool error: counted, and an error message is the tool's result, so
the model sees it and the run goes on.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The plain-text rendering of a tool turn (no chat template, or one without tool support).
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_COMPACT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class Observation:
    """What the environment answers an assistant turn with."""

    text: str | None = None  # appended as a tool turn; None: nothing (the episode ends)
    done: bool = False  # the episode is over
    called: bool = False  # the turn called a tool
    error: bool = False  # ...and it failed (raised, timed out, returned non-text, bad call)
    name: str | None = None  # the tool called


class Environment(Protocol):
    """One episode's state. `stop_strings`: texts that end an assistant turn (besides EOS)."""

    stop_strings: Sequence[str]

    def reset(self, prompt: str) -> None: ...

    def step(self, text: str) -> Observation: ...

    def reward(self) -> float | None: ...


def load_object(ref: str, key: str) -> Any:
    """ "package.module:name" or "path/to/file.py:name" -> the object; one-line errors naming
    the config key."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"{key}={ref!r}: expected 'package.module:function' or 'path/to/file.py:function'"
        )
    if target.endswith(".py"):
        file = Path(target).expanduser()
        if not file.is_file():
            raise ValueError(f"{key}={ref!r}: file {target!r} does not exist")
        name = f"grpolab_user_tool_{abs(hash(str(file.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                raise ValueError(f"{key}={ref!r}: {type(e).__name__} on import: {e}") from None
            sys.modules[name] = module
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise ValueError(f"{key}={ref!r}: cannot import {target!r} ({e})") from None
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        raise ValueError(f"{key}={ref!r}: {target!r} has no callable {attr!r}")
    return obj


def load_tools(refs: Sequence[str | Callable]) -> list[Callable]:
    """The functions of `rollout.tools`, each checked for a usable schema."""
    tools = [r if callable(r) else load_object(r, "rollout.tools") for r in refs]
    names = [t.__name__ for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.tools={list(refs)!r}: two tools share a name ({names})")
    for tool in tools:
        tool_schema(tool)
    return tools


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The tool's JSON schema from its type hints and docstring (TRL's convention)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise ValueError(
            f"rollout.tools: {getattr(fn, '__name__', fn)!r} needs type hints on every "
            f"argument and a Google-style docstring with an Args section ({e})"
        ) from None


def describe_tools(tools: Sequence[Callable]) -> str:
    """The fallback description of the tools, for a system prompt (a chat template without
    tool support): one line per tool and the call format."""
    lines = ["You can call these tools:"]
    for tool in tools:
        f = tool_schema(tool)["function"]
        args = ", ".join(
            f"{name}: {p.get('type', 'any')}" for name, p in f["parameters"]["properties"].items()
        )
        lines.append(f"- {f['name']}({args}): {f.get('description', '')}")
    lines.append(
        f'To call one, write {CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}; '
        f"its result comes back as {RESULT_OPEN}...{RESULT_CLOSE}."
    )
    return "\n".join(lines)


def parse_call(text: str) -> ToolCall | str | None:
    """The first tool call in an assistant turn's text: a ToolCall, None when there is none,
    or an error message (a call that cannot be read)."""
    match = _CALL.search(text)
    if match is None:
        return None
    body = match.group(1).strip()
    if body.startswith("{"):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            return f"the tool call is not valid JSON ({e.msg})"
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return 'the tool call needs {"name": ..., "arguments": {...}}'
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return "the tool call's arguments are not a JSON object"
        if not isinstance(arguments, dict):
            return "the tool call's arguments are not a JSON object"
        return ToolCall(data["name"], arguments)
    compact = _COMPACT.match(body)
    if compact is None:
        return "the tool call is neither JSON nor name(argument)"
    return ToolCall(compact.group(1), {"": compact.group(2)})


def run_tool(tool: Callable, arguments: dict[str, Any], timeout: float) -> tuple[str, bool]:
    """(result text, error). The tool runs in a daemon thread and is waited for at most
    `timeout` seconds (a Python thread cannot be killed: a hanging one is abandoned)."""
    if "" in arguments:  # the compact form: the one argument, by position
        params = tool_schema(tool)["function"]["parameters"]
        first = (params.get("required") or list(params["properties"]) or [None])[0]
        if first is None:
            return f"error: {tool.__name__} takes no argument", True
        arguments = {first: arguments[""]}
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = tool(**arguments)
        except BaseException as e:  # the tool's failure is the model's to read
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tool:{tool.__name__}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"error: {tool.__name__} timed out after {timeout:g} s", True
    if "error" in box:
        e = box["error"]
        return f"error: {tool.__name__} raised {type(e).__name__}: {e}", True
    value = box["value"]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return f"error: {tool.__name__} returned {type(value).__name__}, not text", True
    return str(value), False


class ToolEnvironment:
    """The environment of `rollout.tools`: each assistant turn that calls a tool gets the
    tool's result; a turn without a call ends the episode."""

    stop_strings = (CALL_CLOSE,)

    def __init__(self, tools: Sequence[Callable], timeout: float = 10.0):
        self.tools = {t.__name__: t for t in tools}
        self.timeout = timeout

    def reset(self, prompt: str) -> None:
        pass

    def step(self, text: str) -> Observation:
        call = parse_call(text)
        if call is None:
            return Observation(done=True)
        if isinstance(call, str):
            return Observation(f"error: {call}", called=True, error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools)
            message = f"error: no tool named {call.name!r} (tools: {known})"
            return Observation(message, called=True, error=True, name=call.name)
        result, error = run_tool(tool, call.arguments, self.timeout)
        return Observation(result, called=True, error=error, name=call.name)

    def reward(self) -> float | None:
        return None


def environment_factory(
    tools: Sequence[str | Callable], environment: str | None, timeout: float
) -> Callable[[], Environment] | None:
    """A callable making one environment per episode, or None (single-turn): the class of
    `rollout.environment`, else a ToolEnvironment over `rollout.tools`."""
    if environment:
        cls = load_object(environment, "rollout.environment")
        for method in ("reset", "step"):
            if not callable(getattr(cls, method, None)):
                raise ValueError(
                    f"rollout.environment={environment!r}: the class has no {method}() method"
                )
        return cls
    if tools:
        loaded = load_tools(tools)
        return lambda: ToolEnvironment(loaded, timeout)
    return None
