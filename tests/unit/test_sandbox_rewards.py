"""The sandbox, the `code` reward and the `math` reward."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import load_config, validate_config
from peerflow.rewards import build_reward_set
from peerflow.rewards.code import code_reward, extract_program
from peerflow.rewards.math import math_reward
from peerflow.rewards.sandbox import SandboxLimits, run_sandboxed

LIMITS = SandboxLimits(timeout_s=15.0, memory_mb=512)


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_good_program_runs_and_its_directory_is_removed(own_tempdir):
    result = run_sandboxed("import sys\nopen('scratch.txt', 'w').write('ok')\n"
                           "print(sys.stdin.read()[::-1])", "abc", LIMITS)
    assert result.status == "ok" and result.stdout == "cba\n"
    assert not any(p.name.startswith("peerflow-sandbox-") for p in own_tempdir.iterdir())


@pytest.mark.parametrize("program, refused", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "socket."),
    ("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 0))", "socket."),
    ("open({outside!r}, 'w').write('escaped')", "outside the sandbox directory"),
    ("import os\nos.remove({outside!r})", "outside the sandbox"),
    ("import os\nwhile True:\n    os.fork()", "os.fork is not allowed"),
    ("import subprocess\nsubprocess.run(['sh', '-c', ':(){{ :|:& }};:'])", "subprocess.Popen"),
    ("import ctypes\nctypes.CDLL(None).fork()", "ctypes"),
])
def test_escapes_are_refused(own_tempdir, program, refused):
    outside = own_tempdir / "victim.txt"
    outside.write_text("keep")
    result = run_sandboxed(program.format(outside=str(outside)), "", LIMITS)
    assert result.status == "error" and refused in result.stderr
    assert outside.read_text() == "keep"


def test_network_namespace_where_the_kernel_allows_it():
    result = run_sandboxed("print(open('/proc/net/dev').read())", "", LIMITS)
    if not result.network_isolated:
        pytest.skip("this kernel or container refuses unshare(CLONE_NEWNET)")
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:]
                  if line.strip()]
    assert interfaces == ["lo"]


def test_limits_stop_loops_memory_and_floods():
    looping = run_sandboxed("while True:\n    pass", "", SandboxLimits(timeout_s=2))
    assert looping.status == "timeout"
    hog = run_sandboxed("x = bytearray(2 * 2**30)", "", LIMITS)
    assert hog.status == "error" and "MemoryError" in hog.stderr
    flood = run_sandboxed("while True:\n    print('x' * 4096)", "",
                          SandboxLimits(timeout_s=5, max_output_mb=1))
    assert flood.status == "error" and len(flood.stdout) <= 2**20


KERNEL_ONLY = SandboxLimits(timeout_s=15, max_processes=8, audit_hook=False)


def test_process_limit_holds_without_the_audit_hook():
    if os.geteuid() == 0 and run_sandboxed("", "", LIMITS).process_limit != "cgroup":
        pytest.skip("root without a writable pids cgroup: only the audit hook limits forks")
    # bounded (64 sleepers at most) so a broken limit cannot take the machine down
    program = ("import os, time\nspawned = 0\ntry:\n    for _ in range(64):\n"
               "        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n"
               "        spawned += 1\nexcept OSError as exc:\n"
               "    print('stopped after', spawned, exc)\n")
    result = run_sandboxed(program, "", KERNEL_ONLY)
    assert "stopped after" in result.stdout, result.stderr
    assert int(result.stdout.split()[2]) < 10


def test_no_network_without_the_audit_hook():
    program = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=3)\n"
               "    print('connected')\nexcept OSError as exc:\n    print('refused', exc)\n")
    result = run_sandboxed(program, "", KERNEL_ONLY)
    if not result.network_isolated:
        pytest.skip("this kernel or container refuses unshare(CLONE_NEWNET)")
    assert result.stdout.startswith("refused") and "Network is unreachable" in result.stdout


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
    assert code_reward("def add(a, b):\n    return a * b", asserts)["score"] == 0.0


def test_hostile_candidates_score_zero_and_the_run_continues(plugin_manager):
    config = load_config(None, ["task.reward=code", "task.reward_limits.timeout_s=20"])
    validate_config(config, plugin_manager)
    rewards = build_reward_set(config.task, plugin_manager, "char_match")
    tests = [{"input": "4\n", "output": "8"}]
    examples = [Example(prompt="double it", answer=json.dumps(tests), index=i)
                for i in range(5)]
    candidates = [
        "import socket\nsocket.create_connection(('127.0.0.1', 80))\nprint(8)",
        "open('/etc/peerflow-escape', 'w').write('x')\nprint(8)",
        "import os\nwhile True:\n    os.fork()",
        "while True:\n    pass",
        "print(int(input()) * 2)",
    ]
    try:
        out = rewards.score(candidates, examples)
    finally:
        rewards.close()
    assert out.total == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert out.counts == {"reward/errors": 0, "reward/timeouts": 0}  # failures, not faults
    assert not os.path.exists("/etc/peerflow-escape")


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
