"""The default sandbox: every program runs under bubblewrap (`bwrap`), in namespaces.

bubblewrap is the sandbox under Flatpak: small, maintained, packaged everywhere
(`apt-get install bubblewrap`), and it works as root and, where the kernel allows user
namespaces, as an ordinary user. What the program gets:

* its own user, mount, pid, ipc, uts, cgroup and network namespaces (`--unshare-all`),
  as user and group 65534 (`nobody`) with every capability dropped, and no further user
  namespaces (`--disable-userns`, where the kernel supports it);
* a root file system that holds only `/usr` (and the `/bin`, `/lib`, … links into it),
  the interpreter's standard library, the dynamic linker's cache, a fresh `/dev`, a
  fresh `/proc` showing only the sandbox's processes, a private `/tmp`, and the program's
  own writable directory `/sandbox` — all read-only but `/sandbox` and `/tmp`: no home,
  no `/root`, no `/etc`, no run directory, dataset or reward files, no site-packages
  (the interpreter runs with `-I -S`; the standard library's site-packages is hidden);
* the packages it may import (`sandbox.packages`, a tool's own module) bound read-only
  under `/opt/peerflow-sandbox/lib`;
* an empty environment (`--clearenv`, then `PATH`, `LANG`, `HOME=/sandbox`);
* a new session (no terminal to inject into), and it dies with its parent.

The resource limits of `peerflow.sandbox.local` (address space, CPU, file size, open
files, a pids cgroup, the wall clock) apply to bwrap and everything under it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError
from peerflow.sandbox.local import fresh_workdir, package_paths, remove_workdir, run_process

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


def _interpreter() -> tuple[str, str]:
    """The base interpreter (not a virtual environment's) and its prefix."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return executable, os.path.realpath(sys.base_prefix)


@functools.cache
def _root_binds() -> tuple[str, ...]:
    """`/usr`, the top-level links into it (or the directories themselves), ld.so.cache.

    Fixed for the life of the process, like `_interpreter_binds`: computed once.
    """
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return tuple(args)


@functools.cache
def _interpreter_binds() -> tuple[str, ...]:
    """The interpreter and its standard library; every site-packages hidden."""
    executable, prefix = _interpreter()
    args = []
    if not executable.startswith("/usr/"):
        args += ["--ro-bind", executable, executable]
    lib = os.path.join(prefix, "lib")
    if not lib.startswith("/usr/") and os.path.isdir(lib):
        args += ["--ro-bind", lib, lib]
    hidden = {sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})[key]
              for key in ("purelib", "platlib")}
    hidden |= {str(p) for p in Path(prefix, "lib").glob("python3*/dist-packages")}
    for system in ("/usr/lib", "/usr/local/lib"):
        hidden |= {str(p) for p in Path(system).glob("python3*/*-packages")}
    for path in sorted(hidden):
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
    return tuple(args)


def _package_binds(packages: Sequence[str]) -> list[str]:
    args = []
    for name, path in package_paths(packages).items():
        target = f"{LIB}/{name}" if os.path.isdir(path) else f"{LIB}/{os.path.basename(path)}"
        args += ["--ro-bind", path, target]
    return args


@functools.cache
def _disable_userns_works() -> bool:
    """`--disable-userns` needs bubblewrap ≥ 0.8 and a kernel that can refuse them."""
    return _probe(["--disable-userns"]) is None


def _probe(extra: list[str]) -> str | None:
    """Runs `true` under bwrap with `extra`; the error text, or `None` when it ran."""
    try:
        done = subprocess.run(
            ["bwrap", "--unshare-all", "--uid", "65534", "--gid", "65534", *extra,
             *_root_binds(), "--proc", "/proc", "--dev", "/dev", "--die-with-parent",
             "--", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@functools.cache
def bwrap_unavailable() -> str | None:
    """Why bubblewrap cannot sandbox here (naming the fix), or `None` when it can.

    Checked by running a real program the way every program runs, so an old bubblewrap
    that lacks an option, or an interpreter it cannot mount, is found here.
    """
    if shutil.which("bwrap") is None:
        return f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}."
    error = _probe([])
    if error is not None:
        return (f"bubblewrap is installed but cannot create its namespaces here ({error}): "
                "allow user namespaces (`sysctl kernel.unprivileged_userns_clone=1`, or "
                "run as root), or " + INSTALL_HINT.split(", or ", 1)[1] + ".")
    try:
        trial = _run("print('ok')", "", SandboxLimits(timeout_s=30.0), ())
    except SandboxUnavailableError as exc:
        return f"{exc} (bubblewrap >= 0.8 is needed); {INSTALL_HINT}."
    if trial.stdout != "ok\n":
        return (f"a trial program under bubblewrap printed {trial.stdout!r} "
                f"({trial.stderr.strip()[-500:]!r}); {INSTALL_HINT}.")
    return None


def bwrap_argv(program_fd: int, packages: Sequence[str], status_fd: int) -> list[str]:
    """The whole command line: bwrap's options, then the interpreter and its bootstrap.

    The program is copied from `program_fd` into `/sandbox/main.py`, on a tmpfs of its
    own (`TMP_BYTES`, like `/tmp`): nothing the program writes reaches the host's disk.
    bwrap writes `{"child-pid": N}` to `status_fd` once the sandbox is set up, which
    tells its own failures from the program's (whatever the program prints).
    """
    executable, _ = _interpreter()
    hardening = ["--disable-userns"] if _disable_userns_works() else []
    return [
        "bwrap", "--json-status-fd", str(status_fd), "--unshare-all", "--uid", "65534",
        "--gid", "65534", *hardening,
        "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox",
        *_root_binds(), *_interpreter_binds(), *_package_binds(packages),
        "--proc", "/proc", "--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
        "--size", str(TMP_BYTES), "--tmpfs", "/sandbox",
        "--file", str(program_fd), "/sandbox/main.py", "--chdir", "/sandbox",
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
        with open(workdir / "main.py", "rb") as source, \
                open(workdir / ".status", "wb") as status:
            fds = [source.fileno(), status.fileno()]
            outcome = run_process(bwrap_argv(fds[0], packages, fds[1]), workdir, stdin, limits,
                                  env={"PATH": "/usr/bin:/bin"}, pass_fds=fds)
        started = b"child-pid" in (workdir / ".status").read_bytes()
    finally:
        remove_workdir(workdir)
    if not started and outcome.status != "timeout":
        raise SandboxUnavailableError(f"bubblewrap failed to start the program: "
                                      f"{outcome.stderr.strip()[-2000:]}")
    return SandboxResult(
        status=outcome.status, returncode=outcome.returncode, stdout=outcome.stdout,
        stderr=outcome.stderr, network_isolated=True,
        process_limit="cgroup" if outcome.cgroup else "none" if os.geteuid() == 0
        else "rlimit")
