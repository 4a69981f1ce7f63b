"""A tool's code cannot forge the tool runner's result (issue 49), under bubblewrap as root."""

from __future__ import annotations

import pytest

from peerflow.agents.tool_runner import MARKER, run_tool
from peerflow.sandbox import SandboxLimits, configure
from peerflow.sandbox.bubblewrap import bwrap_unavailable
from peerflow.sandbox.config import SandboxConfig
from tests.helpers import forging_tools
from tests.helpers.forging_tools import (
    FORK_FORGE_AND_KILL,
    PIDFD_GETFD_PWRITE,
    PRINT_AND_EXIT,
    RunsCode,
    RunsCodeInProcess,
)

LIMITS = SandboxLimits(timeout_s=20.0, memory_mb=512)
needs_bwrap = pytest.mark.skipif(bwrap_unavailable() is not None, reason=f"{bwrap_unavailable()}")


@pytest.fixture(autouse=True)
def bubblewrap(monkeypatch):
    monkeypatch.setenv("PEERFLOW_SANDBOX", "")  # restored after the test
    configure(SandboxConfig(backend="bubblewrap"))


def test_the_forgeries_use_the_runner_s_own_marker():
    assert forging_tools.MARKER == MARKER


@needs_bwrap
def test_a_tool_running_model_code_returns_what_it_printed():
    result = run_tool(RunsCode(), {"code": f"print({MARKER!r} + 'not me')\nprint(6 * 7)"},
                      LIMITS)
    assert (result.status, result.content) == ("ok", f"{MARKER}not me\n42\n")


@needs_bwrap
@pytest.mark.parametrize("code", [PRINT_AND_EXIT, FORK_FORGE_AND_KILL],
                         ids=["print the result line and exit",
                              "steal the sentinel, write everywhere, kill the runner"])
def test_model_code_cannot_forge_the_runner_s_result(code):
    result = run_tool(RunsCode(), {"code": code}, LIMITS)
    assert result.status == "error" and "process died" in result.content
    assert result.content != "forged"


@needs_bwrap
def test_model_code_in_a_process_of_its_own_cannot_take_the_runner_s_stdout():
    """`pidfd_getfd` on the sandbox's first process gave its stdin (the sentinel) and its
    stdout (the host-side file): a `pwrite` past the runner's line forged an `ok`."""
    honest = run_tool(RunsCodeInProcess(), {"code": "print(6 * 7)"}, LIMITS)
    assert (honest.status, honest.content) == ("ok", "42\n")
    result = run_tool(RunsCodeInProcess(), {"code": PIDFD_GETFD_PWRITE}, LIMITS)
    assert result.content != "forged"
    assert (result.status, result.content) == ("ok", "honest output\n")
