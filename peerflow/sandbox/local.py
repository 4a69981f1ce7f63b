"""What both local sandboxes share: directory, limits, cgroups, clock, packages.

A local sandbox builds an argv (`bwrap … python …` or `python guard.py`) and hands it to
`run_process`, which starts it in its own session through an exec chain of small trusted
tools, so that nothing runs in the forked child between `fork` and `exec` (no
`preexec_fn`: the subprocess docs warn it can deadlock when threads exist, and tool calls
run from up to 64 threads):

1. `/bin/sh -c JOIN` (only where there is a cgroup to join or a path to stage): writes its
   own pid into the program's fresh pids and memory cgroups (root with writable
   controllers), so everything it becomes and starts is counted from the first
   instruction; then bind-mounts the staged paths (`peerflow.sandbox.staging`) in the
   private mount namespace `unshare --mount` gave it;
2. `prlimit`: the rlimits (address space, CPU seconds, file size, open files, no core
   files, and `RLIMIT_NPROC` where no pids cgroup counts the processes);
3. what the sandbox puts before its own tool (bubblewrap's drop to an unprivileged uid).

`run_process` waits at most `timeout_s`, then kills the whole process group and removes
the cgroups.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from peerflow.sandbox.base import SandboxLimits, SandboxUnavailableError

#: Where a pids cgroup may be made (cgroup v1 pids hierarchy, then the v2 root).
PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
#: Where a memory cgroup may be made (cgroup v1 memory hierarchy, then the v2 root).
MEMORY_ROOTS = ("/sys/fs/cgroup/memory", "/sys/fs/cgroup")
#: The cgroup v1 memory hierarchy and the cgroup v2 root.
V1_MEMORY, V2 = "/sys/fs/cgroup/memory", "/sys/fs/cgroup"
#: At most this much of each output stream is kept.
KEEP_OUTPUT = 1 << 20
#: The first link of the chain: joins the cgroups named before the first `--`, bind-mounts
#: the (source, target) pairs before the second, then becomes the rest. Constant text;
#: every path travels as an argument.
JOIN = ('p=$$; while [ "$1" != -- ]; do echo "$p" > "$1" || exit 125; shift; done; shift; '
        'while [ "$1" != -- ]; do /bin/mount --bind "$1" "$2" || exit 125; shift 2; done; '
        'shift; exec "$@"')
TOOLS_HINT = "install util-linux (`apt-get install util-linux`), which ships it"


@attrs.frozen(kw_only=True)
class ProcessOutcome:
    """How a sandboxed process ended, before a sandbox adds what it knows."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    cgroup: bool
    """Whether a pids cgroup limited the processes."""
    memory_cgroup: bool = False
    """Whether a memory cgroup limited the program's memory (all processes, tmpfs pages)."""


@functools.cache
def tool(name: str) -> str:
    """The absolute path of a trusted system tool (`prlimit`, `setpriv`, `unshare`).

    Raises:
        SandboxUnavailableError: naming the package to install.
    """
    for directory in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    raise SandboxUnavailableError(f"the sandbox needs `{name}`, which is not installed: "
                                  f"{TOOLS_HINT}.")


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


def own_cgroup(root: str) -> str:
    """Where in the cgroup v1 hierarchy `root` (`/sys/fs/cgroup/memory`) this process is.

    A program's cgroup is made there, so what it uses is charged to this process's own
    cgroup too (a job's, a container's, a systemd service's limit): made at the root of
    the hierarchy it would be outside them. `root` itself for cgroup v2 (where a cgroup
    with processes cannot hold the controllers a child needs), or where the own cgroup
    is not found or not writable.
    """
    controller = os.path.basename(root)
    if root == V2:
        return root
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                own = os.path.join(root, path.lstrip("/"))
                if os.path.isfile(os.path.join(own, "cgroup.procs")) \
                        and os.access(own, os.W_OK):
                    return own
    return root


def _make_cgroup(roots: Sequence[str], settings: dict[str, str]) -> str | None:
    """A fresh cgroup under the first root that takes every setting, or `None`.

    Under cgroup v1 it is made in this process's own cgroup of the hierarchy
    (`own_cgroup`). A setting whose name ends in `?` is written only where the cgroup
    has that file (`memory.memsw.limit_in_bytes` exists only with swap accounting).
    """
    if os.geteuid() != 0:
        return None
    for root in map(own_cgroup, roots):
        if not os.path.isfile(os.path.join(root, "cgroup.procs")):
            continue
        try:
            path = tempfile.mkdtemp(prefix="peerflow-sandbox-", dir=root)
        except OSError:
            continue
        try:
            for key, value in settings.items():
                name = key.rstrip("?")
                if name != key and not os.path.isfile(os.path.join(path, name)):
                    continue
                Path(path, name).write_text(value)
            return path
        except OSError:
            _remove_cgroup(path)
    return None


def make_pids_cgroup(max_processes: int) -> str | None:
    """A fresh cgroup limited to `max_processes` tasks, or `None` where none can be made."""
    return _make_cgroup(PIDS_ROOTS, {"pids.max": str(max_processes)})



@functools.cache
def memory_cgroup_root() -> str | None:
    """Where a memory cgroup can be made here (root with a writable controller), or `None`."""
    if os.geteuid() != 0:
        return None
    if os.path.isfile(f"{V1_MEMORY}/memory.limit_in_bytes") and os.access(V1_MEMORY, os.W_OK):
        return V1_MEMORY
    with contextlib.suppress(OSError):
        if "memory" in Path(V2, "cgroup.subtree_control").read_text().split() \
                and os.access(V2, os.W_OK):
            return V2
    return None


def make_cgroups(limits: SandboxLimits) -> tuple[str | None, str | None]:
    """The program's fresh (pids, memory) cgroups; `None` for one that cannot be made.

    The memory cgroup holds `memory_mb` MiB in all, swap included: it counts what
    `RLIMIT_AS` cannot, the memory of all the program's processes together and the pages
    of its tmpfs mounts (`/tmp`, `/sandbox`, `/dev/shm`). On cgroup v2, where a process is
    in exactly one cgroup, both limits are set on the same one (and it is returned twice).
    """
    limit = str(limits.memory_mb * 2**20)
    memory_root = memory_cgroup_root()
    if memory_root == V2:
        both = _make_cgroup((V2,), {"memory.max": limit, "memory.swap.max?": "0",
                                    "pids.max?": str(limits.max_processes)})
        pids_limited = both is not None and os.path.isfile(os.path.join(both, "pids.max"))
        return (both if pids_limited else None), both
    memory = None if memory_root is None else _make_cgroup(
        (memory_root,), {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes?": limit})
    pids = _make_cgroup(PIDS_ROOTS[:1], {"pids.max": str(limits.max_processes)}) \
        or (None if memory_root else make_pids_cgroup(limits.max_processes))
    return pids, memory


def _capped(kind: int, value: int) -> int:
    """`value`, lowered to this process's hard limit (which a child cannot raise)."""
    _, hard = resource.getrlimit(kind)
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def user_processes(uid: int) -> int:
    """How many processes `uid` runs now (what `RLIMIT_NPROC` counts)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def rlimit_argv(limits: SandboxLimits, nproc: int | None) -> list[str]:
    """`prlimit … --`: the limits every process of the program starts with.

    `nproc` is `RLIMIT_NPROC` (counted per user: the user's running processes plus the
    headroom), or `None` where a pids cgroup counts them.
    """
    settings = [("as", resource.RLIMIT_AS, limits.memory_mb * 2**20),
                ("cpu", resource.RLIMIT_CPU, int(limits.timeout_s) + 1),
                ("fsize", resource.RLIMIT_FSIZE, limits.max_output_mb * 2**20),
                ("nofile", resource.RLIMIT_NOFILE, 64), ("core", resource.RLIMIT_CORE, 0)]
    if nproc is not None:
        settings.append(("nproc", resource.RLIMIT_NPROC, nproc))
    return [tool("prlimit"), *(f"--{name}={_capped(kind, value)}"
                               for name, kind, value in settings), "--"]


def exec_chain(cgroups: Sequence[str], stages: Sequence[tuple[str, str]]) -> list[str]:
    """The links before `prlimit`: join `cgroups`, bind `stages` (see the module docstring).

    Empty when there is nothing to do (an unprivileged host, nothing staged).
    """
    if not cgroups and not stages:
        return []
    chain = [tool("unshare"), "--mount", "--propagation", "private", "--"] if stages else []
    return [*chain, "/bin/sh", "-c", JOIN, "sh", *(f"{c}/cgroup.procs" for c in cgroups),
            "--", *(path for pair in stages for path in pair), "--"]


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
                env: dict[str, str], wrap: Sequence[str] = (), pass_fds: Sequence[int] = (),
                stages: Sequence[tuple[str, str]] = (),
                nproc_uid: int | None = None) -> ProcessOutcome:
    """Runs `argv` in `workdir` under `limits` and returns how it ended.

    Args:
        argv: The command (a sandbox tool or an interpreter).
        workdir: An existing directory for the process and its captured output (the
            host-side files are created here by this process: root's where it is root).
        stdin: The program's standard input.
        limits: Its limits; the whole process group is killed past `timeout_s`.
        env: The process's whole environment.
        wrap: Links of the exec chain between `prlimit` and `argv` (e.g. `setpriv …` or
            `unshare --net`).
        pass_fds: Descriptors the child keeps (e.g. bwrap's status pipe).
        stages: (source, mount point) pairs bind-mounted for `argv` alone, as root.
        nproc_uid: The host uid the program runs as (its processes are counted under
            it where no pids cgroup can be made); default this process's.
    """
    pids, memory = make_cgroups(limits)
    cgroups = list(dict.fromkeys(c for c in (pids, memory) if c))
    uid = os.geteuid() if nproc_uid is None else nproc_uid
    nproc = None if pids or uid == 0 else user_processes(uid) + limits.max_processes
    try:
        command = [*exec_chain(cgroups, stages), *rlimit_argv(limits, nproc), *wrap, *argv]
        returncode, status = _start_and_wait(command, workdir, stdin, limits, env, pass_fds)
    finally:
        for cgroup in cgroups:
            _remove_cgroup(cgroup)
    read = lambda name: (workdir / name).read_bytes()[:KEEP_OUTPUT].decode(  # noqa: E731
        "utf-8", "replace")
    return ProcessOutcome(status=status, returncode=returncode, stdout=read(".stdout"),
                          stderr=read(".stderr"), cgroup=pids is not None,
                          memory_cgroup=memory is not None)


def _start_and_wait(command: list[str], workdir: Path, stdin: str, limits: SandboxLimits,
                    env: dict[str, str], pass_fds: Sequence[int]) -> tuple[int | None, str]:
    """Starts `command` in its own session, waits, kills its process group; (code, status)."""
    # 0600: the program cannot open it again through /proc/1/fd/0 (bwrap's init holds it)
    with open(os.open(workdir / ".stdin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
              "w") as held:
        held.write(stdin)
    with open(workdir / ".stdin", "rb") as fin, \
            open(workdir / ".stdout", "wb") as fout, open(workdir / ".stderr", "wb") as ferr:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=fin, stdout=fout,
                                stderr=ferr, start_new_session=True, close_fds=True,
                                pass_fds=tuple(pass_fds))
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
    return returncode, status


def fresh_workdir() -> Path:
    """A new private directory under the system temporary directory."""
    return Path(tempfile.mkdtemp(prefix="peerflow-sandbox-"))


def remove_workdir(path: Path) -> None:
    """Removes a working directory whatever the program left in it."""
    shutil.rmtree(path, ignore_errors=True)
