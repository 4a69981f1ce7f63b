"""The `code` reward cannot be forged, and a program out of time is a wrong answer (issue 49).

Scored through the reward pool a training run builds from examples/code_reward.yaml
(`load_config` -> `validate_config` -> `build_reward_set`), under bubblewrap as this
process's user (root in CI).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import load_config, validate_config
from peerflow.rewards import RewardPool, build_reward_set, deadline
from peerflow.rewards.assert_checks import decode, same
from peerflow.rewards.assert_harness import parse_asserts, read_values
from peerflow.rewards.code import code_reward
from peerflow.rewards.forgeries import (
    AUDIT_HOOK_MISSES,
    FIB,
    FIB_RIGHT,
    FIB_WRONG,
    FORGERIES,
    score_forgeries,
)
from peerflow.sandbox import configure
from peerflow.sandbox.bubblewrap import bwrap_unavailable
from peerflow.sandbox.config import SandboxConfig
from peerflow.sandbox.local import own_cgroup

ROOT = Path(__file__).resolve().parents[2]
CODE_REWARD = str(ROOT / "examples" / "code_reward.yaml")
ROWS = [json.loads(line) for line in (ROOT / "examples/data/code_tasks.jsonl").open()]
#: Where the sandbox makes its per-program cgroups (pids, memory; v1 or v2).
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory", "/sys/fs/cgroup")
needs_bwrap = pytest.mark.skipif(bwrap_unavailable() is not None, reason=f"{bwrap_unavailable()}")


@pytest.fixture
def code_rewards(plugin_manager, monkeypatch):
    """`score(answers, tests, *overrides)`: the run's reward set, scored once, then closed."""
    monkeypatch.setenv("PEERFLOW_SANDBOX", "")  # restored after the test
    configure(SandboxConfig(backend="bubblewrap"))

    def score(answers: list[str], tests: list, *overrides: str):
        config = load_config(CODE_REWARD, list(overrides))
        validate_config(config, plugin_manager)
        rewards = build_reward_set(config.task, plugin_manager, "code")
        examples = [Example(prompt="p", answer=t, index=i) for i, t in enumerate(tests)]
        try:
            return rewards.score(answers, examples)
        finally:
            rewards.close()
    return score


def _sandbox_leftovers() -> set[str]:
    found = set()
    for root in (tempfile.gettempdir(), *CGROUP_ROOTS, *map(own_cgroup, CGROUP_ROOTS)):
        if os.path.isdir(root):
            found |= {os.path.join(root, n) for n in os.listdir(root)
                      if n.startswith("peerflow-sandbox-")}
    return found


def _assert_nothing_leaked(before: set[str]) -> None:
    """No sandbox directory or cgroup made since `before` is left (others' runs finish)."""
    for _ in range(150):  # other tests on the machine may be running programs right now
        left = _sandbox_leftovers() - before
        if not left:
            return
        time.sleep(0.1)
    assert not left, f"left behind: {sorted(left)}"


@needs_bwrap
def test_every_forgery_scores_zero_through_the_run_s_reward_pool(code_rewards):
    seen = {}

    def score(answers, examples):
        out = code_rewards(answers, [e["tests"] for e in examples])
        seen.update(out.counts)
        return out.total

    scores = score_forgeries(score)
    assert scores == {"right": 1.0, "wrong": 0.0, **dict.fromkeys(FORGERIES, 0.0)}
    assert seen == {"reward/errors": 0, "reward/timeouts": 0}  # wrong answers, not faults


def test_the_audit_hook_fallback_holds_every_forgery_but_those_it_names(monkeypatch):
    """The fallback shows the program the whole file system; nothing else gets through."""
    monkeypatch.setenv("PEERFLOW_SANDBOX", "")
    configure(SandboxConfig(backend="audit-hook"))
    scores = score_forgeries(lambda answers, examples: [
        code_reward(a, e)["score"] for a, e in zip(answers, examples)])
    assert AUDIT_HOOK_MISSES <= set(FORGERIES)
    assert {k: v for k, v in scores.items() if k not in AUDIT_HOOK_MISSES} == {
        "right": 1.0, "wrong": 0.0,
        **{name: 0.0 for name in FORGERIES if name not in AUDIT_HOOK_MISSES}}


@needs_bwrap
def test_reference_answers_of_the_example_dataset_still_score_one(code_rewards):
    out = code_rewards([f"```python\n{row['solution']}\n```" for row in ROWS],
                       [row["tests"] for row in ROWS])
    assert sum(isinstance(row["tests"], str) for row in ROWS) == 3
    assert out.total == [1.0] * len(ROWS)


@needs_bwrap
def test_a_program_outliving_the_reward_timeout_is_cleaned_and_scores_zero(code_rewards):
    before = _sandbox_leftovers()
    forever = "```python\nwhile True:\n    pass\n```"
    io_row = next(row for row in ROWS if not isinstance(row["tests"], str))
    start = time.monotonic()
    out = code_rewards([forever, forever], [FIB["tests"], io_row["tests"]],
                       "task.reward_limits.timeout_s=4")
    assert time.monotonic() - start < 15
    assert out.total == [0.0, 0.0]
    assert out.counts == {"reward/errors": 0, "reward/timeouts": 0}  # a wrong answer
    _assert_nothing_leaked(before)


@needs_bwrap
def test_a_reward_stopped_by_the_pool_cleans_its_program_up(tmp_path):
    """A reward of one's own that runs a program past the pool's deadline: still cleaned."""
    (tmp_path / "slow.py").write_text(
        "from peerflow.sandbox import SandboxLimits, run_sandboxed\n"
        "def slow(response, example):\n"
        "    run_sandboxed('import time\\ntime.sleep(60)', '', SandboxLimits(timeout_s=60))\n"
        "    return 1.0\n")
    before = _sandbox_leftovers()
    pool = RewardPool(workers=1, timeout_s=2, memory_mb=0)
    try:
        future = pool.submit(f"{tmp_path / 'slow.py'}:slow", None, ["x"], [{}])
        (outcome,) = pool.outcomes(future, 1)
    finally:
        pool.close()
    assert outcome.status == "timeout"  # the reward itself overran: the pool's timeout
    _assert_nothing_leaked(before)


def test_the_host_decides_by_type_and_value_and_keeps_expected_values():
    plan = parse_asserts("import math\nassert f(1) == 55\nassert not g(2) and 0 < h(3) <= 9\n"
                         "assert sorted(k(4)) == [1, 2]\nassert abs(m(5) - 1.5) < 1e-9")
    sent = json.dumps(plan.steps)
    assert "55" not in sent and "1.5" not in sent and "1e-09" not in sent
    assert [s for k, s in plan.steps if k == "eval"] == ["f(1)", "g(2)", "h(3)", "k(4)",
                                                         "m(5)"]
    lines = lambda values: "\n".join(  # noqa: E731
        ["S " + repr(("import", True))] +
        [f"S {('value', i, v)!r}" for i, v in enumerate(values)])
    right = read_values(lines(["55", "False", "3", "[2, 1]", "1.5"]), "S")
    assert sum(c.passes(right) for c in plan.checks) == 4
    typed = read_values(lines(["55.0", "0", "'3'", "(2, 1)", "A()"]), "S")
    assert [c.passes(typed) for c in plan.checks] == [False, False, True, False]
    assert read_values(lines(["55"]).replace("S ", "X "), "S") is None  # no sentinel
    assert same({"a": [1, (2,)]}, {"a": [1, (2,)]}) and not same([1], [True])
    assert decode("[frozenset({1}), -inf]") == [frozenset({1}), float("-inf")]
    for not_data in ("A()", "__import__('os')", "[1, x]"):
        with pytest.raises(ValueError):
            decode(not_data)


@needs_bwrap
def test_humaneval_s_check_function_is_judged_assert_by_assert():
    tests = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n"
             "    assert candidate(0) == 0\n    assert candidate(10) == 55\n\ncheck(fib)\n")
    plan = parse_asserts(tests)
    assert [c.source for c in plan.checks] == ["assert fib(0) == 0", "assert fib(10) == 55"]
    assert code_reward(f"```python\n{FIB_RIGHT}\n```", {"tests": tests})["score"] == 1.0
    assert code_reward("def fib(n):\n    return 0", {"tests": tests})["score"] == 0.5


def test_a_reward_timeout_too_short_for_one_program_is_an_error_naming_the_setting():
    deadline.start(2.0)
    try:
        with pytest.raises(ValueError, match="raise task.reward_limits.timeout_s"):
            code_reward(FIB_RIGHT, dict(FIB))
    finally:
        deadline.start(None)


def test_tests_without_an_assert_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="hold no `assert`"):
        code_reward("x = 1", {"tests": "x = 1"})
    with pytest.raises(ValueError, match="not valid Python"):
        code_reward("x = 1", {"tests": "assert ("})
    with pytest.raises(ValueError, match="assert inside a block .* top-level `assert"):
        parse_asserts("for i in range(3):\n    assert fib(i) >= 0")


#: A wrong `fib` that floods the host's decoder: ints that share one hash (Python hashes
#: ints modulo 2**61 - 1), as a bare set on a sentinel line (33,000) and as the value of
#: leaves the tests do not have (9,000 each). Building their sets cost the host seconds.
HASH_FLOOD = FIB_WRONG + """
import sys
h = sys.modules["__main__"]
M = 2**61 - 1
h.out.write(h.SENTINEL + " {" + ",".join(str(5 + k * M) for k in range(1, 33000)) + "}\\n")
value = "{" + ",".join(str(7 + k * M) for k in range(1, 9000)) + "}"
h.out.write(h.SENTINEL + " " + repr(("value", 7, value)) + "\\n")
h.out.flush()
"""


def test_values_whose_hashes_collide_cost_the_host_no_quadratic_time():
    plan = parse_asserts("assert f(1) == {1, 2}\nassert g(2) == {'a': 1}\n"
                         "assert set(h(3)) == {0}")
    flood = [5 + k * (2**61 - 1) for k in range(1, 9000)]
    lines = "\n".join(["S " + "{" + ",".join(map(str, flood * 3)) + "}",
                       "S " + repr(("import", True)),
                       f"S {('value', 0, repr(set(flood[:3]) | {1, 2}))}",
                       f"S {('value', 1, repr(dict.fromkeys(flood, 1)))}",
                       f"S {('value', 2, repr(flood))}",
                       f"S {('value', 3, '{1, 2}')}"])
    start = time.perf_counter()
    values = read_values(lines, "S", leaves=3)
    checks = [c.passes(values) for c in plan.checks]
    assert time.perf_counter() - start < 1.0
    assert 1 not in values and 3 not in values  # refused, and not one of the tests' leaves
    assert checks == [False, False, False]
    assert decode(repr(set(flood[:64]))) == set(flood[:64])  # a few collisions are data
    with pytest.raises(ValueError, match="share one hash"):
        decode(repr(set(flood[:65])))


@needs_bwrap
def test_a_flood_of_colliding_hashes_is_a_wrong_answer_in_the_reward_s_time(code_rewards):
    start = time.monotonic()
    out = code_rewards([f"```python\n{HASH_FLOOD}\n```"], [FIB["tests"]],
                       "task.reward_limits.timeout_s=4")
    assert out.total == [0.0]
    assert out.counts == {"reward/errors": 0, "reward/timeouts": 0}  # not a masked timeout
    assert time.monotonic() - start < 15


#: The `fib` row's asserts in HumanEval's form (`def check(candidate)`, then `check(fib)`).
FIB_HUMANEVAL = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n"
                 "    assert candidate(0) == 0\n    assert candidate(1) == 1\n"
                 "    assert candidate(10) == 55\n\ncheck(fib)\n")
#: A wrong `fib` that answers from the expected values in the harness's steps.
READ_THE_CHECK_FUNCTION = (
    "import re, sys\n"
    "TABLE = {}\n"
    "steps = repr(getattr(sys.modules['__main__'], 'STEPS', '')) + open('main.py').read()\n"
    "for arg, value in re.findall(r'candidate\\((\\d+)\\) == (\\d+)', steps):\n"
    "    TABLE[int(arg)] = int(value)\n"
    "def fib(n):\n    return TABLE.get(n, -1)\n")


@needs_bwrap
def test_humaneval_s_check_function_does_not_reach_the_sandbox():
    """The definition of `check` (the expected values) was sent as a step to run there."""
    plan = parse_asserts(FIB_HUMANEVAL)
    assert "55" not in json.dumps(plan.steps)
    tests = {"tests": FIB_HUMANEVAL}
    assert code_reward(f"```python\n{FIB_RIGHT}\n```", tests)["score"] == 1.0
    assert code_reward(f"```python\n{READ_THE_CHECK_FUNCTION}\n```", tests)["score"] == 0.0


@needs_bwrap
def test_honest_answers_in_container_subclasses_score_as_their_contents():
    """`Counter`, `defaultdict`, a namedtuple: Python's `==` accepts them, so does the host
    (they scored 0 on the word_count row); a subclass's own `__eq__` or `items` is ignored."""
    word_count = next(row["tests"] for row in ROWS if "word_count" in str(row["tests"]))
    honest = ["from collections import Counter\ndef word_count(s):\n"
              "    return Counter(s.split())",
              "from collections import defaultdict\ndef word_count(s):\n"
              "    d = defaultdict(int)\n    for w in s.split():\n        d[w] += 1\n"
              "    return d"]
    lying = ("class Lies(dict):\n    def __eq__(self, other):\n        return True\n"
             "    def items(self):\n        return [('a', 2), ('b', 1)]\n"
             "def word_count(s):\n    return Lies(z=1)\n")
    scores = [code_reward(f"```python\n{p}\n```", {"tests": word_count})["score"]
              for p in [*honest, lying]]
    assert scores == [1.0, 1.0, 0.0]
    pair = ("import collections\nP = collections.namedtuple('P', 'a b')\n"
            "def f():\n    return P(1, [2])\n")
    assert code_reward(pair, {"tests": "assert f() == (1, [2])"})["score"] == 1.0


def test_a_format_string_from_the_program_cannot_ask_the_host_for_gigabytes():
    plan = parse_asserts("assert f(1) % 7 == 'x'\nassert g(2) % (3,) == 'a3'")
    lines = "\n".join(["S " + repr(("import", True)),
                       f"S {('value', 0, repr('%1500000000s'))}",
                       f"S {('value', 1, repr('a%d'))}"])
    start = time.perf_counter()
    values = read_values(lines, "S", leaves=2)
    assert [c.passes(values) for c in plan.checks] == [False, True]
    assert time.perf_counter() - start < 0.2  # building the 1.5 GB string took 0.76 s
