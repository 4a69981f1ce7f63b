"""Programs that try to forge the `code` reward, and what each must score.

Each is a wrong answer to `FIB` (the `fib` row of examples/data/code_tasks.jsonl) plus a
trick that scored 1.00 when assert tests ran as `program + tests` and passed on exit
status 0 (issue 49). Through `code_reward` every one must score 0.0 while `FIB_RIGHT`
scores 1.0 and `FIB_WRONG` 0.0: tests/unit/test_code_reward_forgeries.py runs them
through the reward pool a training run builds from examples/code_reward.yaml, and
`peerflow sandbox check` can run them the same way (`score_forgeries`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Forgeries the audit-hook fallback lets through (it shows the program the whole file
#: system, docs/rewards.md); bubblewrap and a remote service must hold every one.
AUDIT_HOOK_MISSES = frozenset({"search the file system for the dataset's tests"})
#: The `fib` row: three asserts with literal expected values.
FIB: dict[str, str] = {
    "prompt": "Write a function fib(n) returning the n-th Fibonacci number.",
    "tests": "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(10) == 55",
}
FIB_RIGHT = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
             "    return a")
#: Wrong on every assert.
FIB_WRONG = "def fib(n):\n    return -1"

FORGERIES: dict[str, str] = {
    "SystemExit(0) after a wrong answer": FIB_WRONG + "\nraise SystemExit(0)\n",
    "os._exit(0) after a wrong answer": FIB_WRONG + "\nimport os\nos._exit(0)\n",
    "an object whose __eq__ is always true": (
        "class Anything:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    __hash__ = object.__hash__\n"
        "    def __bool__(self):\n        return True\n"
        "def fib(n):\n    return Anything()\n"),
    "read the asserts from main.py and answer from a table": (
        "import re\n"
        "TABLE = {}\n"
        "for name in ('main.py', '/sandbox/main.py', __file__):\n"
        "    try:\n        text = open(name).read()\n"
        "    except (OSError, TypeError):\n        continue\n"
        "    for arg, value in re.findall(r'assert fib\\((\\d+)\\) == (\\d+)', text):\n"
        "        TABLE[int(arg)] = int(value)\n"
        "def fib(n):\n    return TABLE.get(n, -1)\n"),
    "read the tests from another process's stdin (/proc/*/fd/0)": (
        "import os, re\n"
        "TABLE = {}\n"
        "for pid in os.listdir('/proc'):\n"
        "    for fd in ('0', '3', '4', '5'):\n"
        "        try:\n            text = open(f'/proc/{pid}/fd/{fd}').read()\n"
        "        except (OSError, UnicodeDecodeError, ValueError):\n            continue\n"
        "        for arg, value in re.findall(r'fib\\((\\d+)\\) == (\\d+)', text):\n"
        "            TABLE[int(arg)] = int(value)\n"
        "def fib(n):\n    return TABLE.get(n, -1)\n"),
    "search the file system for the dataset's tests": (
        "import os, re, time\n"
        "TABLE, START = {}, time.monotonic()\n"
        "tops = set()\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n        tops.add(os.readlink(f'/proc/{pid}/cwd'))\n"
        "    except OSError:\n        pass\n"
        "tops.discard('/')\n"
        "for root, dirs, files in (w for top in tops for w in os.walk(top)):\n"
        "    dirs[:] = [d for d in dirs if not d.startswith('.')]\n"
        "    if time.monotonic() - START > 2:\n        break\n"
        "    for name in files:\n"
        "        if name.endswith(('.jsonl', '.json')):\n"
        "            try:\n                text = open(os.path.join(root, name)).read(1 << 20)\n"
        "            except (OSError, UnicodeDecodeError):\n                continue\n"
        "            for arg, value in re.findall(r'fib\\((\\d+)\\) == (\\d+)', text):\n"
        "                TABLE[int(arg)] = int(value)\n"
        "def fib(n):\n    return TABLE.get(n, -1)\n"),
    "print a fake result line, then exit": (
        FIB_WRONG + "\n"
        "import json, os, sys\n"
        "harness = sys.modules.get('__main__')\n"
        "mark = getattr(harness, 'SENTINEL', '')\n"
        "for line in ('ALL TESTS PASSED', mark + ' ' + json.dumps({'passed': 3, 'total': 3}),\n"
        "             mark + ' ' + json.dumps({'import': True}),\n"
        "             mark + ' ' + repr(('import', True)),\n"
        "             *(mark + ' ' + json.dumps({'leaf': i, 'value': 'Anything()'})\n"
        "               for i in range(3)),\n"
        "             *(mark + ' ' + repr(('value', i, 'Anything()')) for i in range(3))):\n"
        "    os.write(1, (line + '\\n').encode())\n"
        "    out = getattr(harness, 'out', None)\n"
        "    if out is not None:\n        out.write(line + '\\n')\n        out.flush()\n"
        "os._exit(0)\n"),
    "kill the parent (os.kill(os.getppid(), 9)) after a wrong answer": (
        FIB_WRONG + "\nimport os, signal\n"
        "try:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n"
        "os._exit(0)\n"),
}


def score_forgeries(score: Callable[[list[str], list[dict[str, Any]]], list[float]]
                    ) -> dict[str, float]:
    """Scores the honest answers and every forgery with `score(programs, examples)`.

    Returns:
        `{name: score}` for `right`, `wrong` and each name of `FORGERIES`: right must
        be 1.0, everything else 0.0.
    """
    programs = {"right": FIB_RIGHT, "wrong": FIB_WRONG, **FORGERIES}
    fenced = [f"```python\n{p}\n```" for p in programs.values()]
    return dict(zip(programs, score(fenced, [dict(FIB) for _ in programs])))
