"""Running blocking calls (environment steps) at once, each under its own time limit.

`concurrent.futures` cannot give up on a call that hangs: a pool thread stuck in a
`step` keeps its slot, and the calls queued behind it wait. `run_with_limits` starts one
daemon thread per call (at most `concurrency` live at a time) and measures each call's
limit from the moment it starts; a call past its limit is reported as timed out and its
thread is abandoned (it frees its slot, so the others go on).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Outcome:
    """What one call came to: a value, an exception, or a time-out."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the call returned within its limit."""
        return self.error is None and not self.timed_out


def run_with_limits(
    calls: Sequence[Callable[[], Any]], *, timeout_s: float, concurrency: int
) -> list[Outcome]:
    """Runs `calls` on threads, at most `concurrency` at once, each for at most `timeout_s`.

    Args:
        calls: Functions of no arguments (e.g. one environment's `step`).
        timeout_s: Seconds each call may run, counted from its own start.
        concurrency: Most calls running at once (≥ 1).

    Returns:
        One `Outcome` per call, in order.
    """
    done: queue.Queue[tuple[int, Any, BaseException | None, float]] = queue.Queue()
    outcomes: list[Outcome | None] = [None] * len(calls)
    running: dict[int, float] = {}  # call index -> start time
    waiting = list(range(len(calls)))[::-1]

    def body(i: int, start: float) -> None:
        try:
            value, error = calls[i](), None
        except BaseException as exc:  # noqa: BLE001 — handed to the caller as an outcome
            value, error = None, exc
        done.put((i, value, error, time.monotonic() - start))

    while waiting or running:
        while waiting and len(running) < max(concurrency, 1):
            i = waiting.pop()
            running[i] = time.monotonic()
            threading.Thread(target=body, args=(i, running[i]), daemon=True,
                             name=f"peerflow-env-step-{i}").start()
        deadline = min(running.values()) + timeout_s
        try:
            i, value, error, seconds = done.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            now = time.monotonic()
            for i, start in list(running.items()):
                if now - start >= timeout_s:
                    outcomes[i] = Outcome(timed_out=True, seconds=now - start)
                    del running[i]
            continue
        if i in running:  # a late answer of an abandoned call is dropped
            del running[i]
            outcomes[i] = Outcome(value=value, error=error, seconds=seconds)
    return [o if o is not None else Outcome(timed_out=True) for o in outcomes]
