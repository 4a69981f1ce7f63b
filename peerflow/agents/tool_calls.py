"""Parsing tool calls out of a model's turn (the Hermes / Qwen2.5 JSON format).

Open chat models (Qwen2.5-Instruct, Hermes, and many fine-tunes) write each call as

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

inside the assistant turn, possibly several in one turn, possibly after some text. A call
that is not valid JSON, is not an object with a string `name` and an object `arguments`,
or is cut off before `</tool_call>` comes back as a `ToolCall` with `error` set: the model
sees that error as the tool's answer; parsing never raises.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call the model wrote."""

    name: str = ""
    """The tool's name (empty when it could not be read)."""
    arguments: dict[str, Any] = attrs.field(factory=dict)
    """The arguments object."""
    error: str = ""
    """Why the call could not be read (empty for a well-formed call)."""
    text: str = ""
    """The call as written, between the tags."""


def _read_call(body: str, closed: bool) -> ToolCall:
    text = body.strip()
    if not closed:
        return ToolCall(text=text, error=f"the tool call is not closed with {CLOSE}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return ToolCall(text=text, error=f"the tool call is not valid JSON ({exc.msg} at "
                        f"character {exc.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(text=text, error='the tool call must be a JSON object with a string '
                        '"name" and an object "arguments"')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=value["name"], text=text,
                        error=f'"arguments" must be a JSON object, not {arguments!r:.60}')
    return ToolCall(name=value["name"], arguments=arguments, text=text)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Returns the calls in `text`, in order (empty when it has none).

    Args:
        text: The model's turn, decoded.

    Returns:
        One `ToolCall` per `<tool_call>` tag; malformed ones carry `error`.
    """
    return [_read_call(match.group(1), match.group(0).endswith(CLOSE))
            for match in CALL.finditer(text)]


def text_before_calls(text: str) -> str:
    """The part of a turn before its first tool call (the model's visible answer)."""
    return text.split(OPEN, 1)[0].strip()
