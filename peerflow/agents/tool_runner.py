"""Running tool calls in the sandbox, many at once.

Every call runs in its own `peerflow.sandbox.run_sandboxed` process — the same sandbox
the `code` reward uses (`sandbox.backend`; bubblewrap by default: its own namespaces, an
unprivileged user, no network, a read-only view of only the interpreter), with an
address-space limit and a wall-clock limit after which every process of the call is
killed. The tool object is pickled into the child, which imports its class by module
path: the tool's top-level package (and `peerflow`, for the `Tool` base) is made
importable there read-only, with `sandbox.packages`; nothing else of this environment
is. The parent never unpickles what the child sends back.

The result travels as the last line of the child's stdout, `MARKER<sentinel> {json}`,
where the sentinel is random per call. The runner takes the tool's stdin and stdout away
from it (`/dev/null`; its prints are captured apart), makes itself non-dumpable (other
processes of the sandbox cannot read its memory or its descriptors) and a child
subreaper, and, once the tool has returned, kills every process the tool started before
it writes the line and exits 0. The parent accepts a result only from a child that
exited 0 with that line last: a line the tool's processes print (on any descriptor), a
runner they kill, or a tool that exits before returning gives `error`. What this does
not stop: code the tool runs in the runner's own interpreter (an `exec` of model code)
can change anything there, the result included — as it could change what `call`
returns; a tool that runs model code should start it in a process of its own.

Calls are submitted to a shared thread pool (`MAX_CONCURRENT_TOOLS` threads, each waiting
on one child process), so the tool calls of many trajectories are in flight at once and
a slow tool holds one thread, never the batch. A tool that raises, times out, or dies
(memory) gives a `ToolResult` whose `status` says so; nothing raises to the caller.
"""

from __future__ import annotations

import base64
import json
import pickle
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import attrs

from peerflow.agents.tools import Tool
from peerflow.sandbox import SandboxLimits, SandboxResult, run_sandboxed
from peerflow.sandbox.result_channel import PRIVATE_STDOUT

#: Threads (hence sandboxed processes) running tool calls at once in one process.
MAX_CONCURRENT_TOOLS = 64
#: Prefixes the child's result line on stdout (then the call's sentinel, a space, JSON).
MARKER = "@@peerflow-tool-result@@"

#: The program the sandbox runs for one call; the tool's own prints are captured apart.
RUNNER = r'''
import base64, io, json, os, pickle, signal, sys
request = json.loads(sys.stdin.read())
SENTINEL = request.pop("sentinel")
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0: no /proc/<pid>/mem or fd to others
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the tool come here
except (ImportError, OSError, AttributeError):  # the audit-hook fallback refuses ctypes
    pass
PRIVATE_STDOUT
sys.stdout = io.StringIO()
try:
    tool = pickle.loads(base64.b64decode(request["tool"]))
    reply = {"status": "ok", "content": str(tool.call(request["arguments"]))}
except BaseException as exc:
    reply = {"status": "error", "content": f"{type(exc).__name__}: {exc}",
             "memory": isinstance(exc, MemoryError)}

def children():
    me, found = str(os.getpid()), []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            found.append(int(pid))
    return found

def end_all():  # nothing the tool started may write after the result
    for _ in range(1000):
        alive = children()
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except PermissionError:  # the audit-hook fallback refuses os.kill
                return
            except OSError:
                pass
        for pid in alive:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass

end_all()
out.write(MARKER + SENTINEL + " " + json.dumps(reply) + "\n")
out.flush()
os._exit(0)
'''.replace("MARKER", repr(MARKER)).replace("PRIVATE_STDOUT\n", PRIVATE_STDOUT.lstrip("\n"))

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


def _result(name: str, run: SandboxResult, limits: SandboxLimits, sentinel: str) -> ToolResult:
    if run.status == "timeout":
        return ToolResult(name=name, status="timeout",
                          content=f"the tool {name!r} timed out after {limits.timeout_s:g} s")
    lines = run.stdout.splitlines()
    head = MARKER + sentinel + " "
    if run.status == "ok" and lines and lines[-1].startswith(head):
        try:
            reply = json.loads(lines[-1][len(head):])
            content, status = str(reply["content"]), reply["status"]
        except (ValueError, KeyError, TypeError):
            content, status = "", None
        if status is not None:
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
    sentinel = secrets.token_hex(16)
    try:
        request = json.dumps({
            "arguments": arguments, "sentinel": sentinel,
            "tool": base64.b64encode(pickle.dumps(tool)).decode()})
    except (TypeError, ValueError, pickle.PicklingError, AttributeError) as exc:
        return ToolResult(name=tool.name, status="error",
                          content=f"the call to {tool.name!r} cannot be sent to the sandbox: "
                          f"{type(exc).__name__}: {exc}")
    run = run_sandboxed(RUNNER, request, limits, _packages(tool))
    return _result(tool.name, run, limits, sentinel)


def run_tools(calls: Sequence[tuple[Tool, dict[str, Any]]],
              limits: SandboxLimits) -> list[ToolResult]:
    """Runs several calls at once on the shared pool and returns their results in order."""
    futures = [_executor().submit(run_tool, tool, arguments, limits)
               for tool, arguments in calls]
    return [future.result() for future in futures]
