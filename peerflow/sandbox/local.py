"""What both local sandboxes share: directory, limits, pids cgroup, clock, packages.

A local sandbox builds an argv (`bwrap … python …` or `python guard.py`) and hands it to
`run_process`, which starts it in its own session with the rlimits applied, puts it in a
fresh pids cgroup where one can be made (root with a writable pids controller), waits at
most `timeout_s`, then kills the whole process group and removes the cgroup.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from peerflow.sandbox.base import SandboxLimits

#: Where a pids cgroup may be made (cgroup v1 pids hierarchy, then the v2 root).
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
#: At most this much of each output stream is kept.
KEEP_OUTPUT = 1 << 20


@attrs.frozen(kw_only=True)
class ProcessOutcome:
    """How a sandboxed process ended, before a sandbox adds what it knows."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    cgroup: bool
    """Whether a pids cgroup limited the processes."""


def package_paths(names: Sequence[str]) -> dict[str, str]:
    """The file or directory of each top-level module in `names`, in this environment.

    Raises:
        ValueError: naming a module that is not installed here.
    """
    found = {}
    for name in names:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ValueError(f"sandbox.packages: no module {name!r} is installed in this "
                             "environment; install it or remove it from the list.")
        locations = list(spec.submodule_search_locations or [])
        path = locations[0] if locations else str(spec.origin)
        found[spec.name] = path
        vendored = os.path.join(os.path.dirname(path), f"{spec.name}.libs")
        if os.path.isdir(vendored):  # shared libraries a manylinux wheel ships beside it
            found[f"{spec.name}.libs"] = vendored
    return found


def _remove_cgroup(path: str) -> None:
    """Kills what is left in a sandbox cgroup and removes it (within about a second)."""
    procs = Path(path, "cgroup.procs")
    with contextlib.suppress(OSError):  # cgroup v2 on Linux >= 5.14 kills all at once
        Path(path, "cgroup.kill").write_text("1")
    for _ in range(500):
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
            time.sleep(0.002)


def make_pids_cgroup(max_processes: int) -> str | None:
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


def _user_processes() -> int:
    uid, count = os.geteuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def apply_rlimits(limits: SandboxLimits, cgroup: str | None, nproc: int | None) -> None:
    """Runs in the forked child before exec: joins the cgroup, sets the rlimits.

    `nproc` is `RLIMIT_NPROC` (counted per user, so the user's running processes plus
    the headroom); `None` as root, which it does not bind.
    """
    if cgroup:
        Path(cgroup, "cgroup.procs").write_text("0")
    if nproc is not None:
        _limit(resource.RLIMIT_NPROC, nproc)
    _limit(resource.RLIMIT_AS, limits.memory_mb * 2**20)
    _limit(resource.RLIMIT_CPU, int(limits.timeout_s) + 1)
    _limit(resource.RLIMIT_FSIZE, limits.max_output_mb * 2**20)
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    """`proc.wait(timeout_s)`, woken by the exit itself where the kernel has pidfds.

    `Popen.wait` with a timeout polls with sleeps of up to 50 ms, which would be most
    of a short program's cost.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.wait(timeout=timeout_s)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
    finally:
        os.close(pidfd)
    return proc.wait()


def run_process(argv: list[str], workdir: Path, stdin: str, limits: SandboxLimits,
                env: dict[str, str], before_exec: Callable[[], None] | None = None,
                pass_fds: Sequence[int] = ()) -> ProcessOutcome:
    """Runs `argv` in `workdir` under `limits` and returns how it ended.

    Args:
        argv: The command (a sandbox tool or an interpreter).
        workdir: An existing directory for the process and its captured output.
        stdin: The program's standard input.
        limits: Its limits; the whole process group is killed past `timeout_s`.
        env: The process's whole environment.
        before_exec: Runs in the child after the rlimits are set (e.g. `unshare`).
        pass_fds: Descriptors the child keeps (e.g. bwrap's status pipe).
    """
    cgroup = make_pids_cgroup(limits.max_processes)
    nproc = None if os.geteuid() == 0 else _user_processes() + limits.max_processes

    def setup() -> None:
        apply_rlimits(limits, cgroup, nproc)
        if before_exec is not None:
            before_exec()

    (workdir / ".stdin").write_text(stdin)
    try:
        with open(workdir / ".stdin", "rb") as fin, \
                open(workdir / ".stdout", "wb") as fout, open(workdir / ".stderr", "wb") as ferr:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=fin, stdout=fout,
                                    stderr=ferr, start_new_session=True, close_fds=True,
                                    pass_fds=tuple(pass_fds), preexec_fn=setup)
            try:
                returncode = _wait(proc, limits.timeout_s)
                status = "ok" if returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                returncode, status = None, "timeout"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    finally:
        if cgroup:
            _remove_cgroup(cgroup)
    read = lambda name: (workdir / name).read_bytes()[:KEEP_OUTPUT].decode(  # noqa: E731
        "utf-8", "replace")
    return ProcessOutcome(status=status, returncode=returncode, stdout=read(".stdout"),
                          stderr=read(".stderr"), cgroup=cgroup is not None)


def fresh_workdir() -> Path:
    """A new private directory under the system temporary directory."""
    return Path(tempfile.mkdtemp(prefix="peerflow-sandbox-"))


def remove_workdir(path: Path) -> None:
    """Removes a working directory whatever the program left in it."""
    shutil.rmtree(path, ignore_errors=True)
