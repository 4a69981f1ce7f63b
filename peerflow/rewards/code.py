"""`code`: runs the program in an answer against the example's tests, in the sandbox.

The program is the last fenced code block of the response (```` ```python ````), else
the whole response. Tests come from the example's `tests` field, else its `answer`
(a JSON string is decoded):

* a list of `{"input": ..., "output": ...}` — the program reads `input` on stdin and
  must print `output` (compared line by line, trailing whitespace ignored); each test is
  its own `run_sandboxed` call;
* a string of Python (`assert add(1, 2) == 3`): judged on the host by
  `peerflow.rewards.assert_harness` — the sandbox runs a trusted harness that imports the
  program as a module and evaluates the expressions the asserts need; the expected values
  never enter the sandbox, values come back as plain data and are compared by type and
  value. One sandboxed run for all the asserts.

The score is the fraction of tests passed (each assert is a test); `all_passed` is
logged next to it. The programs run in the run's sandbox (`sandbox.backend`; see
`peerflow.sandbox` and the threat model in docs/rewards.md). A program the sandbox
refuses to start (`SandboxUnavailableError`: no bubblewrap, a service that is down) is
the infrastructure's fault: it raises, and is counted as a reward error, never scored as
a wrong answer. A program that runs out of time is a wrong answer: inside a reward pool
call each program's time limit ends `MARGIN_S` before the call's deadline
(`peerflow.rewards.deadline`), so the sandbox stops and cleans it up and its tests fail.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import attrs

from peerflow.rewards import deadline
from peerflow.rewards.assert_harness import (
    count_passed,
    harness_program,
    leaf_count,
    parse_asserts,
    read_values,
)
from peerflow.sandbox import SandboxLimits, run_sandboxed

FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)
#: Seconds kept between the last program's time limit and the reward call's deadline
#: (the sandbox's clean-up and the reply).
MARGIN_S = 1.5
#: Seconds the harness keeps for itself at the end of its own time limit.
HARNESS_MARGIN_S = 0.3


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, else `response` itself."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def _tests(example: dict[str, Any]) -> Any:
    tests = example.get("tests", example.get("answer"))
    if isinstance(tests, str) and tests.lstrip().startswith(("[", "{")):
        tests = json.loads(tests)
    if isinstance(tests, dict):
        tests = [tests]
    if not tests:
        raise ValueError("the example has no tests: give a `tests` (or answer) column with "
                         "[{input, output}, ...] or assert statements")
    return tests


def _same_output(actual: str, expected: Any) -> bool:
    lines = lambda text: [line.rstrip() for line in str(text).strip().splitlines()]  # noqa: E731
    return lines(actual) == lines(expected)


def fitted(limits: SandboxLimits) -> SandboxLimits | None:
    """`limits` with a time limit that ends `MARGIN_S` before the reward call's deadline.

    Returns `None` when no time is left (the remaining tests fail).
    """
    left = deadline.seconds_left()
    if left is None:
        return limits
    room = left - MARGIN_S
    if room < 0.1:
        return None
    return attrs.evolve(limits, timeout_s=min(limits.timeout_s, room))


def _check_time(limits: SandboxLimits) -> None:
    left = deadline.seconds_left()
    if left is not None and left - MARGIN_S < min(limits.timeout_s, 1.0):
        raise ValueError(f"task.reward_limits.timeout_s leaves {left:.1f} s for this answer, "
                         f"less than the {MARGIN_S:g} s the code reward keeps plus one "
                         "program's time: raise task.reward_limits.timeout_s")


def _assert_tests(program: str, tests: str, limits: SandboxLimits) -> tuple[int, int]:
    plan = parse_asserts(tests)
    run_limits = fitted(limits)
    if run_limits is None:
        return 0, len(plan.checks)
    sentinel = secrets.token_hex(16)
    seconds = max(0.1, run_limits.timeout_s - min(HARNESS_MARGIN_S, run_limits.timeout_s / 4))
    result = run_sandboxed(harness_program(program, plan, seconds), sentinel, run_limits)
    values = read_values(result.stdout, sentinel, leaf_count(plan))
    return count_passed(plan, values), len(plan.checks)


def _io_tests(program: str, tests: list[dict[str, Any]],
              limits: SandboxLimits) -> tuple[int, int]:
    passed = 0
    for case in tests:
        run_limits = fitted(limits)
        if run_limits is None:
            break
        result = run_sandboxed(program, str(case.get("input", "")), run_limits)
        passed += result.status == "ok" and _same_output(result.stdout, case["output"])
    return passed, len(tests)


def code_reward(response: str, example: dict[str, Any],
                limits: SandboxLimits | None = None) -> dict[str, float]:
    """Scores a program by the fraction of the example's tests it passes.

    Returns:
        `{"score": passed / tests, "all_passed": 0 or 1}`.

    Raises:
        ValueError: the example has no tests, or the reward call's time limit leaves no
            room for one program (`task.reward_limits.timeout_s`).
    """
    limits = limits or SandboxLimits()
    program = extract_program(response)
    tests = _tests(example)
    _check_time(limits)
    if isinstance(tests, str):
        passed, total = _assert_tests(program, tests, limits)
    else:
        passed, total = _io_tests(program, tests, limits)
    return {"score": passed / total, "all_passed": float(passed == total)}
