"""Same-host exchange through POSIX shared memory (the coordinator's `shm` transport).

`ShmRoute.exchange` has the contract of `exchange.exchange` — every sender's framed
messages reach their peers, one message per (sender, receiver) — but moves them through
files under `/dev/shm` and wakes receivers through their pipes (`coordinator.inbox`)
instead of one gloo message per pair:

* a sender writes all its messages of one exchange into one segment (a message addressed
  to several peers, e.g. a shard's metadata or the samples of a consumer's tp peers, is
  written once), gives each receiver a hard link of its own, then writes one wake-up
  line into each receiver's pipe;
* a receiver waits until all its senders' wake-ups have arrived, maps each link
  privately (copy on write: zero-copy views that no other process sees change) and
  unlinks it.

Lifetime: a mapping outlives the unlinked file, so a segment is freed once its last
receiver has unlinked its link (`st_nlink` of the sender's own name back to 1); the
sender checks that after each exchange and then removes its name. A call that
fails removes its sender's segments at once (a receiver that still wants one gets a
`WorkerFailedError` naming the sender); at exit a process removes its names and the
links of receivers that no longer exist (a live one removes its link when it reads);
and the first route of a process removes files of processes that no longer exist, so a
killed run leaves nothing behind for the next. Wake-up tokens and file names carry the
route (its rank set), a per-route call counter and the exchange's tag, so no two calls
collide.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import multiprocessing.util
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from peerflow.coordinator.inbox import Inbox
from peerflow.distributed.procs import process_gone
from peerflow.errors import WorkerFailedError
from peerflow.rounding import pad_to_multiple

#: Where segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: File-name prefix of every segment: `peerflow-<pid>-<route>-<call>-<tag>[-to<rank>]`.
PREFIX = "peerflow-"
#: Byte alignment of every message in a segment (wire.ALIGN divides it).
_ALIGN = 64

_ROUTES: list[ShmRoute] = []  # every unreleased route of this process, released at exit


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Removes segments whose writing process no longer exists; returns how many."""
    removed = 0
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and process_gone(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed


def this_process_inbox(directory: str = SHM_DIR) -> Inbox:
    """This process's wake-up pipe in `directory` (made on first use).

    Call it before telling peers this process's id, so that they never find it missing.
    """
    return Inbox.of_this_process(directory, PREFIX)


def _release_all() -> None:
    for route in list(_ROUTES):
        route.release()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    try:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, f"{SHM_DIR} is full: the coordinator could not write "
                      f"{len(data)} more bytes of a batch. Enlarge it (containers: "
                      "`docker run --shm-size=…`), or move batches over gloo with "
                      "`runtime.coordinator_transport: gloo`.") from exc


def _create(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # left by a dead process that had this pid
        os.unlink(path)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


def _link(path: str, link: str) -> None:
    try:
        os.link(path, link)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
        os.unlink(link)
        os.link(path, link)


@attrs.define(eq=False)
class _Segment:
    """One written segment: the sender's own name and its receivers' links."""

    call: int
    path: str
    links: list[str]


@attrs.define(eq=False)
class ShmRoute:
    """The shared-memory channel of one route's rank set, in one process.

    Every rank of the set calls `begin_call` once per `redistribute` call, so the call
    counter (part of every key and file name) agrees across the set.
    """

    inbox: Inbox
    """This process's wake-up pipe (`this_process_inbox`)."""
    rank: int
    """This process's global rank."""
    route_key: str
    """Short id of the rank set (names keys and files)."""
    pids: Mapping[int, int]
    """Global rank → process id, for every rank of the set (names its files)."""
    cores: int = 1
    """The fewest cores any rank of the set may run on (`transport.usable_cores`)."""
    directory: str = SHM_DIR
    """Where segments live."""
    call: int = -1
    """Index of the current call on this route."""
    pending: list[_Segment] = attrs.field(factory=list)
    """Segments written here whose receivers may not all have read them yet."""

    def __attrs_post_init__(self) -> None:
        if not _ROUTES:
            sweep_stale(self.directory)
            multiprocessing.util.Finalize(None, _release_all, exitpriority=10)
        _ROUTES.append(self)

    name = "shm"
    #: A message addressed to many peers is written once (`redistribute`'s one-round p2p).
    shared = True

    def begin_call(self) -> ShmRoute:
        """Starts the next call on this route (every rank of the set calls it)."""
        self.call += 1
        return self

    def _path(self, sender: int, tag: int) -> str:
        return os.path.join(self.directory,
                            f"{PREFIX}{self.pids[sender]}-{self.route_key}-{self.call}-{tag}")

    def _token(self, sender: int, tag: int) -> str:
        return f"{self.route_key}/{self.call}/{tag}/{sender}"

    def exchange(
        self,
        outgoing: Iterable[tuple[int, torch.Tensor, int]],
        incoming: Mapping[int, int],
        *,
        tag: int,
        what: str,
        timeout: float,
    ) -> tuple[dict[int, torch.Tensor], int]:
        """`exchange.exchange` through shared memory (capacities are not needed here).

        Raises:
            WorkerFailedError: a sender did not publish within `timeout`, or removed its
                segment before this rank read it (it gave up on the call).
        """
        try:
            sent = self._write(outgoing, tag)
            tokens = {self._token(peer, tag): peer for peer in incoming}
            self.inbox.wait(tokens, f"{what} (shared memory)", timeout)
            received = {peer: self._read(peer, tag, what) for peer in incoming}
        except WorkerFailedError:
            self._abandon()
            self._collect()
            raise
        self._collect()
        return received, sent

    def _write(self, outgoing: Iterable[tuple[int, torch.Tensor, int]], tag: int) -> int:
        """Writes this rank's messages of one exchange as one segment; returns bytes sent."""
        messages: list[torch.Tensor] = []
        slot: dict[tuple[int, int], int] = {}
        table: list[tuple[int, int]] = []
        sent = 0
        for peer, message, _ in outgoing:
            index = slot.setdefault((message.data_ptr(), message.numel()), len(messages))
            if index == len(messages):
                messages.append(message)
            table.append((peer, index))
            sent += message.numel()
        if not table:
            return 0
        offsets, position = [], pad_to_multiple(8 + 24 * len(table), _ALIGN)
        for message in messages:
            offsets.append(position)
            position += pad_to_multiple(message.numel(), _ALIGN)
        header = [len(table)]
        for peer, index in table:
            header += [peer, offsets[index], messages[index].numel()]
        path = self._path(self.rank, tag)
        fd = _create(path)
        try:
            _write_all(fd, memoryview(torch.tensor(header, dtype=torch.int64).numpy()).cast("B"),
                       0)
            for message, offset in zip(messages, offsets):
                _write_all(fd, memoryview(message.numpy()), offset)
        finally:
            os.close(fd)
        receivers = list(dict.fromkeys(peer for peer, _ in table))
        segment = _Segment(call=self.call, path=path, links=[])
        self.pending.append(segment)
        for peer in receivers:
            link = f"{path}-to{peer}"
            _link(path, link)
            segment.links.append(link)
        token = self._token(self.rank, tag)
        for peer in receivers:
            self.inbox.notify(self.pids[peer], token)
        return sent

    def _read(self, sender: int, tag: int, what: str) -> torch.Tensor:
        """Maps `sender`'s segment through this rank's link; returns this rank's message."""
        link = f"{self._path(sender, tag)}-to{self.rank}"
        try:
            fd = os.open(link, os.O_RDONLY)
        except FileNotFoundError:
            raise WorkerFailedError(
                f"{what}: rank {sender} announced its shared-memory segment but {link} is "
                "gone (the rank gave up on this call)."
            ) from None
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        os.unlink(link)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        count = int(whole[:8].view(torch.int64)[0])
        table = whole[8 : 8 + 24 * count].view(torch.int64).view(count, 3).tolist()
        for peer, offset, length in table:
            if peer == self.rank:
                return whole[offset : offset + length]
        raise ValueError(f"{what}: rank {sender}'s segment {link} holds no message for rank "
                         f"{self.rank} (its receivers: {[row[0] for row in table]}).")

    def _collect(self) -> None:
        """Frees segments every receiver has read (their links are gone)."""
        keep = []
        for segment in self.pending:
            try:
                done = os.stat(segment.path).st_nlink == 1
            except FileNotFoundError:
                done = True
            if not done:
                keep.append(segment)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        self.pending = keep

    def _abandon(self) -> None:
        """Removes this call's segments (a failed call must not leave files behind)."""
        self._remove(s for s in self.pending if s.call == self.call)
        self.pending = [s for s in self.pending if s.call != self.call]

    @staticmethod
    def _remove(segments: Iterable[_Segment], keep_link: Any = None) -> None:
        for segment in segments:
            for path in [segment.path, *segment.links]:
                if keep_link is None or path == segment.path or not keep_link(path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def release(self) -> None:
        """Removes this route's files (at process exit, or when its world group goes).

        A link of a receiver that is still alive stays: that receiver may not have read
        it yet (this process may finish its last call first), and removes it when it does.
        """
        def reader_alive(link: str) -> bool:
            return not process_gone(self.pids[int(link.rsplit("-to", 1)[1])])

        self._remove(self.pending, keep_link=reader_alive)
        self.pending = []
        if self in _ROUTES:  # nothing holds the route any longer
            _ROUTES.remove(self)
