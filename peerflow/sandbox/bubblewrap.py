"""The default sandbox: every program runs under bubblewrap (`bwrap`), in namespaces.

bubblewrap is the sandbox under Flatpak: small, maintained, packaged everywhere
(`apt-get install bubblewrap`), and it works as root and, where the kernel allows user
namespaces, as an ordinary user. What the program gets:

* bwrap itself started as an unprivileged host uid: `HOST_UID` when this process is
  root (`setpriv` in the exec chain: no groups, no capabilities, `no_new_privs`), this
  process's own uid otherwise; never the host's uid 0, so no root-owned file (a host
  sysctl, a root-only `/proc` file, its own host-side stdout) is the program's;
* its own user (`--unshare-user`, explicitly, so `--disable-userns` applies: no nested
  user namespaces; bwrap fails, and the sandbox is unavailable, where the kernel cannot),
  mount, pid, ipc, uts, cgroup and network namespaces, as uid and gid 65534 inside with
  every capability dropped, under a seccomp filter (`peerflow.sandbox.seccomp_filter`);
* a read-only root file system that holds only `/usr` (and the `/bin`, `/lib`, … links
  into it), the interpreter's standard library, the dynamic linker's cache, a read-only
  fresh `/dev` with a `SHM_BYTES` `/dev/shm`, a read-only fresh `/proc` showing only the
  sandbox's processes, a private `/tmp`, and the program's own writable directory
  `/sandbox` (`TMP_BYTES` each): no home, no `/root`, no `/etc`, no run directory,
  dataset or reward files, no site-packages (the interpreter runs with `-I -S`; the
  standard library's site-packages is hidden);
* the packages it may import (`sandbox.packages`, a tool's own module) bound read-only
  under `/opt/peerflow-sandbox/lib`;
* an empty environment (`--clearenv`, then `PATH`, `LANG`, `HOME=/sandbox`);
* a new session (no terminal to inject into), and it dies with its parent.

Bind sources the unprivileged uid cannot search for are staged (`peerflow.sandbox.staging`).
The resource limits of `peerflow.sandbox.local` (a memory and a pids cgroup, address
space, CPU, file size, open files, the wall clock) apply to bwrap and everything under it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError
from peerflow.sandbox.local import (
    fresh_workdir,
    package_paths,
    remove_workdir,
    run_process,
    tool,
)
from peerflow.sandbox.seccomp_filter import seccomp_program
from peerflow.sandbox.staging import Stager

#: Where the program's packages are mounted inside the sandbox.
LIB = "/opt/peerflow-sandbox/lib"
#: Runs the program in `__main__` with the packages on the path (no file of ours inside;
#: compiled and run directly: `runpy` alone costs ~30 ms of imports per program).
BOOT = (f"import sys; sys.path[:0] = [{LIB!r}]; sys.argv = ['main.py']; del sys; "
        "__file__ = 'main.py'; exec(compile(open('main.py', 'rb').read(), 'main.py', 'exec'))")
INSTALL_HINT = ("install bubblewrap (`apt-get install bubblewrap`, `dnf install bubblewrap`; "
                "`bash scripts/install-cpu.sh` does it where it runs as root with apt), or set "
                "sandbox.backend=remote to send programs to a sandbox service; "
                "sandbox.backend=audit-hook is the weaker fallback (docs/rewards.md says what "
                "it does not stop)")
#: A private /tmp of at most this many bytes (tmpfs pages are not under RLIMIT_AS).
TMP_BYTES = 64 * 2**20
#: A private /dev/shm of at most this many bytes (bwrap's own would be unbounded).
SHM_BYTES = 16 * 2**20
#: The host uid and gid bubblewrap runs as when this process is root: an account of its
#: own, not the host's 0 and not `nobody` (which other daemons and NFS use), far above
#: the ranges `useradd` and `/etc/subuid` hand out (in a container whose user namespace
#: does not map it, the highest id it maps instead: `host_uid`).
HOST_UID = 2_000_000_000
#: The uid and gid the program has inside its user namespace (`nobody`).
INSIDE_ID = 65534


def _interpreter() -> tuple[str, str]:
    """The base interpreter (not a virtual environment's) and its prefix."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return executable, os.path.realpath(sys.base_prefix)


def _root_binds(stager: Stager) -> list[str]:
    """`/usr`, the top-level links into it (or the directories themselves), ld.so.cache."""
    args = ["--ro-bind", stager.reach("/usr"), "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", stager.reach(top), top]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", stager.reach("/etc/ld.so.cache"), "/etc/ld.so.cache"]
    return args


@functools.cache
def _hidden_paths() -> tuple[str, ...]:
    """Every site-packages of the interpreter's prefix and of the system's (fixed)."""
    _, prefix = _interpreter()
    hidden = {sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})[key]
              for key in ("purelib", "platlib")}
    hidden |= {str(p) for p in Path(prefix, "lib").glob("python3*/dist-packages")}
    for system in ("/usr/lib", "/usr/local/lib"):
        hidden |= {str(p) for p in Path(system).glob("python3*/*-packages")}
    return tuple(sorted(p for p in hidden if os.path.isdir(p)))


def _interpreter_binds(stager: Stager) -> list[str]:
    """The interpreter and its standard library; every site-packages hidden."""
    executable, prefix = _interpreter()
    args = []
    if not executable.startswith("/usr/"):
        args += ["--ro-bind", stager.reach(executable), executable]
    lib = os.path.join(prefix, "lib")
    if not lib.startswith("/usr/") and os.path.isdir(lib):
        args += ["--ro-bind", stager.reach(lib), lib]
    for path in _hidden_paths():
        args += ["--tmpfs", path, "--remount-ro", path]
    return args


def _package_binds(packages: Sequence[str], stager: Stager) -> list[str]:
    args = []
    for name, path in package_paths(packages).items():
        target = f"{LIB}/{name}" if os.path.isdir(path) else f"{LIB}/{os.path.basename(path)}"
        args += ["--ro-bind", stager.reach(path), target]
    return args


@functools.cache
def bwrap_path() -> str | None:
    """`bwrap` on this process's `PATH`, resolved here: the exec chain runs with a fixed one."""
    found = shutil.which("bwrap")
    return os.path.realpath(found) if found else None


def id_ranges(path: str) -> list[range]:
    """The ids this process's user namespace holds (`/proc/self/uid_map`, `gid_map`)."""
    try:
        with open(path) as lines:
            return [range(int(inside), int(inside) + int(count))
                    for inside, _, count in (line.split() for line in lines if line.strip())]
    except (OSError, ValueError):
        return []


@functools.cache
def drop_id() -> int:
    """The id root drops to: `HOST_UID`, where this user namespace maps it.

    Else the highest id but 0 that both the uid and the gid map hold (a container whose
    namespace maps 0-65535: 65535); a namespace that maps only 0 gets `HOST_UID`, which
    `setpriv` then refuses, and the sandbox is unavailable (it fails closed).
    """
    uids, gids = id_ranges("/proc/self/uid_map"), id_ranges("/proc/self/gid_map")
    if any(HOST_UID in r for r in uids) and any(HOST_UID in r for r in gids):
        return HOST_UID
    common = [min(u.stop, g.stop) - 1 for u in uids for g in gids
              if max(u.start, g.start) < min(u.stop, g.stop)]
    return max([c for c in common if c > 0], default=HOST_UID)


def host_uid() -> int | None:
    """The uid (and gid) bubblewrap runs as when this process is root (`drop_id`).

    `None` means "this process's uid": an unprivileged user, which the kernel lets map
    only itself.
    """
    return drop_id() if os.geteuid() == 0 else None


def drop_argv() -> list[str]:
    """`setpriv …`: the link of the exec chain that leaves root for `HOST_UID` (or none).

    It clears the supplementary groups and the inheritable, ambient and bounding
    capability sets and sets no_new_privs, so nothing of root's survives the exec of bwrap.
    """
    uid = host_uid()
    if uid is None:
        return []
    return [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def namespace_args() -> list[str]:
    """The namespaces: every one, the user namespace explicitly, no nested user ones.

    `--unshare-user` is explicit because bwrap drops `--disable-userns` without it (as
    root `--unshare-all` only tries one); bwrap exits with an error, which
    `bwrap_unavailable` reports, where the kernel cannot do either: it fails closed.
    """
    return ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(INSIDE_ID),
            "--gid", str(INSIDE_ID), "--cap-drop", "ALL", "--die-with-parent",
            "--new-session", "--hostname", "sandbox"]


def _probe() -> str | None:
    """Runs `true` under bwrap the way programs run; the error text, or `None` when it ran."""
    workdir = fresh_workdir()
    stager = Stager(host_uid())
    argv = [bwrap_path(), *namespace_args(), *_root_binds(stager), "--proc", "/proc",
            "--dev", "/dev", "--", "true"]
    try:
        outcome = run_process(argv, workdir, "", SandboxLimits(timeout_s=30.0),
                              env={"PATH": "/usr/bin:/bin"}, wrap=drop_argv(),
                              stages=stager.pairs(), nproc_uid=host_uid())
    except (OSError, SandboxUnavailableError) as exc:
        return str(exc)
    finally:
        remove_workdir(workdir)
    if outcome.status == "ok":
        return None
    return outcome.stderr.strip() or f"{outcome.status}, exit {outcome.returncode}"


@functools.cache
def bwrap_unavailable() -> str | None:
    """Why bubblewrap cannot sandbox here (naming the fix), or `None` when it can.

    Checked by running a real program the way every program runs, so an old bubblewrap
    that lacks an option, a kernel that refuses the unprivileged user namespace or
    `--disable-userns`, or an interpreter it cannot mount, is found here.
    """
    if bwrap_path() is None:
        return f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}."
    error = _probe()
    if error is not None:
        return (f"bubblewrap is installed but cannot create its namespaces here ({error}); "
                f"it runs as the unprivileged host uid {host_uid() or os.geteuid()} with "
                "its own user namespace and no nested ones (bubblewrap >= 0.8): allow "
                "unprivileged user namespaces (`sysctl user.max_user_namespaces=10000`, "
                "`sysctl kernel.unprivileged_userns_clone=1`, on Ubuntu >= 23.10 "
                "`sysctl kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor "
                "profile for bwrap); in a container whose user namespace maps only root, "
                "map more ids to it; or " + INSTALL_HINT.split(", or ", 1)[1] + ".")
    try:
        trial = _run("print('ok')", "", SandboxLimits(timeout_s=30.0), ())
    except SandboxUnavailableError as exc:
        return f"{exc} (bubblewrap >= 0.8 is needed); {INSTALL_HINT}."
    if trial.stdout != "ok\n":
        return (f"a trial program under bubblewrap printed {trial.stdout!r} "
                f"({trial.stderr.strip()[-500:]!r}); {INSTALL_HINT}.")
    return None


def bwrap_argv(program_fd: int, packages: Sequence[str], status_fd: int,
               stager: Stager, seccomp_fd: int | None = None) -> list[str]:
    """The whole command line: bwrap's options, then the interpreter and its bootstrap.

    The program is copied from `program_fd` into `/sandbox/main.py`, on a tmpfs of its
    own (`TMP_BYTES`, like `/tmp`): nothing the program writes reaches the host's disk.
    `/dev/shm` is a tmpfs of `SHM_BYTES`; `/`, `/dev` and `/proc` are read-only.
    bwrap writes `{"child-pid": N}` to `status_fd` once the sandbox is set up, which
    tells its own failures from the program's (whatever the program prints). With
    `seccomp_fd` it loads that BPF program (`seccomp_filter`) just before the program.
    """
    executable, _ = _interpreter()
    seccomp = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
    return [
        bwrap_path(), "--json-status-fd", str(status_fd), *namespace_args(), *seccomp,
        *_root_binds(stager), *_interpreter_binds(stager), *_package_binds(packages, stager),
        "--proc", "/proc", "--remount-ro", "/proc",
        "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
        "--size", str(TMP_BYTES), "--tmpfs", "/sandbox",
        "--file", str(program_fd), "/sandbox/main.py", "--remount-ro", "/",
        "--chdir", "/sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "HOME", "/sandbox", "--setenv", "PYTHONHASHSEED", "0",
        "--", executable, "-I", "-S", "-B", "-c", BOOT,
    ]


class BubblewrapSandbox(Sandbox):
    """Each program in its own bubblewrap namespaces (see the module docstring)."""

    name: ClassVar[str] = "bubblewrap"

    @classmethod
    def unavailable(cls) -> str | None:
        """Why bwrap cannot run here (`bwrap_unavailable`)."""
        return bwrap_unavailable()

    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None,
            packages: Sequence[str] = ()) -> SandboxResult:
        """Runs one program (see `Sandbox.run`)."""
        why = bwrap_unavailable()
        if why is not None:
            raise SandboxUnavailableError(why)
        return _run(program, stdin, limits or SandboxLimits(), packages)


def _run(program: str, stdin: str, limits: SandboxLimits,
         packages: Sequence[str]) -> SandboxResult:
    """One program under bwrap (the host keeps only its stdin, outputs and bwrap's status).

    Raises:
        SandboxUnavailableError: when bwrap itself did not start the program.
    """
    workdir = fresh_workdir()
    try:
        (workdir / "main.py").write_text(program)
        stager = Stager(host_uid())
        seccomp = seccomp_program()
        (workdir / ".seccomp").write_bytes(seccomp or b"")
        with open(workdir / "main.py", "rb") as source, \
                open(workdir / ".status", "wb") as status, \
                open(workdir / ".seccomp", "rb") as rules:
            fds = [source.fileno(), status.fileno(), rules.fileno()]
            argv = bwrap_argv(fds[0], packages, fds[1], stager,
                              fds[2] if seccomp is not None else None)
            outcome = run_process(argv, workdir, stdin, limits, env={"PATH": "/usr/bin:/bin"},
                                  wrap=drop_argv(), pass_fds=fds, stages=stager.pairs(),
                                  nproc_uid=host_uid())
        started = b"child-pid" in (workdir / ".status").read_bytes()
    finally:
        remove_workdir(workdir)
    if not started and outcome.status != "timeout":
        raise SandboxUnavailableError(f"bubblewrap failed to start the program: "
                                      f"{outcome.stderr.strip()[-2000:]}")
    return SandboxResult(
        status=outcome.status, returncode=outcome.returncode, stdout=outcome.stdout,
        stderr=outcome.stderr, network_isolated=True,
        process_limit="cgroup" if outcome.cgroup else "rlimit")
