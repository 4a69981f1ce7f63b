"""Environments for the OpenEnv and TRL-style adapters' tests (`tests/unit/test_openenv.py`).

`MultiplyEnv` is an OpenEnv MCP environment the run serves on loopback: two tools,
`multiply(a, b)` and `submit(answer)`; a wrong answer gets "wrong" and the episode goes on
(at most `TRIES` answers), the right one reward 1 and `done`. `MultiplyGame` is the same
game as a TRL `environment_factory` class; `EchoEnv` a non-MCP environment whose action is
text.
"""

from __future__ import annotations

from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

TRIES = 3


class MultiplyEnv(MCPEnvironment):
    """Multiply two numbers, with a multiplication tool; submit the product."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("multiply")
        self.target, self.tries, self.reward = "", 0, None

        @mcp.tool
        def multiply(a: int, b: int) -> int:
            """Multiplies two integers."""
            return a * b

        @mcp.tool
        def submit(answer: str) -> str:
            """Submits the final answer."""
            self.tries += 1
            right = answer.strip() == self.target
            self.reward = 1.0 if right else (0.0 if self.tries >= TRIES else None)
            return "right" if right else f"wrong, {TRIES - self.tries} tries left"

        super().__init__(mcp)
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: Any = None, episode_id: Any = None, answer: str = "",
              **kwargs: Any) -> Observation:
        self.target, self.tries, self.reward = str(answer), 0, None
        self._state = State(episode_id=str(episode_id or ""), step_count=0)
        return Observation(done=False, reward=None)

    async def step_async(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
        self.reward = None
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if self.reward is not None:
            observation.reward, observation.done = self.reward, True
        return observation

    def _step_impl(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "use the tools"})

    @property
    def state(self) -> State:
        return self._state


class MultiplyGame:
    """The same game as a TRL `environment_factory` class (one instance per trajectory)."""

    def reset(self, answer: str = "", **kwargs: Any) -> str:
        self.target, self.tries, self.right, self.done = str(answer), 0, False, False
        return f"You have {TRIES} tries."

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    def submit(self, answer: str) -> str:
        """Submits the final answer.

        Args:
            answer: The product.
        """
        self.tries += 1
        self.right = self.right or answer.strip() == self.target
        self.done = self.right or self.tries >= TRIES
        return "right" if self.right else f"wrong, {TRIES - self.tries} tries left"

    def helper(self, x: int) -> int:  # no docstring: not a tool
        return x

    def get_reward(self) -> float:
        return 1.0 if self.right else 0.0


class ShapedMultiplyEnv(MultiplyEnv):
    """`MultiplyEnv` whose lost games score by the last answer's length (shorter: more, up
    to 0.5), so a random model's groups differ and GRPO has something to train on."""

    async def step_async(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if observation.done and observation.reward == 0.0:
            answer = str(getattr(action, "arguments", {}).get("answer", ""))
            observation.reward = 0.5 / (1 + len(answer))
        return observation


class EchoAction(Action):
    """A text action."""

    message: str


class EchoObservation(Observation):
    """What `EchoEnv` answers."""

    echoed: str = ""


class EchoEnv(Environment):
    """A non-MCP environment: echoes each message upper-cased; reward 1 on "stop"."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, prompt: str = "", **kwargs: Any) -> EchoObservation:
        return EchoObservation(echoed=f"ready: {prompt}", done=False, reward=None)

    def step(self, action: EchoAction, timeout_s: Any = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        done = action.message.strip() == "stop"
        return EchoObservation(echoed=action.message.upper(), done=done,
                               reward=1.0 if done else 0.25)

    @property
    def state(self) -> State:
        return self._state
