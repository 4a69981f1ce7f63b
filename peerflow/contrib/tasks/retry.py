"""`retry`: answer a task's prompt; a wrong answer is told so and may try again.

The smallest useful episode, for any task whose `Example.answer` is the expected text
(e.g. `reverse-digits`, `arithmetic`): a wrong answer's observation is the prompt again
(after `feedback`), plain text in the task's alphabet. Per-turn reward 1 for the right
answer; the outcome reward is 1 when the episode found it at its first turn, times
`turn_discount` per extra turn taken, else 0.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import Environment, StepResult, Turn
from peerflow.algorithms.base import dataset_row


@attrs.frozen(kw_only=True)
class RetryOptions:
    """`rollout.agent.options` of `retry`."""

    feedback: str = ""
    """Text sent after a wrong answer, before the prompt again (in the task's alphabet)."""
    turn_discount: float = attrs.field(default=0.5)
    """Outcome reward factor per extra turn (1 disables)."""
    step_delay_s: float = 0.0
    """Seconds each step sleeps (stands in for a slow tool; tests of time limits)."""
    broken_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Episodes of every `broken_every`-th dataset row raise in `step` (0: none; stands in
    for a sandbox that is down; tests of `rollout.agent.on_env_error`)."""


class RetryEnvironment(Environment):
    """Wrong answers get `feedback` and the prompt again; the right one ends the episode."""

    name: ClassVar[str] = "retry"
    options_class: ClassVar[type] = RetryOptions

    def __init__(self, example: Any, options: RetryOptions) -> None:
        super().__init__(example, options)
        self.solved_at: int | None = None

    def step(self, turn: Turn) -> StepResult:
        """Checks the answer; wrong ones get the feedback and the prompt again."""
        if self.options.step_delay_s:
            time.sleep(self.options.step_delay_s)
        every = self.options.broken_every
        if every and self.example.index % every == 0:
            raise ConnectionError(f"sandbox for {dataset_row(self.example)} is down")
        if turn.text.strip() == str(self.example.answer):
            self.solved_at = turn.index
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=f"{self.options.feedback}{self.example.prompt}")

    def final_reward(self) -> float:
        """1 for solving at the first turn, times `turn_discount` per extra turn; else 0."""
        if self.solved_at is None:
            return 0.0
        return float(self.options.turn_discount ** self.solved_at)
