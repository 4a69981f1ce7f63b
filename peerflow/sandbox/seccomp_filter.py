"""The seccomp filter bubblewrap loads before the program starts (`bwrap --seccomp FD`).

Built with libseccomp (through `pyseccomp`, its ctypes binding with the API of
libseccomp's own Python module; the official module `seccomp` is used where it is
installed instead), never written by hand: every other system call is allowed, these
fail with `EPERM`. They are the steps from a sandboxed process towards the kernel's
rarer surfaces, none of which a program scored by a reward needs:

* namespaces and mounts: `unshare`, `setns`, `clone` with `CLONE_NEWUSER`, `mount`,
  `umount2`, `pivot_root` and the new mount API (`fsopen`, `fsmount`, `fsconfig`,
  `fspick`, `move_mount`, `open_tree`); `clone3` fails with `ENOSYS`, so the C library
  falls back to `clone`, whose flags a filter can see;
* the kernel keyring (`keyctl`, `add_key`, `request_key`), shared by every program that
  runs as the same host uid;
* `bpf`, `perf_event_open`, `userfaultfd`, `ptrace`, `process_vm_readv`/`writev`,
  kernel modules and `kexec`;
* io_uring (`io_uring_setup`, `_enter`, `_register`): its operations are not seen by
  seccomp, and its kernel code is a frequent source of privilege escalations (Docker's
  default profile refuses it too);
* `pidfd_getfd`, which copies another process's descriptor: bwrap's init, the
  sandbox's first process, holds the program's host-side stdin and stdout (a tool's
  model code took them and wrote the runner's result line, issue 49's red team).

System calls from another architecture's ABI (i386, x32 on x86_64) kill the process
(libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import errno
import functools
import tempfile
from typing import Any

#: Refused with EPERM.
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsmount",
          "fsconfig", "fspick", "move_mount", "open_tree", "keyctl", "add_key", "request_key",
          "bpf", "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv",
          "process_vm_writev", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "pidfd_getfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register")
CLONE_NEWUSER = 0x10000000
INSTALL_HINT = ("pip install pyseccomp (and the libseccomp2 system library: "
                "apt-get install libseccomp2)")


def _binding() -> Any | None:
    """Libseccomp's Python module, or `pyseccomp`, or `None` where neither loads."""
    for name in ("seccomp", "pyseccomp"):
        try:
            return __import__(name)
        except (ImportError, OSError, RuntimeError):
            continue
    return None


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled BPF program (`DENIED`), or `None` where libseccomp is not available."""
    lib = _binding()
    if lib is None:
        return None
    rules = lib.SyscallFilter(defaction=lib.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(lib.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):  # a name this libseccomp does not know
            continue
    rules.add_rule(lib.ERRNO(errno.EPERM), "clone",
                   lib.Arg(0, lib.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    try:
        rules.add_rule(lib.ERRNO(errno.ENOSYS), "clone3")
    except (RuntimeError, ValueError, OSError):
        pass
    with tempfile.TemporaryFile() as out:  # export_bpf writes to a descriptor
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def seccomp_status() -> str:
    """One line for `peerflow sandbox check`: what the filter is, or why there is none."""
    program = seccomp_program()
    if program is None:
        return f"seccomp: none (libseccomp's Python binding is not installed: {INSTALL_HINT})"
    return (f"seccomp: {len(DENIED) + 2} rules ({len(program) // 8} BPF instructions): "
            "unshare, setns, clone(CLONE_NEWUSER), mounts, keyrings, bpf, ptrace, ... -> EPERM")
