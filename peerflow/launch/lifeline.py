"""Workers end with their launcher: a parent-death signal and a watch on the launcher's pid.

A launcher killed outright (`kill -9`, the OOM killer) cannot tell its workers to stop;
left alone they would train and checkpoint on for half a minute, then print thousands of
lines of "Broken pipe" stacks from the store it hosted. The launcher puts its pid in
`LAUNCHER_PID_ENV` before it starts workers; `hold_to_launcher` in each worker then

* asks Linux for SIGKILL when its parent exits (`PR_SET_PDEATHSIG`), where the parent is
  the launcher (spawned workers) or the fork server, which exits with the launcher;
* watches the launcher's pid from a daemon thread (a pidfd where Linux has them, else a
  poll every `POLL_S`), which writes one line to the rank log, silences stdout and stderr
  and exits with `LAUNCHER_GONE_EXIT` within a fraction of a second.

Either way no worker outlives its launcher by more than about a second, and says nothing
on a terminal that is no longer read.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

#: Environment variable with the pid of the process that launched the workers.
LAUNCHER_PID_ENV = "PEERFLOW_LAUNCHER_PID"
#: Exit status of a worker that stopped because its launcher died.
LAUNCHER_GONE_EXIT = 4
#: Seconds between checks of the launcher's pid where there is no pidfd.
POLL_S = 0.2
#: `prctl` option that sets the parent-death signal (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def launcher_pid() -> int | None:
    """The launcher's pid from the environment, or `None` (not started by a launcher)."""
    text = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(text) if text.isdigit() and int(text) != os.getpid() else None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks Linux to send `sig` to this process when its parent exits.

    Returns:
        Whether the request was accepted (False off Linux or without libc's `prctl`).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    from peerflow.distributed.procs import process_gone

    return not process_gone(pid)


def _wait_for_exit(pid: int) -> None:
    """Returns when process `pid` has exited."""
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    if fd is not None:
        try:
            select.select([fd], [], [])  # readable once the process has exited
        finally:
            os.close(fd)
        return
    while _alive(pid):
        threading.Event().wait(POLL_S)


def _leave_quietly(pid: int, note: Callable[[str], None]) -> None:
    note(f"pid {os.getpid()}: the launcher (pid {pid}) is gone (killed?); this worker exits "
         f"with status {LAUNCHER_GONE_EXIT} (no checkpoint written past the newest one)")
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    os._exit(LAUNCHER_GONE_EXIT)


def hold_to_launcher(note: Callable[[str], None] = lambda _text: None) -> bool:
    """Makes this worker exit within about a second of its launcher's death.

    Args:
        note: Where the one line about the launcher's death goes (the rank log).

    Returns:
        Whether a launcher pid was known (`LAUNCHER_PID_ENV`), so this worker is held.
    """
    pid = launcher_pid()
    if pid is None:
        return False
    parent = os.getppid()
    if parent == pid or _is_fork_server(parent):
        set_parent_death_signal()
    if not _alive(pid) or os.getppid() != parent:  # it died before the request
        _leave_quietly(pid, note)

    def watch() -> None:
        _wait_for_exit(pid)
        _leave_quietly(pid, note)

    threading.Thread(target=watch, name="peerflow-launcher-lifeline", daemon=True).start()
    return True


def _is_fork_server(pid: int) -> bool:
    """Whether `pid` is a multiprocessing fork server (it exits when its launcher does)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.forkserver" in handle.read()
    except OSError:
        return False
