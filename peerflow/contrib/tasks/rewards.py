"""Rule-based rewards for verifiable tasks. Each scores in [0, 1].

Answers arrive decoded with special tokens removed; surrounding whitespace is ignored.
The reference answer is `Example.answer` (converted to `str`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from peerflow.algorithms.base import Example, RewardFunction


def _pairs(responses: Sequence[str], examples: Sequence[Example]) -> list[tuple[str, str]]:
    if len(responses) != len(examples):
        raise ValueError(
            f"reward got {len(responses)} responses for {len(examples)} examples; the reward "
            "node must pass one example per response."
        )
    return [(r.strip(), str(e.answer).strip()) for r, e in zip(responses, examples)]


def char_match(response: str, answer: str, *, strict: bool = False) -> float:
    """Fraction of the answer's characters that the response has at the same position.

    With `strict`, the fraction is over the longer of the two, so extra characters cost.
    """
    if not answer:
        return float(not response)
    matches = sum(a == b for a, b in zip(response, answer))
    return matches / (max(len(answer), len(response)) if strict else len(answer))


class CharMatchReward(RewardFunction):
    """Partial credit: the fraction of answer characters right at their position.

    "321" for "321" scores 1, "391" scores 2/3, "3215" also scores 1 (see
    `char_match_strict` to charge for extra characters).
    """

    name: ClassVar[str] = "char_match"

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns one partial-credit score per response."""
        return [char_match(r, a) for r, a in _pairs(responses, examples)]


class StrictCharMatchReward(RewardFunction):
    """Partial credit divided by the longer of answer and response ("3215" → 3/4)."""

    name: ClassVar[str] = "char_match_strict"

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns one partial-credit score per response."""
        return [char_match(r, a, strict=True) for r, a in _pairs(responses, examples)]


class ExactMatchReward(RewardFunction):
    """1 when the response equals the answer (whitespace-trimmed), else 0."""

    name: ClassVar[str] = "exact_match"

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns 1.0 or 0.0 per response."""
        return [float(r == a) for r, a in _pairs(responses, examples)]


class ContainsReward(RewardFunction):
    """1 when the answer appears anywhere in the response, else 0."""

    name: ClassVar[str] = "contains"

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns 1.0 or 0.0 per response."""
        return [float(bool(a) and a in r) for r, a in _pairs(responses, examples)]


class FunctionBackedReward(RewardFunction):
    """A registered reward whose work is a function run in the reward pool.

    `function` (`module:function`) is what a run calls — in a worker process under
    `task.reward_limits`; `score` calls it in this process (for direct use).
    """

    function: ClassVar[str]

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Calls `function` on every response here, without the pool's limits."""
        from peerflow.rewards.loading import load_function, parse_target
        from peerflow.rewards.pool import to_outcome
        from peerflow.rewards.scoring import example_record

        target = parse_target(self.function)
        assert target is not None
        fn = load_function(target)
        return [to_outcome(fn(r, example_record(e)), self.name).score
                for r, e in zip(responses, examples)]


class MathReward(FunctionBackedReward):
    """1 when the final answer equals the reference (boxed, fractions, expressions).

    Uses `math-verify`; see `peerflow.rewards.math`.
    """

    name: ClassVar[str] = "math"
    function: ClassVar[str] = "peerflow.rewards.math:math_reward"


class CodeReward(FunctionBackedReward):
    """Fraction of the example's tests the answer's program passes, run sandboxed.

    See `peerflow.rewards.code` (tests format) and `peerflow.sandbox` (isolation).
    """

    name: ClassVar[str] = "code"
    runs_model_code: ClassVar[bool] = True
    function: ClassVar[str] = "peerflow.rewards.code:code_reward"
