"""The sandbox contract: limits in, how the program ended out, one `run` per program."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, Literal

import attrs

from peerflow.errors import PeerFlowError


class SandboxUnavailableError(PeerFlowError):
    """The chosen sandbox cannot run programs here (a missing tool, a service that is down).

    It is the infrastructure's fault, never the program's: callers let it propagate
    (a reward counts it as an error, not as a failed answer).
    """


@attrs.frozen(kw_only=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock seconds; past them every process of the program is killed."""
    memory_mb: int = 512
    """Memory of the whole program, every process and its tmpfs pages together (a memory
    cgroup where one can be made: root with a writable controller), and the address space
    of each process (`RLIMIT_AS`, everywhere)."""
    max_processes: int = 16
    """Processes the program may run at once (a pids cgroup where one can be made)."""
    max_output_mb: int = 8
    """Largest file (and standard output) the program may write."""


@attrs.frozen(kw_only=True)
class SandboxResult:
    """How a sandboxed run ended."""

    status: Literal["ok", "error", "timeout"]
    """`ok`: exit code 0; `error`: non-zero exit or killed by a limit; `timeout`."""
    returncode: int | None
    stdout: str
    stderr: str
    network_isolated: bool
    """Whether the run had its own (empty) network namespace (or ran remotely)."""
    process_limit: Literal["cgroup", "rlimit", "audit-hook", "remote", "none"]
    """What limited the number of processes."""


class Sandbox(abc.ABC):
    """Runs one untrusted Python program at a time (thread-safe: calls may overlap).

    Implementations: `BubblewrapSandbox` (namespaces, the default), `AuditHookSandbox`
    (the weaker fallback), `RemoteSandbox` (an HTTP service). `peerflow.sandbox.current()`
    returns the one a run chose (`sandbox.backend`).
    """

    name: ClassVar[str]
    """What `sandbox.backend` selects."""

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this sandbox cannot run here, naming the fix; `None` when it can."""
        return None

    @abc.abstractmethod
    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None,
            packages: Sequence[str] = ()) -> SandboxResult:
        """Runs a Python `program` with `stdin` and returns how it ended.

        Args:
            program: Python source, run as `__main__` in a fresh working directory.
            stdin: Its standard input.
            limits: Time, memory, process and output limits (default `SandboxLimits()`).
            packages: Top-level modules of this environment the program may import
                besides the standard library (read-only), e.g. `("numpy",)`.

        Raises:
            SandboxUnavailableError: when the sandbox itself failed, not the program.
        """
