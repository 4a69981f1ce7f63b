"""Tools: the call parser, the calculator, sandboxed execution, concurrency, ToolEnvironment."""

from __future__ import annotations

import json
import socket

import pytest

from peerflow.agents.calculator import Calculator, calculate
from peerflow.agents.environment import Turn
from peerflow.agents.tool_calls import parse_tool_calls
from peerflow.agents.tool_env import ToolEnvironment, ToolError, ToolOptions
from peerflow.agents.tool_runner import run_tool, run_tools
from peerflow.agents.tools import render_prompt
from peerflow.algorithms.base import Example
from peerflow.sandbox import SandboxLimits
from tests.helpers.agent_tools import Chatty, Dial, Hog, Hold, Raises

LIMITS = SandboxLimits(timeout_s=30.0, memory_mb=512)


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# --- the parser ---------------------------------------------------------------------------

def test_parser_reads_calls_in_order_after_text():
    text = "Let me compute.\n" + _call("calculator", expression="2*3") + "\n" + _call(
        "search", query="x", k=2)
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, ""), ("search", {"query": "x", "k": 2}, "")]
    assert parse_tool_calls("The answer is 6.") == []


def test_parser_accepts_arguments_written_as_a_json_string():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}' \
           "</tool_call>"
    (call,) = parse_tool_calls(text)
    assert call.arguments == {"expression": "1+1"} and not call.error


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ("calculator(1+1)", "not valid JSON"),
    ('["calculator"]', 'string "name"'),
    ('{"arguments": {}}', 'string "name"'),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
])
def test_parser_marks_malformed_calls_without_raising(body, error):
    good = _call("calculator", expression="1")
    calls = parse_tool_calls(f"<tool_call>{body}</tool_call> then {good}")
    assert error in calls[0].error and calls[0].text == body.strip()
    assert calls[1].name == "calculator" and not calls[1].error


def test_parser_marks_a_call_cut_off_before_its_closing_tag():
    (call,) = parse_tool_calls('<tool_call>{"name": "calculator", "argu')
    assert "not closed" in call.error


# --- the calculator -----------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("4821 * 7733", "37280793"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"), ("-7 // 2", "-4"),
    ("2 ** 10 % 1000", "24"), ("1 / 3", "0.333333333333"), ("+-+3", "-3"), ("6.0 / 2", "3"),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "not arithmetic"), ("x + 1", "not arithmetic"),
    ("(1).real", "not arithmetic"), ("[1, 2]", "not arithmetic"), ("9 ** 9 ** 9", "exponent"),
    ("10 ** 999", "too large"), ("1 / 0", "division by zero"), ("(-8) ** 0.5", "real number"),
    ("2 +", "cannot parse"), ("1" * 600, "longer than"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calculate(expression)


# --- sandboxed execution ------------------------------------------------------------------

def test_a_tool_runs_in_the_sandbox_and_its_prints_stay_out_of_the_result():
    assert run_tool(Calculator(), {"expression": "6*7"}, LIMITS).content == "42"
    result = run_tool(Chatty(), {}, LIMITS)
    assert (result.status, result.content) == ("ok", "result")


def test_a_tool_that_raises_returns_a_marked_error():
    result = run_tool(Raises(), {}, LIMITS)
    assert result.status == "error" and result.content == "KeyError: 'no such record'"


def test_a_tool_past_its_time_limit_is_killed_and_marked():
    result = run_tool(Hold(), {"seconds": 60}, SandboxLimits(timeout_s=3.0))
    assert result.status == "timeout" and "timed out after 3 s" in result.content


def test_a_tool_over_its_memory_limit_fails_with_memory_error():
    result = run_tool(Hog(), {}, SandboxLimits(timeout_s=30.0, memory_mb=256))
    assert result.status == "error" and "MemoryError" in result.content
    assert "256 MiB" in result.content


def test_a_tool_cannot_reach_a_server_on_this_machine():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    try:
        result = run_tool(Dial(), {"port": server.getsockname()[1]}, LIMITS)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.status == "error" and "connected" not in result.content


def test_slow_tools_run_at_the_same_time():
    count = 4
    results = run_tools([(Hold(), {"seconds": 4})] * count, SandboxLimits(timeout_s=60.0))
    assert [r.status for r in results] == ["ok"] * count
    spans = [tuple(map(float, r.content.split(","))) for r in results]
    most_at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert most_at_once == count


# --- ToolEnvironment ----------------------------------------------------------------------

def _environment(**options) -> ToolEnvironment:
    example = Example(prompt="What is 6 * 7?", answer="42")
    return ToolEnvironment(example, ToolOptions(tools=("calculator",), **options))


def _turn(text: str, index: int = 0) -> Turn:
    return Turn(token_ids=[1, 2], text=text, index=index)


def test_tool_environment_answers_calls_with_tool_messages(plugin_manager):
    env = _environment(system_prompt="Use tools.")
    assert env.initial_prompt() == [{"role": "system", "content": "Use tools."},
                                    {"role": "user", "content": "What is 6 * 7?"}]
    assert env.tool_schemas()[0]["function"]["name"] == "calculator"
    result = env.step(_turn(_call("calculator", expression="6*7") + _call(
        "calculator", expression="6/0")))
    assert not result.done
    assert result.observation == [{"role": "tool", "content": "42"},
                                  {"role": "tool", "content": "Error: ValueError: division "
                                                              "by zero"}]
    assert result.info["tool_calls"] == 2 and result.info["tool_errors"] == 1
    final = env.step(_turn("It is 42.", index=1))
    assert final.done and env.answer == "It is 42."


def test_tool_environment_reports_bad_calls_to_the_model(plugin_manager):
    env = _environment(max_calls_per_turn=3)
    text = ("<tool_call>{oops}</tool_call>" + _call("search", q="x")
            + _call("calculator", formula="1") + _call("calculator", expression="1"))
    contents = [m["content"] for m in env.step(_turn(text)).observation]
    assert "not valid JSON" in contents[0]
    assert "no tool 'search'" in contents[1] and "['calculator']" in contents[1]
    assert "bad arguments" in contents[2] and "'expression' is a required" in contents[2]
    assert "at most 3 tool calls" in contents[3]
    assert all(c.startswith("Error: ") for c in contents)


def test_tool_environment_can_end_the_trajectory_on_a_failed_call(plugin_manager):
    env = _environment(end_on_error=True, timeout_s=30.0)
    with pytest.raises(ToolError, match="calculator: error: ValueError: division by zero"):
        env.step(_turn(_call("calculator", expression="1/0")))


def test_a_call_that_cannot_run_ends_the_episode_as_the_models_doing(plugin_manager):
    """With end_on_error, a bad call is the model's failure (scored), not the environment's."""
    env = _environment(end_on_error=True, timeout_s=30.0)
    result = env.step(_turn(_call("calculator", formula="1") + _call("calculator",
                                                                     expression="2+2")))
    assert result.done and result.observation == ""
    assert result.info["tool_calls"] == 2 and result.info["tool_errors"] == 1
    assert "bad arguments" in result.info["error"]
    assert env.answer == "" and [r.status for r in env.results] == ["error", "ok"]


def test_unknown_tool_names_are_refused_with_the_registered_ones(plugin_manager):
    from peerflow.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match="calculater.*Did you mean 'calculator'"):
        ToolOptions(tools=("calculater",))


def test_first_prompt_carries_the_tool_schemas_with_and_without_template_support():
    from peerflow.contrib.tasks.tokenizer import train_char_tokenizer
    from tests.helpers.chat_model import build_chat_tokenizer

    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    schema = Calculator().schema()
    chat = build_chat_tokenizer()
    text = chat.decode(render_prompt(chat, messages, [schema]))
    assert text.startswith("<|im_start|>system") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = train_char_tokenizer(["".join(map(chr, range(32, 127))) + "\n"])
    text = plain.decode(render_prompt(plain, messages, [schema]))
    assert "<tools>" in text and '"name": "calculator"' in text and "<tool_call>" in text
    assert text.endswith("What is 6 * 7?")
    plain.chat_template = None
    text = plain.decode(render_prompt(plain, messages, [schema]))
    assert "<tools>" in text and text.endswith("\nWhat is 6 * 7?")
