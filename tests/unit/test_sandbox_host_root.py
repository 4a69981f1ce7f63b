"""Issue 49, breaks 1, 2 and 7: bubblewrap started by root must not hand the program root.

Each attack runs through the real entry point (`run_sandboxed`, the bubblewrap backend)
as the test process's user, root on CI and on this project's machines, which is the case
that matters. On 38f2e94 every one of them escaped: the uid map read `65534 0 1`, so the
program was the host's uid 0 without capabilities, and owned every root file it could see.
"""

from __future__ import annotations

import os
import platform
import threading

import pytest

from peerflow.sandbox import SandboxLimits, configure, run_sandboxed
from peerflow.sandbox.bubblewrap import bwrap_unavailable
from peerflow.sandbox.config import SandboxConfig

pytestmark = pytest.mark.skipif(bwrap_unavailable() is not None,
                                reason=f"{bwrap_unavailable()}")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are about root hosts")

LIMITS = SandboxLimits(timeout_s=20.0, memory_mb=512, max_processes=16)


@pytest.fixture(autouse=True)
def _bubblewrap(monkeypatch):
    monkeypatch.setenv("PEERFLOW_SANDBOX", "")  # restored after the test
    configure(SandboxConfig(backend="bubblewrap"))


def _run(program: str, limits: SandboxLimits = LIMITS):
    return run_sandboxed(program, "", limits)


@as_root
def test_the_sandbox_user_is_not_the_hosts_root():
    # seen from the host: the program's real, effective, saved and filesystem uids
    from peerflow.sandbox import current
    from peerflow.sandbox.identity import sandbox_identity

    identity = sandbox_identity(current())
    assert identity.inside_uid == 65534
    assert not identity.host_root, identity.meaning()
    from peerflow.sandbox.bubblewrap import HOST_UID
    assert identity.host_uids == (HOST_UID,) * 4, identity.meaning()
    assert identity.host_caps == "0000000000000000"
    assert f"host uid {HOST_UID}, an unprivileged account" in identity.meaning()


@as_root
@pytest.mark.parametrize("path", ["/proc/sys/kernel/core_pattern",
                                  "/proc/sys/fs/lease-break-time", "/proc/sys/vm/drop_caches"])
def test_host_sysctls_cannot_be_opened_for_writing(path):
    # an O_WRONLY open without a write: nothing on the host changes even where it escapes
    result = _run(f"import os\nos.open({path!r}, os.O_WRONLY)\nprint('escaped')")
    assert "escaped" not in result.stdout
    assert result.status == "error" and ("Permission denied" in result.stderr
                                         or "Read-only file system" in result.stderr)


@as_root
@pytest.mark.parametrize("path", ["/proc/kpageflags", "/proc/slabinfo", "/proc/timer_list"])
def test_root_only_proc_files_cannot_be_read(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this kernel")
    result = _run(f"open({path!r}, 'rb').read(64)\nprint('escaped')")
    assert "escaped" not in result.stdout and "Permission denied" in result.stderr


NESTED_USERNS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) == 0:
    print("escaped")
else:
    print(os.strerror(ctypes.get_errno()))
"""


def test_no_nested_user_namespace():
    result = _run(NESTED_USERNS)
    assert result.status == "ok" and "escaped" not in result.stdout, result.stdout


MOUNT_CGROUP = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.unshare(0x10000000 | 0x00020000 | 0x02000000)  # user, mount and cgroup namespaces
os.makedirs("/tmp/cg", exist_ok=True)
for fstype, data in ((b"cgroup", b"pids"), (b"cgroup", b"memory"), (b"cgroup2", None)):
    if libc.mount(b"none", b"/tmp/cg", fstype, 0, data) == 0:
        print("escaped", fstype.decode())
        break
else:
    print(os.strerror(ctypes.get_errno()))
"""


def test_cgroups_cannot_be_mounted():
    result = _run(MOUNT_CGROUP)
    assert result.status == "ok" and "escaped" not in result.stdout, result.stdout


FILL = """
import os
written = 0
try:
    for i in range(64):
        with open(f"{where}/fill{{i}}", "wb") as f:
            for _ in range(4):
                f.write(b"x" * 2**20)
                written += 1
except OSError as exc:
    print(written, exc.strerror)
else:
    print(written, "escaped")
"""


@pytest.mark.parametrize("where", ["", "/dev/shm", "/dev"])
def test_root_and_dev_shm_are_bounded(where):
    # 256 MiB in 4 MiB files (each under the 8 MiB file-size limit): past every bound
    result = _run(FILL.format(where=where), LIMITS)
    written = int(result.stdout.split()[0]) if result.stdout else 0
    assert "escaped" not in result.stdout and written <= 64, (result.stdout, result.stderr)


@as_root
def test_the_host_side_stdout_cannot_be_chmodded():
    result = _run("import os\nos.fchmod(1, 0o777)\nos.fchmod(2, 0o777)\nprint('escaped')")
    assert "escaped" not in result.stdout and "Operation not permitted" in result.stderr


def test_a_program_cannot_outgrow_its_memory_across_processes():
    # each child stays under the per-process address-space limit; together they do not
    program = """
import os
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.read(os.open("/sandbox/main.py", os.O_RDONLY), 1)
        import time; time.sleep(3)
        os._exit(0)
    kids.append(pid)
ok = sum(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)
print("escaped" if ok == 6 else f"{ok} of 6")
"""
    result = _run(program, SandboxLimits(timeout_s=30.0, memory_mb=512, max_processes=16))
    from peerflow.sandbox.local import memory_cgroup_root
    if memory_cgroup_root() is None:
        pytest.skip("no writable memory cgroup here: only RLIMIT_AS, per process")
    assert "escaped" not in result.stdout, (result.stdout, result.stderr)


def test_32_programs_from_32_threads_at_once():
    results: list = [None] * 32

    def one(i: int) -> None:
        results[i] = _run(f"print({i} * 2)", SandboxLimits(timeout_s=60.0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a sandboxed start deadlocked"
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(32)]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system call numbers")
def test_the_seccomp_filter_refuses_keyrings_ptrace_and_namespaces():
    from peerflow.sandbox.seccomp_filter import INSTALL_HINT, seccomp_program

    if seccomp_program() is None:
        pytest.skip(f"no libseccomp binding here: {INSTALL_HINT}")
    program = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
said = []
for name, number, args in (("keyctl", 250, (0, 0, 0, 0)), ("ptrace", 101, (16, 1, 0, 0)),
                           ("setns", 308, (0, 0, 0, 0)), ("bpf", 321, (0, 0, 0, 0))):
    said.append((name, libc.syscall(number, *args), errno.errorcode[ctypes.get_errno()]))
print(said, open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
"""
    result = _run(program)
    assert result.status == "ok", result.stderr
    assert result.stdout == ("[('keyctl', -1, 'EPERM'), ('ptrace', -1, 'EPERM'), "
                             "('setns', -1, 'EPERM'), ('bpf', -1, 'EPERM')] 2\n")


@as_root
def test_sandbox_check_prints_the_uid_map_and_what_it_means(capsys):
    import argparse
    import json

    from peerflow.cli.sandbox_cmd import run_check
    from peerflow.sandbox.bubblewrap import HOST_UID

    args = argparse.Namespace(backend="bubblewrap", url=None, token_env=None, json=True)
    code = run_check(args)
    report = json.loads(capsys.readouterr().out)
    assert code == 0, [e for e in report["escapes"] if not e["held"]]
    assert report["uid_map_inside"] == "65534 0 1" and report["uid_inside"] == 65534
    assert report["host_uids"] == [HOST_UID] * 4
    assert f"host uid {HOST_UID}, an unprivileged account" in report["meaning"]
    names = {e["name"] for e in report["escapes"]}
    assert {"run as the host's root", "open a host sysctl for writing",
            "read a root-only /proc file", "create a nested user namespace",
            "mount a cgroup hierarchy", "fill / with 256 MiB", "fill /dev/shm with 256 MiB",
            "fchmod its host-side stdout"} <= names
    forgeries = {e["name"]: e for e in report["escapes"] if e["name"].startswith("reward: ")}
    assert len(names) == 18 + len(forgeries) and len(forgeries) >= 10
    assert forgeries["reward: right"]["detail"].startswith("scored 1.00")
    assert forgeries["reward: os._exit(0) after a wrong answer"]["detail"].startswith(
        "scored 0.00")


def test_a_path_under_an_unsearchable_directory_is_staged_below_it(tmp_path):
    from peerflow.sandbox.staging import staged_root

    private = tmp_path / "home"  # like /root: 0700
    (private / "pyenv" / "bin").mkdir(parents=True)
    private.chmod(0o700)
    tmp_path.chmod(0o755)
    nobody = 2_000_000_001
    assert staged_root(str(private / "pyenv" / "bin"), nobody) == str(private / "pyenv")
    assert staged_root("/usr/bin", nobody) is None


def test_root_in_a_container_drops_to_an_id_its_namespace_maps(monkeypatch):
    import peerflow.sandbox.bubblewrap as bubblewrap

    def maps(*ranges):
        monkeypatch.setattr(bubblewrap, "id_ranges", lambda path: list(ranges))
        bubblewrap.drop_id.cache_clear()
        return bubblewrap.drop_id()

    try:
        assert maps(range(0, 2**32 - 1)) == bubblewrap.HOST_UID  # the host's own namespace
        assert maps(range(0, 65536)) == 65535  # rootless podman, docker userns-remap
        assert maps(range(0, 1)) == bubblewrap.HOST_UID  # only root: setpriv refuses it
    finally:
        monkeypatch.undo()
        bubblewrap.drop_id.cache_clear()


def _memory_cgroup_of_this_process() -> str | None:
    """This process's cgroup v1 memory cgroup, when it is not the hierarchy's root."""
    from pathlib import Path
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and path != "/":
            return "/sys/fs/cgroup/memory" + path
    return None


@as_root
@pytest.mark.skipif(_memory_cgroup_of_this_process() is None
                    or not os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                    reason="needs cgroup v1 memory, this process below its root")
def test_a_programs_memory_is_charged_to_this_process_s_own_cgroup():
    """Its cgroup made at the hierarchy's root would be outside a job's or pod's limit."""
    own = _memory_cgroup_of_this_process()
    inside: set[str] = set()
    done = threading.Event()

    def watch():
        while not done.wait(0.02):
            inside.update(n for n in os.listdir(own) if n.startswith("peerflow-sandbox-"))
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = _run("import time\nx = bytearray(64 * 2**20)\ntime.sleep(1)\nprint('ok')")
    finally:
        done.set()
        watcher.join()
    assert result.stdout == "ok\n", result.stderr
    assert inside  # the program's cgroup was made in this process's own


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system call numbers")
def test_the_seccomp_filter_refuses_io_uring_and_pidfd_getfd():
    """io_uring's operations are not seen by seccomp, and its kernel code is a frequent
    source of privilege escalations (Docker's default profile refuses it); `pidfd_getfd`
    copied bwrap init's host-side stdin and stdout (`test_tool_result_forgery`)."""
    from peerflow.sandbox.seccomp_filter import INSTALL_HINT, seccomp_program

    if seccomp_program() is None:
        pytest.skip(f"no libseccomp binding here: {INSTALL_HINT}")
    program = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
said = [("io_uring_setup", libc.syscall(425, 4, params), errno.errorcode.get(ctypes.get_errno()))]
pidfd = os.pidfd_open(1)
said.append(("pidfd_getfd", libc.syscall(438, pidfd, 1, 0),
             errno.errorcode.get(ctypes.get_errno())))
print(said)
"""
    result = _run(program)
    assert result.status == "ok", result.stderr
    assert result.stdout == ("[('io_uring_setup', -1, 'EPERM'), "
                             "('pidfd_getfd', -1, 'EPERM')]\n")
