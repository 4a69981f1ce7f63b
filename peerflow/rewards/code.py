"""`code`: runs the program in an answer against the example's tests, in the sandbox.

The program is the last fenced code block of the response (```` ```python ````), else
the whole response. Tests come from the example's `tests` field, else its `answer`
(a JSON string is decoded):

* a list of `{"input": ..., "output": ...}` — the program reads `input` on stdin and
  must print `output` (compared line by line, trailing whitespace ignored);
* a string of Python (`assert add(1, 2) == 3`) run after the program.

The score is the fraction of tests passed; `all_passed` is logged next to it. Each test
runs in its own `run_sandboxed` call, in the run's sandbox (`sandbox.backend`; see
`peerflow.sandbox` and the threat model in docs/rewards.md). A program the sandbox
refuses to start (`SandboxUnavailableError`: no bubblewrap, a service that is down) is
the infrastructure's fault: it raises, and is counted as a reward error, never scored as
a wrong answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from peerflow.sandbox import SandboxLimits, run_sandboxed

FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)


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


def code_reward(response: str, example: dict[str, Any],
                limits: SandboxLimits | None = None) -> dict[str, float]:
    """Scores a program by the fraction of the example's tests it passes.

    Returns:
        `{"score": passed / tests, "all_passed": 0 or 1}`.
    """
    program = extract_program(response)
    tests = _tests(example)
    if isinstance(tests, str):
        result = run_sandboxed(program + "\n\n" + tests + "\n", "", limits)
        passed, total = int(result.status == "ok"), 1
    else:
        total = len(tests)
        passed = 0
        for case in tests:
            result = run_sandboxed(program, str(case.get("input", "")), limits)
            passed += result.status == "ok" and _same_output(result.stdout, case["output"])
    return {"score": passed / total, "all_passed": float(passed == total)}
