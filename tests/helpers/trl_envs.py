"""TRL `environment_factory` classes for the tests, written as TRL's docs write them.

`Guess` keeps its reward in `self.reward` and the task's reward is TRL's
`reward_func(environments, **kwargs)` reading it — the pattern of TRL's OpenEnv guide
(`EchoToolEnv`) and its examples. A random model writes no tool calls, so its answer
reaches `submit` through `rollout.agent.options.answer_tool`, and the reward (shorter
answers score more) varies within a group: GRPO has something to train on.

`Broken` makes the two agent mistakes that used to end a run, by dataset row: an even row
opens with a timestamp (the `n` episodes of its group start differently), an odd row with
an opening longer than the model's context.
"""

from __future__ import annotations

import time
from typing import Any


class Guess:
    """Answer the question; the reward is set by the `submit` tool."""

    def __init__(self) -> None:
        self.reward = 0.0

    def reset(self, **kwargs: Any) -> str | None:
        self.reward = 0.0
        self.done = False
        return None

    def submit(self, answer: str) -> str:
        """Submits the final answer.

        Args:
            answer: The answer.
        """
        self.reward = 1.0 / (1.0 + len(answer.strip()))
        self.done = True
        return "submitted"


def reward_func(environments: list[Any], **kwargs: Any) -> list[float]:
    """TRL's environment reward: each instance's `reward`."""
    return [env.reward for env in environments]


class Broken(Guess):
    """Every group fails to start: a timestamp (even rows) or a too-long opening (odd)."""

    def reset(self, index: int = 0, **kwargs: Any) -> str:
        super().reset()
        if index % 2 == 0:
            return f"The time is {time.time_ns()}."
        return "Read this carefully. " * 400
