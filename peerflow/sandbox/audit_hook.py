"""The weaker fallback: a subprocess with an audit hook, a network namespace and limits.

Chosen only by `sandbox.backend: audit-hook` (where bubblewrap cannot run); every run that
uses it says so at start. What it does:

1. a fresh temporary working directory, removed afterwards;
2. the resource limits of `peerflow.sandbox.local`;
3. a new network namespace (`unshare --net`, with `--user` when not root, a link of the
   exec chain) where the kernel allows it;
4. an audit hook (`sys.addaudithook`, installed before the program runs) that refuses
   sockets, `fork`/`exec`/`subprocess`, `os.kill`, `ctypes`, and writes, renames or
   deletes outside the working directory.

What it does not stop (`peerflow sandbox check --backend audit-hook` shows it): the
program keeps the trainer's user and sees its whole file system, so it reads any file
(the dataset, the reward code, `/proc/<pid>/environ` of every process and the secrets
there); and calls that raise no audit event — `_posixsubprocess.fork_exec` among them —
start processes that escape the hook, write anywhere the user may, and signal any
process. An audit hook is a tracing tool, not a security boundary (PEP 578 says so).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import ClassVar

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError
from peerflow.sandbox.local import (
    fresh_workdir,
    package_paths,
    remove_workdir,
    run_process,
    tool,
)

#: Runs first in the sandboxed interpreter: installs the audit hook, then the program.
GUARD = r'''
import os, sys
ROOT = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
BLOCKED = ("socket.", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
           "os.system", "subprocess.", "ctypes.", "os.kill", "os.killpg", "pty.",
           "os.setuid", "os.setgid", "os.chroot", "os.startfile")
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree")

def inside(path):
    if isinstance(path, int):
        return True
    path = os.path.realpath(os.fsdecode(path))
    return path == ROOT or path.startswith(ROOT + os.sep)

def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode and any(c in str(mode) for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if path is not None and writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox")

sys.path[:0] = PATHS
sys.addaudithook(hook)
del hook
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


@functools.cache
def network_unshare() -> tuple[str, ...]:
    """`unshare --net` (with `--user` when not root), where the kernel allows; else `()`.

    A link of the exec chain (`local.run_process`'s `wrap`), tried once per process.
    """
    try:
        argv = (tool("unshare"), "--net", *(() if os.geteuid() == 0 else ("--user",)), "--")
        done = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired, SandboxUnavailableError):
        return ()
    return argv if done.returncode == 0 else ()


class AuditHookSandbox(Sandbox):
    """The fallback of the module docstring: limits, a network namespace, an audit hook."""

    name: ClassVar[str] = "audit-hook"

    def __init__(self, audit_hook: bool = True) -> None:
        """`audit_hook=False` leaves only the kernel's layers (to test them alone)."""
        self.audit_hook = audit_hook

    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None,
            packages: Sequence[str] = ()) -> SandboxResult:
        """Runs one program (see `Sandbox.run`)."""
        limits = limits or SandboxLimits()
        paths = sorted({os.path.dirname(p) for p in package_paths(packages).values()})
        workdir = fresh_workdir()
        try:
            (workdir / "main.py").write_text(program)
            (workdir / "guard.py").write_text(GUARD.replace("PATHS", repr(paths)))
            argv = [sys.executable, "-I", "-B", "guard.py" if self.audit_hook else "main.py"]
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir),
                   "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
            wrap = network_unshare()
            outcome = run_process(argv, workdir, stdin, limits, env, wrap=wrap)
        finally:
            remove_workdir(workdir)
        return SandboxResult(
            status=outcome.status, returncode=outcome.returncode, stdout=outcome.stdout,
            stderr=outcome.stderr, network_isolated=bool(wrap),
            process_limit="cgroup" if outcome.cgroup else "rlimit" if os.geteuid()
            else "audit-hook")
