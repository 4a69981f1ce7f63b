"""Point-to-point message streams between disjoint rank sets (torch.distributed p2p).

Rollout ranks stream finished groups straight to trainer dp-ranks, and trainers stream
weight buckets back; nothing passes through a central store. A *message* is a fixed
`int64[4]` header `[kind, a, b, payload_bytes]` optionally followed by one `uint8`
payload tensor, both sent with `isend` on one tag per channel, so messages between one
pair of ranks on one channel arrive in order.

Measured gloo behaviour shapes the receiver: a gloo `irecv` never reports
`is_completed()` before `wait()`, and a `wait(timeout)` that expires closes the pair, so
each source gets one receiver thread that blocks in `wait(timeout)` and feeds a queue.
A peer that dies closes its socket and the waiting thread fails at once; a peer that
hangs is caught by the timeout, so senders that may stay quiet longer than the timeout
(a rollout rank deep in a long generation) run a `Heartbeat`.
"""

from __future__ import annotations

import datetime
import enum
import queue
import threading
import time
from typing import Any

import attrs
import torch
import torch.distributed as dist

from peerflow.errors import WorkerFailedError
from peerflow.wirecodec import decode, encode

#: Tag of the sample channel (rollout → trainer) and the weight channel (trainer → rollout).
DATA_TAG = 11
WEIGHT_TAG = 12


class Kind(enum.IntEnum):
    """Message kinds."""

    GROUP = 1
    """A packed `Batch` of one or more whole prompt groups; `a` = training step."""
    SEAL = 2
    """`a` = step, `b` = groups this sender sent this receiver for the step."""
    HEARTBEAT = 4
    """Liveness only."""
    STOP = 5
    """The sender sends nothing more on this channel."""
    WEIGHTS = 6
    """`a` = version, `b` = number of `BUCKET` messages that follow."""
    BUCKET = 7
    """Encoded weight-bucket metadata followed by raw bytes; `a` = version."""


_KINDS = frozenset(int(k) for k in Kind)


@attrs.frozen(kw_only=True)
class Message:
    """One received message."""

    kind: Kind
    source: int
    """Global rank of the sender."""
    a: int = 0
    b: int = 0
    payload: torch.Tensor | None = None
    """`uint8` bytes, or `None`."""
    received_at: float = 0.0
    """`time.monotonic()` on arrival."""


def encode_payload(obj: Any) -> torch.Tensor:
    """`obj` (plain values, `peerflow.wirecodec`'s type table) as a `uint8` tensor."""
    return torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8)


def decode_payload(payload: torch.Tensor, what: str = "streaming payload") -> Any:
    """Inverse of `encode_payload`; never unpickles.

    Raises:
        WireFormatError: the bytes are not an encoded payload (corrupt, or crafted).
    """
    return decode(payload.numpy().tobytes(), what=what)


@attrs.define(eq=False)
class StreamSender:
    """Sends messages on one channel without blocking the caller.

    Thread-safe: a lock keeps each header and its payload together, so a `Heartbeat`
    thread may share the sender. Tensors are kept alive until their sends complete.
    """

    tag: int
    group: Any = None
    timeout: float = 60.0
    _pending: list[tuple[int, Any, torch.Tensor, str]] = attrs.field(factory=list, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _issued: int = attrs.field(default=0, init=False)
    bytes_sent: int = attrs.field(default=0, init=False)

    def send(
        self, dst: int, kind: Kind, a: int = 0, b: int = 0, payload: torch.Tensor | None = None
    ) -> None:
        """Queues one message to global rank `dst`."""
        nbytes = 0 if payload is None else int(payload.numel())
        header = torch.tensor([int(kind), int(a), int(b), nbytes], dtype=torch.int64)
        what = f"{kind.name} to rank {dst}"
        with self._lock:
            self._issued += 1
            work = dist.isend(header, dst=dst, group=self.group, tag=self.tag)
            self._pending.append((self._issued, work, header, what))
            if payload is not None and nbytes:
                payload = payload.contiguous()
                work = dist.isend(payload, dst=dst, group=self.group, tag=self.tag)
                self._pending.append((self._issued, work, payload, what))
            self.bytes_sent += nbytes + header.numel() * 8
            if len(self._pending) > 256:  # bound the tensors kept alive
                self._wait_locked(self._pending[0][0] + 1)

    def mark(self) -> int:
        """Returns a token for "every message queued so far" (see `wait_for`)."""
        with self._lock:
            return self._issued

    def _wait_locked(self, token: int) -> None:
        delta = datetime.timedelta(seconds=self.timeout)
        while self._pending and self._pending[0][0] <= token:
            _, work, _, what = self._pending.pop(0)
            try:
                work.wait(timeout=delta)
            except Exception as exc:
                raise WorkerFailedError(
                    f"streaming send ({what}) did not complete within {self.timeout:.0f} s: "
                    f"{exc}. The receiving rank died or stopped receiving."
                ) from exc

    def wait_for(self, token: int) -> None:
        """Waits until every message queued before `mark()` returned `token` is delivered."""
        with self._lock:
            self._wait_locked(token)

    def flush(self) -> None:
        """Waits until every queued message has been delivered."""
        with self._lock:
            self._wait_locked(self._issued)


@attrs.define(eq=False)
class StreamReceiver:
    """Receives messages from a set of source ranks on one channel, in the background.

    One daemon thread per source blocks in `wait(timeout)` for the next header. A source
    that dies, or sends nothing for `timeout` seconds, turns into an error raised from
    `get`, naming the source and `what` it was expected to send.
    """

    sources: tuple[int, ...] = attrs.field(converter=tuple)
    tag: int
    group: Any = None
    timeout: float = 60.0
    what: str = "samples"
    _queue: queue.Queue = attrs.field(factory=queue.Queue, init=False)
    _threads: list[threading.Thread] = attrs.field(factory=list, init=False)
    _stopped: set[int] = attrs.field(factory=set, init=False)
    bytes_received: int = attrs.field(default=0, init=False)

    def start(self) -> StreamReceiver:
        """Starts the receiver threads; returns `self`."""
        for src in self.sources:
            thread = threading.Thread(
                target=self._run, args=(src,), daemon=True, name=f"peerflow-recv-{self.what}-{src}"
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        work = dist.irecv(tensor, src=src, group=self.group, tag=self.tag)
        work.wait(timeout=datetime.timedelta(seconds=self.timeout))

    def _run(self, src: int) -> None:
        while True:
            header = torch.zeros(4, dtype=torch.int64)
            try:
                self._recv(header, src)
                kind, a, b, nbytes = (int(x) for x in header)
                if kind not in _KINDS or nbytes < 0:
                    raise WorkerFailedError(
                        f"rank {src} sent a malformed {self.what} message header "
                        f"{[kind, a, b, nbytes]} (kind not one of {sorted(_KINDS)}, or "
                        "a negative size): it runs another PeerFlow version, or is not this "
                        "run's rank (docs/operations.md, 'Trust model').")
                payload = None
                if nbytes:
                    payload = torch.empty(nbytes, dtype=torch.uint8)
                    self._recv(payload, src)
            except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
                self._queue.put(
                    exc
                    if isinstance(exc, WorkerFailedError)
                    else WorkerFailedError(
                        f"rank {src} stopped sending {self.what}: {exc}. It died or hung "
                        f"(no message for {self.timeout:.0f} s); see its log."
                    )
                )
                return
            self.bytes_received += nbytes + 32
            message = Message(
                kind=Kind(kind), source=src, a=a, b=b, payload=payload, received_at=time.monotonic()
            )
            if message.kind != Kind.HEARTBEAT:
                self._queue.put(message)
            if message.kind == Kind.STOP:
                return

    def get(self, timeout: float | None = None) -> Message | None:
        """Returns the next message, or `None` if none arrives within `timeout` seconds.

        Raises:
            WorkerFailedError: a source died or went silent.
        """
        try:
            item = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if item.kind == Kind.STOP:
            self._stopped.add(item.source)
        return item

    @property
    def depth(self) -> int:
        """Messages received and not yet taken (the queue depth)."""
        return self._queue.qsize()

    @property
    def all_stopped(self) -> bool:
        """Whether every source has sent `STOP` and it was taken with `get`."""
        return self._stopped >= set(self.sources)

    def join(self, timeout: float = 5.0) -> None:
        """Waits briefly for the receiver threads to end (after every source stopped)."""
        for thread in self._threads:
            thread.join(timeout=timeout)


@attrs.define(eq=False)
class Heartbeat:
    """Sends `HEARTBEAT` to some ranks every `interval` seconds from a daemon thread."""

    sender: StreamSender
    targets: tuple[int, ...] = attrs.field(converter=tuple)
    interval: float = 5.0
    _stop: threading.Event = attrs.field(factory=threading.Event, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    def start(self) -> Heartbeat:
        """Starts the thread; returns `self`."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="peerflow-heartbeat")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                for dst in self.targets:
                    self.sender.send(dst, Kind.HEARTBEAT)
            except Exception:  # noqa: BLE001 - the main thread reports the broken peer
                return

    def stop(self) -> None:
        """Stops the thread (it sends nothing afterwards)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
