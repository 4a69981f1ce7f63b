"""`ToolEnvironment`: an environment whose observations are the results of tool calls.

Each model turn is parsed for `<tool_call>` JSON calls (`peerflow.agents.tool_calls`);
the calls are checked against their tool's schema and run in the sandbox, all at once
(`peerflow.agents.tool_runner`); their results come back as one `tool` message each,
which the driver appends as the next observation. A turn without a call is the model's
answer and ends the episode; `final_reward` scores it (subclasses override it; the base
defers to the task's reward).

A malformed call, an unknown tool, bad arguments, a tool that raises, runs out of memory
or time: the model sees a message starting with `Error:` (the call is marked in
`info["tool_errors"]`), and the episode goes on. With `end_on_error: true` a failed call
ends the episode instead, and who failed decides how: a call that never ran — malformed,
an unknown tool, bad arguments, over `max_calls_per_turn` — is the model's doing, so the
episode is simply over (`done`, `finish_reason` `stop`) and scored as it stands; a call
that ran and failed (raised, died, timed out) may be the tool's or the sandbox's fault,
so `step` raises `ToolError` and the driver ends the trajectory with `finish_reason`
`env_error`, which training leaves out by default (`rollout.agent.on_env_error`).

Select it with `rollout.agent.environment: tools` and list the registered tools in
`rollout.agent.options.tools`; or subclass it with `default_tools` for a task of your own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import Environment, Messages, StepResult, Turn
from peerflow.agents.tool_calls import ToolCall, parse_tool_calls
from peerflow.agents.tool_runner import ToolResult, run_tools
from peerflow.agents.tools import Tool
from peerflow.sandbox import SandboxLimits


def _registered_tools(names: tuple[str, ...]) -> list[type[Tool]]:
    from peerflow.plugins.manager import get_plugin_manager

    registry = get_plugin_manager().registry("tool")
    return [registry.get(name) for name in names]


def _check_tool_names(instance: Any, attribute: attrs.Attribute, names: tuple[str, ...]) -> None:
    _registered_tools(names)  # raises UnknownNameError listing the registered tools


def prompt_messages(prompt: str | Messages, system_prompt: str) -> Messages:
    """An example's prompt as chat messages, after `system_prompt` when set."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        dict(m) for m in prompt]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def tool_message(content: str, failed: bool, limit: int) -> dict[str, str]:
    """A call's result as a `tool` message: `Error: ` before a failure, cut at `limit`."""
    text = f"Error: {content}" if failed else content
    if len(text) > limit:
        text = text[:limit] + f" … [cut at {limit} characters]"
    return {"role": "tool", "content": text}


@attrs.frozen(kw_only=True)
class ToolOptions:
    """`rollout.agent.options` of a tool environment."""

    tools: tuple[str, ...] = attrs.field(default=(), converter=tuple,
                                         validator=_check_tool_names)
    """Registered tools offered to the model, added to the class's `default_tools`."""
    system_prompt: str = ""
    """A system message put before the example's prompt (empty: none)."""
    timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    """Wall-clock limit of one tool call (its process is killed past it)."""
    memory_mb: int = attrs.field(default=512, validator=attrs.validators.gt(0))
    """Address-space limit of one tool call's process."""
    max_calls_per_turn: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    """Calls run per turn; further calls get an error result."""
    max_result_chars: int = attrs.field(default=2000, validator=attrs.validators.gt(0))
    """A result longer than this is cut (and says so)."""
    end_on_error: bool = False
    """End the trajectory when a call fails, instead of showing the model the error: as
    the model's doing (`stop`) when the call could not run, as an environment failure
    (`env_error`) when it ran and failed."""


class ToolError(RuntimeError):
    """A call ran and failed under `end_on_error`: the trajectory ends with `env_error`."""


class ToolEnvironment(Environment):
    """Runs the model's tool calls in the sandbox and answers with their results."""

    name: ClassVar[str] = "tools"
    options_class: ClassVar[type] = ToolOptions
    runs_model_code: ClassVar[bool] = True
    default_tools: ClassVar[tuple[type[Tool], ...]] = ()
    """Tools every episode of this class offers (subclasses set it)."""

    def __init__(self, example: Any, options: ToolOptions) -> None:
        super().__init__(example, options)
        classes = [*self.default_tools, *_registered_tools(options.tools)]
        self.tools: dict[str, Tool] = {cls.name: cls() for cls in classes}
        self.limits = SandboxLimits(timeout_s=options.timeout_s, memory_mb=options.memory_mb)
        self.answer = ""
        """The text of the turn that made no call (the model's answer), once it came."""
        self.results: list[ToolResult] = []
        """Every call's result so far, in order."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The function schemas of this episode's tools."""
        return [tool.schema() for tool in self.tools.values()]

    def initial_prompt(self) -> str | Messages:
        """The example's prompt as chat messages, after `system_prompt` when set."""
        return prompt_messages(self.example.prompt, self.options.system_prompt)

    def step(self, turn: Turn) -> StepResult:
        """Runs the turn's calls; a turn without a call is the answer and ends the episode.

        With `end_on_error`, a call that could not run (the model's doing) ends the episode
        (`done`); one that ran and failed raises.

        Raises:
            ToolError: a call ran and failed and `end_on_error` is set.
        """
        calls = parse_tool_calls(turn.text)
        if not calls:
            self.answer = turn.text
            return StepResult(done=True, info={"tool_calls": 0})
        problems = [self._problem(call, index) for index, call in enumerate(calls)]
        results = self._run(calls, problems)
        self.results.extend(results)
        failed = [r for r in results if r.failed]
        info: dict[str, Any] = {"tool_calls": len(calls), "tool_errors": len(failed),
                                "tool_timeouts": sum(r.status == "timeout" for r in failed)}
        if failed:
            info["error"] = failed[0].content
        if failed and self.options.end_on_error:
            if any(problems):
                return StepResult(done=True, info=info)
            raise ToolError("; ".join(f"{r.name}: {r.status}: {r.content}" for r in failed))
        return StepResult(observation=[self._message(r) for r in results], info=info)

    def _run(self, calls: list[ToolCall], problems: list[str]) -> list[ToolResult]:
        """Runs the calls without a problem; the others get their problem as an error."""
        runnable = [(self.tools[c.name], c.arguments) for c, p in zip(calls, problems) if not p]
        results = iter(run_tools(runnable, self.limits))
        return [ToolResult(name=call.name, status="error", content=problem) if problem
                else next(results) for call, problem in zip(calls, problems)]

    def _problem(self, call: ToolCall, index: int) -> str:
        if call.error:
            return call.error
        if index >= self.options.max_calls_per_turn:
            return f"at most {self.options.max_calls_per_turn} tool calls run per turn"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"there is no tool {call.name!r}; the tools are {sorted(self.tools)}"
        errors = tool.argument_errors(call.arguments)
        return f"bad arguments for {call.name!r}: " + "; ".join(errors) if errors else ""

    def _message(self, result: ToolResult) -> dict[str, str]:
        return tool_message(result.content, result.failed, self.options.max_result_chars)
