"""Fault detection and propagation over a key-value store, so that nothing hangs.

Every rank runs a `FaultMonitor` thread on the job's `torch.distributed` store (or on the
launcher's own store named by `PEERFLOW_FAULT_STORE`):

* it bumps its heartbeat counter every `interval` seconds and records its host, pid and
  current stage (`stage("generate", deadline=…)`, entered by the worker around every
  node) with the stage's start time and deadline (`peerflow.distributed.stages`);
* a stage of its own rank that runs past its deadline (a reward that never returns)
  fails the run naming this rank, the stage, its detail and where the main thread is;
* it watches the heartbeats of the next two ranks (a ring, so the store sees O(N)
  traffic); a counter that stops moving for `stale_after` seconds means that rank died
  or hung, and the watcher publishes an *abort record* naming it;
* a rank that raises inside `stage(...)` publishes the record itself, with the error;
  a rank whose collective failed because a peer vanished waits briefly for the record
  instead of blaming itself;
* every monitor polls the record; once it exists, the rank prints
  `peerflow: rank R (host H) failed in stage S: …; rank r exits` and leaves with
  `PEER_FAILED_EXIT`, even while its main thread is blocked in a collective.

The first record wins (`compare_set`), so every rank names the same failure. Detection
takes at most `stale_after + 2 * interval` (half `fault_timeout` by default); so does
noticing that the store itself stopped answering (`peerflow.distributed.store_watch`).
A graceful stop (`peerflow.distributed.stop`) that outlives `stop_grace` is ended here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

import attrs

from peerflow.distributed.failure import (
    FailureRecord,
    hostname,
    publish_failure,
    rank_info,
    read_failure,
)
from peerflow.distributed.ranklog import append_to_rank_log
from peerflow.distributed.stages import (
    PREFIX,
    StageRecord,
    find_stuck_rank,
    main_thread_location,
    main_thread_stack,
)
from peerflow.distributed.stop import stop_now_requested, stop_reason
from peerflow.distributed.store_watch import StoreWatchdog, store_lost_record
from peerflow.errors import INTERRUPTED_EXIT

#: Exit status of a rank that stops because a *peer* failed.
PEER_FAILED_EXIT = 3
#: Exit status of a rank whose own stage ran past its deadline.
STUCK_EXIT = 1

@attrs.define(eq=False)
class FaultMonitor:
    """The per-rank heartbeat, watcher and abort-record poller (see the module docstring).

    Args:
        store: A `torch.distributed.Store` every rank and the launcher can reach.
        rank: This process's global rank.
        world_size: Number of ranks.
        fault_timeout: Seconds within which every rank must exit after a failure.
        exit_process: Called with the exit status when a peer failed (tests replace it);
            defaults to `os._exit`, which works even when the main thread is blocked.
    """

    store: Any
    rank: int
    world_size: int
    fault_timeout: float = 60.0
    exit_process: Any = os._exit
    store_owner: int | None = None
    """Rank whose process hosts the store (rank 0 under plain `env://`), `None` when a
    launcher or torchrun agent hosts it."""
    current: StageRecord = attrs.field(factory=lambda: StageRecord(name="startup"))
    """The stage this rank is in."""
    host: str = attrs.field(factory=hostname)
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None
    _watchdog: threading.Thread | None = None
    _seen: dict[int, tuple[int, float]] = attrs.field(factory=dict)
    _store_error_since: float | None = None
    stop_grace: float = 10.0
    """Seconds a graceful stop may take on this rank before it stops at once."""
    _stop_seen: float | None = None
    last_answer: float = attrs.field(factory=time.monotonic)
    """When the store last answered a whole tick (the store watchdog reads it)."""
    peer_hosts: dict[int, str] = attrs.field(factory=dict)
    """Hosts of the watched ranks, read once (named when the store is cut off)."""

    @property
    def interval(self) -> float:
        """Seconds between heartbeats and polls."""
        return min(1.0, max(0.05, self.fault_timeout / 20))

    @property
    def closed(self) -> bool:
        """Whether the monitor was stopped (the rank finished or is exiting)."""
        return self._stop.is_set()

    @property
    def stage_name(self) -> str:
        """Name (and detail) of the stage this rank is in, as messages print it."""
        return self.current.label()

    @property
    def stale_after(self) -> float:
        """Seconds without a heartbeat after which a watched rank counts as failed."""
        return self.fault_timeout / 2

    def start(self) -> FaultMonitor:
        """Records host and pid and starts the monitor thread."""
        self.store.set(f"{PREFIX}host/{self.rank}", f"{self.host}:{os.getpid()}")
        self.store.set(f"{PREFIX}stage/{self.rank}", self.current.to_json())
        self.store.add(f"{PREFIX}hb/{self.rank}", 1)
        self._thread = threading.Thread(target=self._loop, name="peerflow-fault-monitor",
                                        daemon=True)
        self._thread.start()
        self._watchdog = StoreWatchdog(monitor=self, closed=self._stop).start()
        return self

    def close(self) -> None:
        """Marks this rank as finished cleanly and waits for its threads to end.

        A tick still in a store call as the interpreter finalizes aborts the process.
        """
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"{PREFIX}done/{self.rank}", "1")
        for thread in {self._thread, self._watchdog} - {None, threading.current_thread()}:
            thread.join(timeout=self.stale_after + 2 * self.interval)

    def set_stage(self, name: str | StageRecord, deadline: float | None = None,
                  detail: str = "") -> StageRecord:
        """Enters a stage (what a failure message names); returns the previous one.

        Args:
            name: Stage name, or a record to return to (an enclosing stage).
            deadline: Seconds the stage may run (`None`: none of its own).
            detail: What the stage works on, for messages.
        """
        previous = self.current
        self.current = (name if isinstance(name, StageRecord)
                        else StageRecord(name=name, deadline=deadline, detail=detail))
        with contextlib.suppress(Exception):
            self.store.set(f"{PREFIX}stage/{self.rank}", self.current.to_json())
        return previous

    def describe_stage(self, detail: str) -> None:
        """Sets what the current stage works on (its start time and deadline stay)."""
        self.set_stage(attrs.evolve(self.current, detail=detail))

    def fail(self, reason: str, rank: int | None = None) -> FailureRecord:
        """Publishes a failure of `rank` (default: this rank); returns the winning record."""
        rank = self.rank if rank is None else rank
        if rank == self.rank:
            host, stage = self.host, self.stage_name
        else:
            host, stage = rank_info(self.store, rank)
        record = FailureRecord(rank=rank, host=host, stage=stage, reason=reason,
                               reporter=self.rank)
        return publish_failure(self.store, record)

    def wait_for_failure(self, seconds: float) -> FailureRecord | None:
        """Polls for a published failure for up to `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(Exception):
                record = read_failure(self.store)
                if record is not None:
                    return record
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.interval / 2)

    def exit_for(self, record: FailureRecord, status: int = PEER_FAILED_EXIT) -> None:
        """Prints the failure and leaves the process with `status`."""
        text = (f"peerflow: {record.message()}; rank {self.rank} (host {self.host}, stage "
                f"{self.stage_name!r}) exits.")
        print(text, file=sys.stderr, flush=True)
        append_to_rank_log(text)
        self._stop.set()
        self.exit_process(status)

    def fail_stuck_stage(self) -> FailureRecord:
        """Publishes this rank's overdue stage as the failure (the main thread is stuck)."""
        current = self.current
        text = (f"peerflow: rank {self.rank} is stuck in stage {current.label()!r}; main "
                f"thread:\n{main_thread_stack()}")
        print(text, file=sys.stderr, flush=True)
        append_to_rank_log(text)
        return self.fail(
            f"stuck for {time.time() - current.since:.1f} s, past the stage's deadline of "
            f"{current.deadline:g} s (runtime.stage_timeout, or runtime.reward_timeout for "
            f"rewards); the main thread is at {main_thread_location()}")

    def blame_stuck_peer(self, exc: BaseException) -> FailureRecord | None:
        """After this rank timed out waiting: publishes the peer it waited for, if found."""
        found = find_stuck_rank(self.store, self.world_size, self.rank)
        if found is None:
            return None
        rank, record = found
        return self.fail(
            f"in that stage for {time.time() - record.since:.1f} s while rank {self.rank} "
            f"timed out waiting for it in stage {self.stage_name!r} "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})", rank=rank)

    def store_lost(self, exc: BaseException) -> FailureRecord:
        """The failure to report when the store is unreachable (see `store_lost_record`)."""
        return store_lost_record(self, exc)

    def store_reachable(self) -> bool:
        """Whether the store still answers."""
        try:
            self.store.check([PREFIX + "abort"])
        except Exception:  # noqa: BLE001 - any failure means the store is gone
            return False
        return True

    def _watched(self) -> list[int]:
        others = [(self.rank + k) % self.world_size for k in (1, 2)]
        return list(dict.fromkeys(r for r in others if r != self.rank))

    def _tick(self, now: float) -> FailureRecord | None:
        self.store.add(f"{PREFIX}hb/{self.rank}", 1)
        record = read_failure(self.store)
        if record is not None:
            return record
        if self.current.overdue():
            return self.fail_stuck_stage()
        for peer in self._watched():
            if self.store.check([f"{PREFIX}done/{peer}"]):
                continue
            beat = self.store.add(f"{PREFIX}hb/{peer}", 0)
            last = self._seen.get(peer)
            if peer not in self.peer_hosts:
                self.peer_hosts[peer] = rank_info(self.store, peer)[0]
            if last is None or beat != last[0]:
                self._seen[peer] = (beat, now)
            elif now - last[1] > self.stale_after:
                return self.fail(f"no heartbeat for {now - last[1]:.1f} s (the process died "
                                 "or froze)", rank=peer)
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                record = self._tick(now)
                self._store_error_since = None
                self.last_answer = time.monotonic()
            except Exception as exc:  # the store itself is gone: its host died
                self._store_error_since = self._store_error_since or now
                if now - self._store_error_since > self.stale_after and not self._stop.is_set():
                    self.exit_for(self.store_lost(exc))
                continue
            if self._graceful_stop_overdue(now):
                return
            if record is None or self._stop.is_set():
                continue
            if record.rank != self.rank:
                self.exit_for(record)
                return
            if self.current.overdue():  # our own stuck stage: the main thread cannot exit
                self.exit_for(record, STUCK_EXIT)
                return

    def _graceful_stop_overdue(self, now: float) -> bool:
        """Stops this process at once when a graceful stop outlives `stop_grace`."""
        if self._stop_seen is None:
            if stop_reason(self.store) is not None:
                self._stop_seen = now
            return False
        if self._stop.is_set():
            return False
        if stop_now_requested(self.store):
            why = "the launcher asked to stop at once"
        elif now - self._stop_seen > self.stop_grace:
            why = (f"no step boundary within runtime.stop_grace={self.stop_grace:g} s of the "
                   "stop request")
        else:
            return False
        text = (f"peerflow: rank {self.rank} (host {self.host}) stops at once in stage "
                f"{self.stage_name!r}: {why}.")
        print(text, file=sys.stderr, flush=True)
        append_to_rank_log(text)
        self.close()
        self.exit_process(INTERRUPTED_EXIT)
        return True

    def exit_for_sigterm(self, record: FailureRecord | None = None) -> None:
        """Leaves the process after SIGTERM, naming `record` or else the launcher."""
        self.exit_for(record or FailureRecord(
            rank=-1, host="?", stage="?", reporter=self.rank,
            reason="the launcher stopped the job (SIGTERM)"))

    def install_sigterm_handler(self) -> None:
        """On SIGTERM (a launcher stopping the job), name the failure if one is published.

        `peerflow.launch.entry` replaces it with `WorkerStopHandler` (a graceful stop).
        """
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            self.exit_for_sigterm(self.wait_for_failure(min(2.0, self.stale_after)))

        signal.signal(signal.SIGTERM, handler)
