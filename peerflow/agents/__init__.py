"""Multi-turn agent rollouts: environments, tools, and the token-in/token-out driver.

Names are imported on first use (PEP 562): a sandboxed tool process imports
`peerflow.agents.calculator` without pulling in torch through the environment contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Environment": "peerflow.agents.environment",
    "StepResult": "peerflow.agents.environment",
    "Turn": "peerflow.agents.environment",
    "TurnSettings": "peerflow.agents.environment",
    "Tool": "peerflow.agents.tools",
    "ToolEnvironment": "peerflow.agents.tool_env",
}

__all__ = ["Environment", "StepResult", "Tool", "ToolEnvironment", "Turn", "TurnSettings"]

if TYPE_CHECKING:
    from peerflow.agents.environment import Environment, StepResult, Turn, TurnSettings
    from peerflow.agents.tool_env import ToolEnvironment
    from peerflow.agents.tools import Tool


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peerflow.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
