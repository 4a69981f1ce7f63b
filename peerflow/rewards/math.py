r"""`math`: 1 when the response's final answer equals the reference, else 0.

Equivalence is decided by Hugging Face's `math-verify` (boxed answers, fractions,
decimals, percentages, sets, intervals, symbolic expressions via sympy): the answer is
extracted from the response (the last `\boxed{}` first, then LaTeX or plain
expressions), the reference is parsed the same way (wrapped in `$…$` when it is bare),
and the two are compared.
"""

from __future__ import annotations

from typing import Any


def _gold(answer: Any) -> str:
    text = str(answer).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def math_reward(response: str, example: dict[str, Any]) -> float:
    """Returns 1.0 when `response`'s final answer equals `example["answer"]`, else 0.0."""
    from math_verify import parse, verify

    gold = parse(_gold(example["answer"]))
    if not gold:
        raise ValueError(f"math reward: the reference answer {example['answer']!r} does not "
                         "parse as a number or expression; fix the dataset's answer column")
    return float(verify(gold, parse(response)))
