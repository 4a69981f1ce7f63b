"""The streaming schedule of the run's `WeightSyncService`: push on trainers, apply on rollouts.

The service does the work (plan, buckets, packing, the registered transport, unpacking
into the engine, memory meter); this module decides *when*, without lockstep:

* **Trainer side** (`WeightPusher.push`, every trainer rank after an optimizer step, in
  the same order): `service.pack(version)` on the calling thread (materialising may be
  a collective over the trainer group), announce the version to every rollout rank on
  the weight channel (`Kind.WEIGHTS`), and hand the packed bytes to a background thread
  that runs `service.transfer`; training goes on meanwhile. At most `service.depth`
  versions are in flight (2: double buffering); a further push first waits until the
  oldest has gone.
* **Rollout side** (`WeightReceiver`): a background thread waits for every trainer rank's
  announcement of a version, then runs `service.transfer(None, version)` — the same
  per-bucket exchanges, in the same order. The rollout loop calls `poll()` between
  requests (or while paused, with partial rollout) and `apply(engine, version)` loads
  the newest received version. A version overtaken by a newer one before it was applied
  is dropped (weights are full snapshots), so at most two versions are held.

The weight channel (`peerflow.streaming.transport`, tag `WEIGHT_TAG`) carries only the
announcements, heartbeats and `STOP`; the bytes travel over the service's transport,
whose process group must serve nothing else (its collectives run on these threads).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from peerflow.engines import RolloutEngine, TrainEngine, WeightSyncStats
from peerflow.reshard.service import VersionBytes, WeightSyncService
from peerflow.streaming.transport import Kind, StreamReceiver, StreamSender


@attrs.define(eq=False)
class WeightPusher:
    """Pushes new weights from this trainer rank to every rollout rank, asynchronously."""

    service: WeightSyncService
    sender: StreamSender
    """The weight channel (announcements, heartbeats, `STOP`)."""
    _wire: ThreadPoolExecutor = attrs.field(
        factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="peerflow-weight-push"),
        init=False)
    _in_flight: deque[Future] = attrs.field(factory=deque, init=False)

    @property
    def destinations(self) -> tuple[int, ...]:
        """Rollout ranks that receive weights (other than this one)."""
        return tuple(r for r in sorted(self.service.plan.destinations) if r != self.service.rank)

    def push(self, trainer: TrainEngine, version: int) -> WeightSyncStats:
        """Packs `version` and starts sending it; returns once the bytes are queued.

        Call on every trainer rank in the same order (`trainer` is the service's).

        Raises:
            WorkerFailedError: an earlier transfer failed (a peer died or hung).
        """
        assert trainer is self.service.trainer, "push the engine the service was built for"
        while self._in_flight and (self._in_flight[0].done()
                                   or len(self._in_flight) >= self.service.depth):
            self._in_flight.popleft().result()  # frees the oldest pool slot; re-raises
        packed = self.service.pack(version)
        for dst in self.destinations:
            self.sender.send(dst, Kind.WEIGHTS, a=version, b=len(self.service.buckets))
        self._in_flight.append(self._wire.submit(self.service.transfer, packed, version))
        return packed.stats

    def drain(self) -> None:
        """Waits until every pushed version has been delivered."""
        while self._in_flight:
            self._in_flight.popleft().result()
        self._wire.shutdown()
        self.sender.flush()


@attrs.define(eq=False)
class WeightReceiver:
    """Receives pushed versions on a rollout rank and applies them between requests."""

    service: WeightSyncService
    receiver: StreamReceiver
    """The weight channel from every trainer rank (started)."""
    latest_announced: int = attrs.field(default=0, init=False)
    """Newest version any trainer rank has announced (a lower bound of the trainer's)."""
    stopped: bool = attrs.field(default=False, init=False)
    """Every trainer rank has said it sends no more weights."""
    skipped: int = attrs.field(default=0, init=False)
    """Versions overtaken by newer ones before they were applied."""
    _ready: VersionBytes | None = attrs.field(default=None, init=False)
    _cond: threading.Condition = attrs.field(factory=threading.Condition, init=False)
    _error: BaseException | None = attrs.field(default=None, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    @property
    def sources(self) -> tuple[int, ...]:
        """Trainer ranks that push weights."""
        return tuple(sorted(self.service.plan.sources))

    def start(self) -> WeightReceiver:
        """Starts the receiving thread; returns `self`."""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="peerflow-weight-receive")
        self._thread.start()
        return self

    def _run(self) -> None:
        announced: dict[int, set[int]] = {}
        try:
            while not self.receiver.all_stopped:
                message = self.receiver.get(timeout=0.5)
                if message is None or message.kind != Kind.WEIGHTS:
                    continue
                with self._cond:
                    self.latest_announced = max(self.latest_announced, message.a)
                ranks = announced.setdefault(message.a, set())
                ranks.add(message.source)
                if ranks < set(self.sources):
                    continue
                del announced[message.a]
                received = self.service.transfer(None, message.a)
                with self._cond:
                    if self._ready is not None:
                        self.service.discard(self._ready)
                        self.skipped += 1
                    self._ready = received
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - re-raised by poll on the main thread
            with self._cond:
                self._error = exc
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def poll(self, timeout: float | None = None) -> int | None:
        """Returns the newest received version not yet applied, waiting up to `timeout` s.

        Raises:
            WorkerFailedError: a trainer rank died or went silent.
        """
        with self._cond:
            if self._ready is None and timeout and not self.stopped:
                self._cond.wait(timeout)
            if self._error is not None:
                raise self._error
            return None if self._ready is None else self._ready.stats.version

    def apply(self, rollout: RolloutEngine, version: int) -> WeightSyncStats:
        """Loads received `version` into `rollout` (the service's engine)."""
        assert rollout is self.service.rollout, "apply to the engine the service was built for"
        with self._cond:
            received, self._ready = self._ready, None
        if received is None or received.stats.version != version:
            raise RuntimeError(f"weight version {version} is not the one received; call "
                               "poll() and apply the version it returns.")
        return self.service.apply(received)
