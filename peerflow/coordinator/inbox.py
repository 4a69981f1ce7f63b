"""Wake-ups between processes of one host: a named pipe per process under `/dev/shm`.

The shared-memory channel (`coordinator.shm`) tells a receiver that a segment is ready
by writing one short line (a token naming route, call, tag and sender) into the
receiver's pipe; the receiver `select`s on its pipe until every token it waits for has
arrived. Compared with a key in the c10d store (a set, a wait and a delete, each a round
trip through the store's server thread on rank 0), a wake-up is one `write` by the
sender and one `read` by the receiver, and no third process sits on the path.

A process creates its pipe (`Inbox.of_this_process`) before it tells any peer its
process id, so a sender never writes to a pipe that does not exist yet. The pipe is
opened for reading and writing by its owner, so it always has a reader while the owner
lives; a write to the pipe of a process that has exited is dropped (that process waits
for nothing any more).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing.util
import os
import select
import threading
import time
from collections.abc import Mapping

import attrs

from peerflow.distributed.comm import peer_failure
from peerflow.errors import WorkerFailedError

_READ_BYTES = 1 << 16  # a pipe's default capacity
_INBOXES: dict[tuple[int, str], Inbox] = {}
_CREATE_LOCK = threading.Lock()


def inbox_path(directory: str, pid: int, prefix: str) -> str:
    """The pipe of process `pid` (`<prefix><pid>-inbox`, so stale-file sweeps find it)."""
    return os.path.join(directory, f"{prefix}{pid}-inbox")


@attrs.define(eq=False)
class Inbox:
    """This process's pipe: tokens other processes sent it, and its pipes to them.

    Thread-safe: one thread at a time reads the pipe; every waiting thread sees every
    token read.
    """

    directory: str
    """Where the pipes live."""
    prefix: str
    """File-name prefix of the pipes."""
    fd: int
    """This process's pipe, opened for reading (and writing, so it never reports EOF)."""
    arrived: set[str] = attrs.field(factory=set)
    """Tokens read and not yet consumed by a wait."""
    peers: dict[int, int] = attrs.field(factory=dict)
    """Process id → open write end of its pipe."""
    partial: bytes = b""
    """The unterminated tail of the last read."""
    reading: bool = False
    """Whether some thread is reading the pipe now."""
    cond: threading.Condition = attrs.field(factory=threading.Condition)

    @classmethod
    def of_this_process(cls, directory: str, prefix: str) -> Inbox:
        """This process's inbox in `directory`, created (and its pipe made) on first use."""
        key = (os.getpid(), directory)
        with _CREATE_LOCK:
            if key not in _INBOXES:
                path = inbox_path(directory, key[0], prefix)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # left by an exited process that had this pid
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
                inbox = _INBOXES[key] = cls(directory=directory, prefix=prefix, fd=fd)
                # after the routes' release (priority 10), which may still wake peers
                multiprocessing.util.Finalize(None, inbox.close, exitpriority=9)
            return _INBOXES[key]

    def notify(self, pid: int, token: str) -> None:
        """Sends `token` to process `pid`; dropped when that process has exited.

        Raises:
            WorkerFailedError: the process's pipe is full (it has stopped reading).
        """
        line = f"{token}\n".encode()
        try:
            fd = self.peers.get(pid)
            if fd is None:
                fd = self.peers[pid] = os.open(inbox_path(self.directory, pid, self.prefix),
                                               os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, line)  # one write of < PIPE_BUF bytes: never interleaved
        except (FileNotFoundError, BrokenPipeError):
            self._forget(pid)  # the receiver has exited
        except BlockingIOError:
            raise WorkerFailedError(
                f"shared-memory wake-up: the pipe of process {pid} is full; that process "
                "has stopped reading it (hung?)."
            ) from None
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: the pipe has no reader (owner exited)
                raise
            self._forget(pid)

    def _forget(self, pid: int) -> None:
        fd = self.peers.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def wait(self, tokens: Mapping[str, int], what: str, timeout: float) -> None:
        """Waits until every token has arrived, then consumes them.

        Args:
            tokens: Token → the rank that sends it (named when it is missing).
            what: Names the wait in the error.
            timeout: Seconds to wait.

        Raises:
            WorkerFailedError: a token did not arrive within `timeout` (naming the ranks,
                and the failure a peer published, if any).
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while any(token not in self.arrived for token in tokens):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted({r for t, r in tokens.items() if t not in self.arrived})
                    peer = peer_failure()
                    cause = f"; {peer}" if peer else ""
                    raise WorkerFailedError(
                        f"{what}: rank(s) {missing} did not answer within {timeout:g} s{cause}")
                if self.reading:  # another thread reads; it wakes us with what it read
                    self.cond.wait(remaining)
                else:
                    self._read(remaining)
            self.arrived.difference_update(tokens)

    def _read(self, timeout: float) -> None:
        """Reads what the pipe holds (waiting up to `timeout`); holds `cond` on entry."""
        self.reading = True
        self.cond.release()
        data = b""
        try:
            if select.select([self.fd], [], [], timeout)[0]:
                with contextlib.suppress(BlockingIOError):
                    while chunk := os.read(self.fd, _READ_BYTES):
                        data += chunk
        finally:
            self.cond.acquire()
            self.reading = False
            *lines, self.partial = (self.partial + data).split(b"\n")
            self.arrived.update(line.decode() for line in lines)
            self.cond.notify_all()

    def close(self) -> None:
        """Closes the pipes and removes this process's (at exit)."""
        if self.fd < 0:
            return
        for pid in list(self.peers):
            self._forget(pid)
        os.close(self.fd)
        self.fd = -1
        _INBOXES.pop((os.getpid(), self.directory), None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(inbox_path(self.directory, os.getpid(), self.prefix))
