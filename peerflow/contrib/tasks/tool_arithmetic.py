"""`tool-arithmetic`: multiply large numbers with the `calculator` tool (JSON tool calls).

The task asks, in a chat message, for a product a language model cannot do in its head
(`"What is 4821 * 7733?"`); the `calculator-arithmetic` environment offers the built-in
`calculator` tool in the Hermes / Qwen2.5 format (`<tool_call>{"name": "calculator",
"arguments": {"expression": "4821 * 7733"}}</tool_call>`), runs the calls in the
sandbox, and scores the model's final answer (its turn without a call): 1 when the last
number in it is the product, else 0.
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

import attrs

from peerflow.agents.calculator import Calculator
from peerflow.agents.tool_env import ToolEnvironment
from peerflow.contrib.tasks.generated import GeneratedTask

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
PROMPT = "What is {a} * {b}? Use the calculator tool, then reply with the number only."


@attrs.frozen(kw_only=True)
class ToolArithmeticOptions:
    """`task.options` of `tool-arithmetic`."""

    digits: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    """Digits of each factor."""
    train_size: int = attrs.field(default=100_000, validator=attrs.validators.gt(0))
    """Examples in one epoch of the train split."""
    eval_size: int = attrs.field(default=100, validator=attrs.validators.gt(0))
    """Examples in the eval split."""


class ToolArithmeticTask(GeneratedTask):
    """Chat prompts asking for a product of two `digits`-digit numbers."""

    name: ClassVar[str] = "tool-arithmetic"
    options_class: ClassVar[type] = ToolArithmeticOptions
    default_reward: ClassVar[str] = "contains"
    alphabet: ClassVar[str] = ""  # for a real chat model (`model.path`), no tiny builder

    def make(self, rng: random.Random) -> tuple[str, str]:
        """Returns `(question, str(product))`."""
        low, high = 10 ** (self.options.digits - 1), 10**self.options.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        return PROMPT.format(a=a, b=b), str(a * b)


def last_number(text: str) -> str:
    """The last number written in `text` (thousands separators dropped), else `""`."""
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else ""


class CalculatorArithmetic(ToolEnvironment):
    """Offers `calculator`; the answer scores 1 when its last number is the product."""

    name: ClassVar[str] = "calculator-arithmetic"
    default_tools: ClassVar[tuple[type, ...]] = (Calculator,)

    def final_reward(self) -> float:
        """1.0 when the final answer's last number equals the example's answer, else 0."""
        return float(bool(self.answer) and last_number(self.answer) == str(self.example.answer))
