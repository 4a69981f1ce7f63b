"""Running tool calls in the sandbox, many at once.

Every call runs in its own `peerflow.sandbox.run_sandboxed` process — the same sandbox
the `code` reward uses (`sandbox.backend`; bubblewrap by default: its own namespaces, an
unprivileged user, no network, a read-only view of only the interpreter), with an
address-space limit and a wall-clock limit after which every process of the call is
killed. The tool object is pickled into the child, which imports its class by module
path: the tool's top-level package (and `peerflow`, for the `Tool` base) is made
importable there read-only, with `sandbox.packages`; nothing else of this environment
is. The child prints one JSON line with the result; the parent never unpickles what the
child sends back.

Calls are submitted to a shared thread pool (`MAX_CONCURRENT_TOOLS` threads, each waiting
on one child process), so the tool calls of many trajectories are in flight at once and
a slow tool holds one thread, never the batch. A tool that raises, times out, or dies
(memory) gives a `ToolResult` whose `status` says so; nothing raises to the caller.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import attrs

from peerflow.agents.tools import Tool
from peerflow.sandbox import SandboxLimits, SandboxResult, run_sandboxed

#: Threads (hence sandboxed processes) running tool calls at once in one process.
MAX_CONCURRENT_TOOLS = 64
#: Prefixes the child's one line of JSON on stdout.
MARKER = "@@peerflow-tool-result@@"

#: The program the sandbox runs for one call; the tool's own prints are captured apart.
RUNNER = r'''
import base64, io, json, pickle, sys
request = json.loads(sys.stdin.read())
out, sys.stdout = sys.stdout, io.StringIO()
try:
    tool = pickle.loads(base64.b64decode(request["tool"]))
    reply = {"status": "ok", "content": str(tool.call(request["arguments"]))}
except BaseException as exc:
    reply = {"status": "error", "content": f"{type(exc).__name__}: {exc}",
             "memory": isinstance(exc, MemoryError)}
out.write(MARKER + json.dumps(reply) + "\n")
'''.replace("MARKER", repr(MARKER))

_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


@attrs.frozen(kw_only=True)
class ToolResult:
    """How one tool call ended."""

    name: str
    """The tool called."""
    status: Literal["ok", "error", "timeout"]
    """`ok`: the tool returned; `error`: it raised, died, or the call was malformed;
    `timeout`: it ran past its wall-clock limit and was killed."""
    content: str
    """The tool's result, or the error the model sees."""

    @property
    def failed(self) -> bool:
        """True unless the tool returned normally."""
        return self.status != "ok"


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:  # environments of many trajectories step on threads at once
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(MAX_CONCURRENT_TOOLS,
                                           thread_name_prefix="peerflow-tool")
    return _EXECUTOR


def _packages(tool: Tool) -> tuple[str, ...]:
    """The top-level packages the child needs to unpickle `tool`: its own, and peerflow."""
    return tuple(dict.fromkeys([type(tool).__module__.split(".")[0], "peerflow"]))


def _result(name: str, run: SandboxResult, limits: SandboxLimits) -> ToolResult:
    if run.status == "timeout":
        return ToolResult(name=name, status="timeout",
                          content=f"the tool {name!r} timed out after {limits.timeout_s:g} s")
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                reply = json.loads(line[len(MARKER):])
                content, status = str(reply["content"]), reply["status"]
            except (ValueError, KeyError, TypeError):
                break
            if reply.get("memory"):
                content += f" (over the {limits.memory_mb} MiB memory limit)"
            return ToolResult(name=name, status="ok" if status == "ok" else "error",
                              content=content)
    last = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
    return ToolResult(name=name, status="error", content=f"the tool {name!r} process died "
                      f"({last}; memory limit {limits.memory_mb} MiB)")


def run_tool(tool: Tool, arguments: dict[str, Any], limits: SandboxLimits) -> ToolResult:
    """Runs one call in a sandboxed process and waits for it (at most `limits.timeout_s`).

    Args:
        tool: The tool (pickled into the child).
        arguments: The call's arguments (JSON-serialisable).
        limits: Time and memory limits of the child.

    Returns:
        The result; failures are marked in `status`, never raised.
    """
    try:
        request = json.dumps({
            "arguments": arguments,
            "tool": base64.b64encode(pickle.dumps(tool)).decode()})
    except (TypeError, ValueError, pickle.PicklingError, AttributeError) as exc:
        return ToolResult(name=tool.name, status="error",
                          content=f"the call to {tool.name!r} cannot be sent to the sandbox: "
                          f"{type(exc).__name__}: {exc}")
    return _result(tool.name, run_sandboxed(RUNNER, request, limits, _packages(tool)), limits)


def run_tools(calls: Sequence[tuple[Tool, dict[str, Any]]],
              limits: SandboxLimits) -> list[ToolResult]:
    """Runs several calls at once on the shared pool and returns their results in order."""
    futures = [_executor().submit(run_tool, tool, arguments, limits)
               for tool, arguments in calls]
    return [future.result() for future in futures]
