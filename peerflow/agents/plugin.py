"""Registers the agent layer's own environments and tool (a core plugin).

`tools` (`ToolEnvironment`: the run's registered tools), `agent-program` (`AgentProgram`:
an OpenAI-compatible agent program against the policy endpoint) and the `calculator`
tool are features of the agent layer, not first-party content, so the core registers
them through the same hooks a plugin uses (`peerflow.plugins.manager.CORE_PLUGINS`).
"""

from __future__ import annotations

from typing import Any

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_environments(register: Any) -> None:
    """Registers `tools` and `agent-program`."""
    from peerflow.agents.endpoint.program import AgentProgram
    from peerflow.agents.tool_env import ToolEnvironment

    register(ToolEnvironment)
    register(AgentProgram)


@hookimpl
def peerflow_register_tools(register: Any) -> None:
    """Registers the built-in `calculator`."""
    from peerflow.agents.calculator import Calculator

    register(Calculator)
