"""The tool contract: what a model may call from inside its turn.

A tool is a class with a `name`, a `description` and a JSON-schema `parameters` object
(the OpenAI / Hugging Face function format, which chat templates render into the system
prompt), and a `call(arguments)` that returns the text the model sees as the tool's
result. `ToolEnvironment` (`peerflow.agents.tool_env`) parses the model's calls
(`peerflow.agents.tool_calls`), checks the arguments against `parameters`, and runs each
call in the sandbox (`peerflow.agents.tool_runner`: a fresh subprocess, no network, time
and memory limits).

Write one like this and register it from a plugin:

    class WordCount(Tool):
        name = "word_count"
        description = "Counts the words of a text."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}},
                      "required": ["text"]}

        def call(self, arguments):
            return str(len(arguments["text"].split()))

    @hookimpl
    def peerflow_register_tools(register):
        register(WordCount)

The class is pickled into the sandbox, so it must be importable by module path there
(define it at module level of an importable module) and keep its module's imports light:
the sandbox's memory limit (`memory_mb`, default 512 MiB) applies to the whole process.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from typing import Any, ClassVar

#: Appended to the system message when a chat template does not render `tools`; the
#: Hermes wording Qwen2.5 and other open models were trained with.
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class Tool(abc.ABC):
    """A function the model can call; subclass it, set the class attributes, register it."""

    name: ClassVar[str]
    """What the model calls it by (and what `rollout.agent.options.tools` lists)."""
    description: ClassVar[str]
    """One or two sentences the model reads to decide when to call it."""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    """JSON schema of the `arguments` object; calls are checked against it before they run."""

    @abc.abstractmethod
    def call(self, arguments: dict[str, Any]) -> str:
        """Runs the tool (inside the sandbox) and returns the text the model sees.

        Args:
            arguments: The call's arguments, already checked against `parameters`.

        Returns:
            The result as text. Raise to report a failure: the model sees the exception's
            type and message as a marked error.
        """

    def schema(self) -> dict[str, Any]:
        """The function schema chat templates take (`tools=[...]`)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def argument_errors(self, arguments: dict[str, Any]) -> list[str]:
        """Returns what is wrong with `arguments` against `parameters` (empty when valid)."""
        import jsonschema

        validator = jsonschema.Draft202012Validator(self.parameters)
        return [f"{'/'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                for e in sorted(validator.iter_errors(arguments), key=str)]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template reads the `tools` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in template


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]],
                  tools: Sequence[dict[str, Any]]) -> list[int]:
    """Chat-templates the first prompt of a tool-using episode into token ids.

    The tool schemas go through the template's `tools=` argument when the template renders
    them (Qwen2.5, Llama 3.1, Hermes, Mistral templates); otherwise they are described in
    a system message in the Hermes format, so any model sees the same contract. A
    tokenizer without a chat template gets that description and a text prompt (one user
    message) joined by newlines; a chat of the environment's own needs a template
    (`encode_prompt` raises, naming the fix).

    Args:
        tokenizer: A Hugging Face tokenizer (with or without a chat template).
        messages: The episode's first messages (`{role, content}`).
        tools: Function schemas (`Tool.schema()`); empty renders the messages alone.

    Returns:
        The prompt's token ids, ending with the generation prompt.
    """
    from peerflow.rollout.prompts import encode_prompt

    messages = [dict(m) for m in messages]
    from_text = len(messages) == 1 and messages[0].get("role") == "user"
    if tools and template_renders_tools(tokenizer):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, tools=list(tools))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5: an encoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if tools:
        described = TOOLS_SYSTEM_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{described}"
        else:
            messages.insert(0, {"role": "system", "content": described})
    return encode_prompt(tokenizer, messages, join_untemplated=from_text)
