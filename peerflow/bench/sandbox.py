"""Per-program cost of the code sandboxes, on the `code` reward's own test cases.

Each run scores the same answers with `peerflow.rewards.code.code_reward` (one sandboxed
program per test case: stdin/stdout cases and an assert case, right and wrong answers)
under each sandbox in turn: `bubblewrap` (the default), `audit-hook` (the fallback, what
runs used before it), `remote` (the bubblewrap sandbox behind `peerflow sandbox serve`
on loopback: the HTTP seam's own cost), and a bare interpreter start (`python -I -S -c
pass`, the floor every fresh-process sandbox pays). Runs alternate between them so load
hits all alike; figures are medians over `--runs`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from peerflow.bench.options import add_runs_argument

SUM = "a, b = map(int, input().split())\nprint(a + b)"
IO_TESTS = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}])
ASSERTS = "assert add(2, 2) == 4\nassert add(-1, 1) == 0"
#: (answer, example) pairs: the cases of tests/unit/test_sandbox_rewards.py.
CASES = [
    (f"```python\n{SUM}\n```", {"tests": IO_TESTS}),
    ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", {"answer": IO_TESTS}),
    ("def add(a, b):\n    return a + b", {"answer": ASSERTS}),
    ("def add(a, b):\n    return a * b", {"answer": ASSERTS}),
]
#: A bare interpreter start: the floor of any sandbox that starts a fresh process.
BARE = [sys.executable, "-I", "-S", "-c", "pass"]
#: Sandboxed programs one scoring of `CASES` runs: one per stdin case, one per assert case.
PROGRAMS = 2 + 2 + 1 + 1

#: The variable the benchmark passes its own `serve` token in.
BENCH_TOKEN_ENV = "PEERFLOW_BENCH_SANDBOX_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    add_runs_argument(parser, 5, "runs per sandbox (median)")


def _score_all() -> list[float]:
    from peerflow.rewards.code import code_reward

    return [code_reward(answer, example)["score"] for answer, example in CASES]


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Times every sandbox; returns ms per program, medians, and the ratios."""
    from peerflow.sandbox import configure
    from peerflow.sandbox.bubblewrap import BubblewrapSandbox
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.server import make_server, serve_in_thread

    server = make_server(BubblewrapSandbox())
    serve_in_thread(server)
    os.environ[BENCH_TOKEN_ENV] = server.token  # serve always wants its token
    settings = {"bubblewrap": SandboxConfig(), "audit-hook": SandboxConfig(backend="audit-hook"),
                "remote": SandboxConfig(backend="remote", url=server.url,
                                        token_env=BENCH_TOKEN_ENV)}
    previous = os.environ.get("PEERFLOW_SANDBOX")
    times: dict[str, list[float]] = {name: [] for name in [*settings, "interpreter start"]}
    scores = {}
    try:
        for _ in range(args.runs):
            for name, config in settings.items():
                configure(config)
                scores[name] = _score_all()
                times[name].append(_timed(_score_all) / PROGRAMS)
            times["interpreter start"].append(_timed(lambda: subprocess.run(BARE, check=True)))
    finally:
        server.shutdown()
        server.server_close()
        os.environ.pop(BENCH_TOKEN_ENV, None)
        if previous is None:
            os.environ.pop("PEERFLOW_SANDBOX", None)
        else:
            os.environ["PEERFLOW_SANDBOX"] = previous
    ms = {name: round(statistics.median(values) * 1000, 1) for name, values in times.items()}
    return {
        "benchmark": "sandbox", "runs": args.runs, "programs_per_run": PROGRAMS,
        "ms_per_program": ms,
        "bubblewrap_minus_audit_hook_ms": round(ms["bubblewrap"] - ms["audit-hook"], 1),
        "bubblewrap_vs_audit_hook": round(ms["bubblewrap"] / ms["audit-hook"], 2),
        "remote_vs_bubblewrap": round(ms["remote"] / ms["bubblewrap"], 2),
        "scores_agree": len({tuple(s) for s in scores.values()}) == 1,
        "scores": scores["bubblewrap"],
    }
