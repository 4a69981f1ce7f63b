"""`guess-number`: find a secret digit from higher/lower feedback (the CPU agent example).

The task's prompt is `"?"`; its answer is the secret digit (0–9). The environment of the
same name answers each guess with one character — `<` (the secret is lower), `>` (the
secret is higher), or `?` (the turn was not a digit) — and ends the episode when the
digit is found or `max_guesses` guesses are spent. A trajectory reads, token by token,

    <s> ?  5  <  2  >  3          (secret 3: found on the third guess)

Outcome reward: `1 - turn_penalty * (guesses - 1)` when found, else 0 — in [0, 1]. A
policy that ignores the feedback can at best try `max_guesses` different digits
(expected reward ≤ 0.4 with 4 guesses out of 10); binary search on the feedback always
finds the digit within 4 guesses (≈ 0.8 with the default penalty), so the model has to
read the observations to score well. A randomly initialised tiny model starts near 0.2
(most of its guesses are repeats or not digits).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import Environment, StepResult, Turn
from peerflow.contrib.tasks.generated import GeneratedTask

DIGITS = "0123456789"
LOWER, HIGHER, INVALID = "<", ">", "?"


@attrs.frozen(kw_only=True)
class GuessNumberTaskOptions:
    """`task.options` of `guess-number`."""

    train_size: int = attrs.field(default=100_000, validator=attrs.validators.gt(0))
    """Examples in one epoch of the train split."""
    eval_size: int = attrs.field(default=100, validator=attrs.validators.gt(0))
    """Examples in the eval split."""


class GuessNumberTask(GeneratedTask):
    """Prompts `"?"` whose answers are secret digits.

    Pair it with the `guess-number` environment (`rollout.agent.environment: guess-number`).
    """

    name: ClassVar[str] = "guess-number"
    options_class: ClassVar[type] = GuessNumberTaskOptions
    default_reward: ClassVar[str] = "exact_match"
    alphabet: ClassVar[str] = DIGITS + LOWER + HIGHER + INVALID

    def make(self, rng: random.Random) -> tuple[str, str]:
        """Returns `("?", secret digit)`."""
        return INVALID, rng.choice(DIGITS)


@attrs.frozen(kw_only=True)
class GuessNumberOptions:
    """`rollout.agent.options` of the `guess-number` environment."""

    max_guesses: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    """Guesses before the episode ends unfound (reward 0)."""
    turn_penalty: float = attrs.field(default=0.1)
    """Reward lost per guess after the first (the reward never goes below 0)."""

    @turn_penalty.validator
    def _check_penalty(self, attribute: attrs.Attribute, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"rollout.agent.options.turn_penalty must be in [0, 1], got {value}.")


class GuessNumber(Environment):
    """Answers each guessed digit with `<`, `>` or `?` until it is found."""

    name: ClassVar[str] = "guess-number"
    options_class: ClassVar[type] = GuessNumberOptions

    def __init__(self, example: Any, options: GuessNumberOptions) -> None:
        super().__init__(example, options)
        self.secret = str(example.answer)
        if len(self.secret) != 1 or self.secret not in DIGITS:
            raise ValueError(f"guess-number: the example's answer must be one digit, got "
                             f"{example.answer!r}; use `task.name: guess-number`.")
        self.guesses = 0
        self.found = False

    def step(self, turn: Turn) -> StepResult:
        """Scores one guess (the turn's first character)."""
        self.guesses += 1
        guess = turn.text.strip()[:1]
        self.found = guess == self.secret
        done = self.found or self.guesses >= self.options.max_guesses
        if done:
            return StepResult(done=True, info={"guesses": self.guesses,
                                               "found": float(self.found)})
        if guess in DIGITS:
            feedback = LOWER if self.secret < guess else HIGHER
        else:
            feedback = INVALID
        return StepResult(observation=feedback)

    def final_reward(self) -> float:
        """`1 - turn_penalty * (guesses - 1)` when found, else 0."""
        if not self.found:
            return 0.0
        return max(0.0, 1.0 - self.options.turn_penalty * (self.guesses - 1))
