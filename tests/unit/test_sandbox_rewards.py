"""The `code` reward and the `math` reward (the sandbox itself: test_sandbox_*.py)."""

from __future__ import annotations

import json

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import load_config, validate_config
from peerflow.rewards import build_reward_set
from peerflow.rewards.code import code_reward, extract_program
from peerflow.rewards.math import math_reward


def test_extract_program_takes_the_last_fence():
    text = "try:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


def test_code_reward_counts_passed_tests():
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6\n"}]
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    assert code_reward(right, {"tests": tests}) == {"score": 1.0, "all_passed": 1.0}
    assert code_reward(half, {"answer": json.dumps(tests)}) == {"score": 0.5,
                                                                 "all_passed": 0.0}
    asserts = {"answer": "assert add(2, 2) == 4\nassert add(-1, 1) == 0"}
    assert code_reward("def add(a, b):\n    return a + b", asserts)["score"] == 1.0
    # each assert is a test: 2 * 2 == 4 holds, -1 * 1 == 0 does not
    assert code_reward("def add(a, b):\n    return a * b", asserts)["score"] == 0.5
    assert code_reward("def add(a, b):\n    return a - b - 9", asserts)["score"] == 0.0


@pytest.mark.parametrize("response, answer, expected", [
    (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
    (r"so $\boxed{2x+1}$", "1+2x", 1.0),
    (r"$\boxed{\dfrac{3}{4}}$", "0.75", 1.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    ("It is 1/2.", r"\frac12", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"first 7, finally \boxed{12}", "7", 0.0),
])
def test_math_reward_compares_final_answers(response, answer, expected):
    assert math_reward(response, {"answer": answer}) == expected


def test_math_reward_rejects_an_unparseable_reference():
    with pytest.raises(ValueError, match="does not parse"):
        math_reward(r"\boxed{1}", {"answer": " "})


def test_math_reward_through_the_pool(plugin_manager):
    config = load_config(None, ["task.reward=math"])
    validate_config(config, plugin_manager)
    rewards = build_reward_set(config.task, plugin_manager, "char_match")
    examples = [Example(prompt="half?", answer="1/2", index=0),
                Example(prompt="x?", answer="2x+1", index=1),
                Example(prompt="bad", answer=" ", index=2)]
    try:
        out = rewards.score([r"so \boxed{0.5}", r"\boxed{3x}", r"\boxed{1}"], examples)
    finally:
        rewards.close()
    assert out.total == [1.0, 0.0, 0.0] and "reward/math/mean" in out.metrics
    assert out.counts == {"reward/errors": 1, "reward/timeouts": 0}  # the unparseable answer
