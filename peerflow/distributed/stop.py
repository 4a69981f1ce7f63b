"""A graceful stop (Ctrl-C, SIGTERM): every rank stops at one agreed step boundary.

The request travels through the fault store (`PREFIX + "stop/request"`): the launcher
sets it on its first SIGINT/SIGTERM; a worker sets it on its own first SIGINT or SIGTERM
(a terminal's Ctrl-C reaches every local worker; torchrun's agent forwards both). The run
driver reads it at each step boundary, and the ranks agree on the stop step through the
step's metrics exchange (`peerflow.worker.driver`), so all of them stop after the same
step, checkpoint it when that is cheap, and publish the outcome (`StopRecord`). A second
signal on a worker, more than `SAME_SIGNAL_S` after the first, stops it at once (the
immediate stop); so does `runtime.stop_grace` passing (the fault monitor enforces it).
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any

import attrs

from peerflow.distributed.ranklog import append_to_rank_log
from peerflow.distributed.stages import PREFIX

#: Key a stop request is stored under (its value: the reason, e.g. "Ctrl-C").
REQUEST_KEY = PREFIX + "stop/request"
#: Key the launcher sets for the immediate stop (second Ctrl-C, or its grace passed).
NOW_KEY = PREFIX + "stop/now"
#: Key the ranks publish where they stopped.
RECORD_KEY = PREFIX + "stop/record"
#: A second SIGINT within this many seconds of the first is the same Ctrl-C (a terminal
#: signals every process of the job, and torchrun's agent forwards it once more).
SAME_SIGNAL_S = 1.0


@attrs.frozen(kw_only=True)
class StopRecord:
    """Where a gracefully stopped run stopped."""

    step: int
    """The last step every rank finished."""
    saved: bool
    """A checkpoint of `step` exists (written at the stop or as a scheduled one)."""
    note: str = ""
    """Why no checkpoint was written at the stop, if none was."""

    def message(self, reason: str) -> str:
        """One line for the operator."""
        what = (f"checkpoint of step {self.step} written" if self.saved
                else f"no checkpoint written at the stop ({self.note})")
        return f"stopped gracefully after step {self.step} ({reason}); {what}"


def request_stop(store: Any, reason: str) -> bool:
    """Asks every rank to stop at the next step boundary; False if already asked."""
    current = store.compare_set(REQUEST_KEY, "", reason)
    return (current.decode() if isinstance(current, bytes) else current) == reason


def stop_now_requested(store: Any) -> bool:
    """Whether the launcher asked for the immediate stop."""
    with contextlib.suppress(Exception):
        return bool(store.check([NOW_KEY]))
    return False


def stop_reason(store: Any) -> str | None:
    """The reason a stop was requested, or `None` (also when the store is unreachable)."""
    with contextlib.suppress(Exception):
        if store.check([REQUEST_KEY]):
            return store.get(REQUEST_KEY).decode()
    return None


def publish_stop(store: Any, record: StopRecord) -> None:
    """Records where the run stopped (every driver rank writes the same record)."""
    store.set(RECORD_KEY, json.dumps(attrs.asdict(record)))


def read_stop(store: Any) -> StopRecord | None:
    """Where the run stopped gracefully, or `None` if it did not."""
    with contextlib.suppress(Exception):
        if store.check([RECORD_KEY]):
            return StopRecord(**json.loads(store.get(RECORD_KEY)))
    return None


@attrs.define(eq=False)
class WorkerStopHandler:
    """A worker's SIGINT/SIGTERM handler: the first asks for a graceful stop, a later one stops.

    A later one: more than `SAME_SIGNAL_S` after the first; it stops this rank at once.
    SIGTERM is what torchrun's agent forwards when it is terminated (and what Slurm and
    Kubernetes send), so it means the graceful stop too, unless a peer's failure is
    published or the launcher asked to stop at once: then an agent is cleaning up after a
    failure, and the rank exits naming it (`FaultMonitor.exit_for_sigterm`). A failure
    published after the SIGTERM still stops the rank: its fault monitor sees it.

    Python runs a signal handler only between bytecodes of the main thread, so a rank
    blocked in a collective (waiting for a slower peer) would hear the signal only when
    the collective returns. `install` therefore also routes the signals through
    `signal.set_wakeup_fd` to a watcher thread, which counts each one when it arrives:
    the first is acknowledged at once (logged, the stop requested in the store) and the
    graceful stop proceeds when the main thread reaches the step boundary. Collectives
    are untouched (no polling, no added latency).
    """

    monitor: Any
    """The rank's `FaultMonitor` (its store and rank; the failure a SIGTERM may follow)."""
    first: float | None = None
    """When the first stop signal arrived (`time.monotonic`)."""
    immediate: bool = False
    """A SIGINT came more than `SAME_SIGNAL_S` after the first signal: stop at once."""
    _raised: bool = False
    """`KeyboardInterrupt` was raised (once: the watcher's nudge may call again)."""
    _lock: threading.RLock = attrs.field(factory=threading.RLock)
    _wakeup: tuple[int, int] | None = None
    """The wakeup pipe's (read, write) ends (`None`: no watcher)."""
    _forward: int = -1
    """A wakeup fd installed before ours (e.g. an asyncio loop's); gets every byte too."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def install(self) -> WorkerStopHandler:
        """Replaces the SIGINT and SIGTERM handlers, starts the watcher (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            signal.signal(sig, self)
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._forward = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wakeup = (read, write)
        threading.Thread(target=self._watch, name="peerflow-stop-watch", daemon=True).start()
        return self

    def __call__(self, signum: int, frame: Any) -> None:
        """The main thread's handler: counts what the watcher has not yet, then obeys."""
        if self._watched():
            self._drain()
        else:
            self._count(signum, time.monotonic())
        if self.immediate and not self._raised:
            self._raised = True
            raise KeyboardInterrupt

    def _watched(self) -> bool:
        """Whether signals still reach the watcher (code run later may set its own fd)."""
        if self._wakeup is None:
            return False
        current = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
        if current != self._wakeup[1]:
            signal.set_wakeup_fd(current)
            return False
        return True

    def _watch(self) -> None:
        while True:
            with contextlib.suppress(InterruptedError):
                select.select([self._wakeup[0]], [], [])
            if self._drain():  # the main thread may have returned from its handler
                _thread.interrupt_main(signal.SIGINT)

    def _drain(self) -> bool:
        """Counts the signals waiting in the pipe; True if one made the stop immediate."""
        with self._lock:
            was = self.immediate
            try:
                data = os.read(self._wakeup[0], 512)
            except (BlockingIOError, InterruptedError):
                return False
            if self._forward != -1:
                with contextlib.suppress(OSError):
                    os.write(self._forward, data)
            for signum in data:
                if signum in self.SIGNALS:
                    self._count(signum, time.monotonic())
            return self.immediate and not was

    def _count(self, signum: int, now: float) -> None:
        """One stop signal: the first asks for the graceful stop, a later one for now."""
        if signum == signal.SIGTERM:  # no waiting here: `now` is when the signal came
            record = self.monitor.wait_for_failure(0)
            if record is not None or stop_now_requested(self.monitor.store):
                self.monitor.exit_for_sigterm(record)
        with self._lock:  # the main thread's handler returns once the request is stored
            if self.first is not None:
                if now - self.first <= SAME_SIGNAL_S:
                    return
                if signum == signal.SIGTERM:
                    self.monitor.exit_for_sigterm()
                self.immediate = True
                return
            self.first = now
            self._acknowledge(signum)

    def _acknowledge(self, signum: int) -> None:
        """Asks every rank for the graceful stop and says so (rank 0 on stderr too)."""
        name = signal.Signals(signum).name
        reason = "Ctrl-C" if signum == signal.SIGINT else name
        with contextlib.suppress(Exception):
            request_stop(self.monitor.store, reason)
        if self.monitor.rank == 0:
            print(f"peerflow: {name}: stopping at the next step boundary (checkpoint if "
                  f"cheap); {reason} again to stop at once", file=sys.stderr, flush=True)
        append_to_rank_log(f"rank {self.monitor.rank} (pid {os.getpid()}): {name}, graceful "
                           "stop requested")


@attrs.define(eq=False)
class LauncherStopHandler:
    """The launcher's SIGINT/SIGTERM handler.

    The elastic launcher's `signals_to_handle` leaves both to it. The first asks every
    worker for a graceful stop and arms a backstop after `grace` seconds; a second, or the
    backstop, raises `interrupt(signum)`, the elastic agent's immediate stop (it signals
    every worker).
    """

    store: Any
    grace: float
    interrupt: Any
    """`f(signum) -> BaseException` raised for the immediate stop."""
    reason: str | None = None
    _previous: dict[int, Any] = attrs.field(factory=dict)
    _timer: threading.Timer | None = None

    def install(self) -> LauncherStopHandler:
        """Takes SIGINT and SIGTERM (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self)
        return self

    def uninstall(self) -> None:
        """Gives the signals back and disarms the backstop."""
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __call__(self, signum: int, frame: Any) -> None:
        """Handles one SIGINT or SIGTERM."""
        if self.reason is not None:
            with contextlib.suppress(Exception):  # workers still in the first signal's echo
                self.store.set(NOW_KEY, "1")
            raise self.interrupt(signum)
        name = signal.Signals(signum).name
        self.reason = "Ctrl-C" if signum == signal.SIGINT else name
        with contextlib.suppress(Exception):
            request_stop(self.store, self.reason)
        print(f"peerflow train: {name}: stopping every worker at the next step boundary "
              f"(checkpoint if cheap, within runtime.stop_grace={self.grace:g} s); Ctrl-C "
              "again to stop at once", file=sys.stderr, flush=True)
        pid = os.getpid()
        self._timer = threading.Timer(self.grace + 2.0, os.kill, (pid, signal.SIGINT))
        self._timer.daemon = True
        self._timer.start()
