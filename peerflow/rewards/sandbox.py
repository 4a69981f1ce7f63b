"""Running an untrusted Python program: no network, limits, a temporary directory.

What `run_sandboxed` does, layer by layer (honestly: this is defence in depth for
model-written programs on a training machine, not a boundary against a determined
attacker; for that, run rewards in a container or VM):

1. **A fresh temporary directory** is the program's working directory; it is removed
   afterwards whatever happened.
2. **Resource limits** (`setrlimit` in the child): address space (`memory_mb`), CPU
   seconds, file size (`RLIMIT_FSIZE`, which also caps what the program prints), open
   files, no core dumps. Processes: `RLIMIT_NPROC` counts per user and does not bind
   root, so as root the child joins a fresh cgroup with `pids.max` when the pids
   controller is writable (`SandboxResult.process_limit` says which held: `cgroup`,
   `rlimit`, or `audit-hook` alone).
3. **No network**: the child enters a new network namespace (`unshare(CLONE_NEWNET)`,
   with `CLONE_NEWUSER` when not root), which has only a down loopback device. Where the
   kernel refuses (some containers and CI runners), `SandboxResult.network_isolated`
   is `False` and only layer 4 blocks sockets.
4. **An audit hook** (`sys.addaudithook`, installed before the program runs, with
   `python -I -B`): refuses sockets, new processes (`fork`, `exec`, `subprocess`,
   `os.system`), `ctypes`, and any write, rename or delete outside the temporary
   directory. A refused call raises `PermissionError` in the program. As root this is
   the only layer that keeps writes inside the directory (the interpreter usually lives
   where an unprivileged user could not run it, so the child keeps its user).
5. **Wall-clock limit**: the program runs in its own session; past `timeout_s` the whole
   process group is killed.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import attrs

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
#: Where a pids cgroup may be made (cgroup v1 pids hierarchy, then the v2 root).
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")

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

sys.addaudithook(hook)
del hook
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


@attrs.frozen(kw_only=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock seconds."""
    memory_mb: int = 512
    """Address space."""
    max_processes: int = 16
    """`RLIMIT_NPROC` headroom (processes are also refused by the audit hook)."""
    max_output_mb: int = 8
    """Largest file (and standard output) the program may write."""
    audit_hook: bool = True
    """Install the audit hook (layer 4); off only to test the kernel's layers alone."""


@attrs.frozen(kw_only=True)
class SandboxResult:
    """How a sandboxed run ended."""

    status: Literal["ok", "error", "timeout"]
    """`ok`: exit code 0; `error`: non-zero exit or killed by a limit; `timeout`."""
    returncode: int | None
    stdout: str
    stderr: str
    network_isolated: bool
    """Whether the run had its own (empty) network namespace."""
    process_limit: Literal["cgroup", "rlimit", "audit-hook"]
    """What limited the number of processes besides the audit hook."""


def _remove_cgroup(path: str) -> None:
    """Kills what is left in a sandbox cgroup and removes it."""
    procs = Path(path, "cgroup.procs")
    for _ in range(50):
        pids = [int(p) for p in procs.read_text().split()] if procs.exists() else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)


def _unshare_network() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
    return libc.unshare(flags) == 0


def _user_processes() -> int:
    uid, count = os.geteuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _make_pids_cgroup(max_processes: int) -> str | None:
    """A fresh cgroup limited to `max_processes` tasks, or `None` where none can be made."""
    if os.geteuid() != 0:
        return None
    for root in CGROUP_ROOTS:
        if not os.path.isfile(os.path.join(root, "cgroup.procs")):
            continue
        try:
            path = tempfile.mkdtemp(prefix="peerflow-sandbox-", dir=root)
        except OSError:
            continue
        try:
            Path(path, "pids.max").write_text(str(max_processes))
            return path
        except OSError:
            os.rmdir(path)
    return None


def _limit(kind: int, value: int) -> None:
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _child_setup(limits: SandboxLimits, nproc: int, net_flag: str,
                 cgroup: str | None) -> None:
    """Runs in the forked child before exec (only async-signal-safe-ish work)."""
    isolated = _unshare_network()
    Path(net_flag).write_text("1" if isolated else "0")
    if cgroup:
        Path(cgroup, "cgroup.procs").write_text("0")
    _limit(resource.RLIMIT_AS, limits.memory_mb * 2**20)
    _limit(resource.RLIMIT_CPU, int(limits.timeout_s) + 1)
    _limit(resource.RLIMIT_FSIZE, limits.max_output_mb * 2**20)
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)
    if os.geteuid() != 0:
        _limit(resource.RLIMIT_NPROC, nproc)


def run_sandboxed(program: str, stdin: str = "",
                  limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs a Python `program` with `stdin` in the sandbox and returns how it ended."""
    limits = limits or SandboxLimits()
    workdir = Path(tempfile.mkdtemp(prefix="peerflow-sandbox-"))
    try:
        (workdir / "main.py").write_text(program)
        (workdir / "guard.py").write_text(GUARD)
        (workdir / "stdin.txt").write_text(stdin)
        net_flag = workdir / "net"
        nproc = _user_processes() + limits.max_processes
        cgroup = _make_pids_cgroup(limits.max_processes)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir),
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        with open(workdir / "stdin.txt", "rb") as fin, \
                open(workdir / ".stdout", "wb") as fout, open(workdir / ".stderr", "wb") as ferr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "guard.py" if limits.audit_hook else "main.py"],
                cwd=workdir, env=env, stdin=fin,
                stdout=fout, stderr=ferr, start_new_session=True, close_fds=True,
                preexec_fn=lambda: _child_setup(limits, nproc, str(net_flag), cgroup))
            try:
                returncode = proc.wait(timeout=limits.timeout_s)
                status = "ok" if returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                returncode, status = None, "timeout"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                if cgroup:
                    _remove_cgroup(cgroup)
        read = lambda name: (workdir / name).read_bytes()[:1 << 20].decode(  # noqa: E731
            "utf-8", "replace")
        isolated = net_flag.is_file() and net_flag.read_text() == "1"
        return SandboxResult(
            status=status, returncode=returncode, stdout=read(".stdout"),
            stderr=read(".stderr"), network_isolated=isolated,
            process_limit="cgroup" if cgroup else "rlimit" if os.geteuid() else "audit-hook")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
