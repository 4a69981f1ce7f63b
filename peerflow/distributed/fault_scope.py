"""This process's fault API: its `FaultMonitor`, the `stage` scope, and failure reporting.

`init_distributed` installs the process's monitor (`set_monitor`); everything a worker
does runs inside `stage(...)`, which names the stage to the monitor and reports a failure
inside it to every rank (`handle_failure`). The monitor thread itself is
`peerflow.distributed.faults`. Without `init_distributed` these only re-raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from peerflow.distributed.failure import looks_like_comm_error, read_failure
from peerflow.distributed.faults import FaultMonitor
from peerflow.distributed.stages import mark_timed_out
from peerflow.errors import WorkerFailedError

_MONITOR: FaultMonitor | None = None


def set_monitor(monitor: FaultMonitor | None) -> None:
    """Installs the process's monitor (done by `init_distributed`)."""
    global _MONITOR
    _MONITOR = monitor


def current_monitor() -> FaultMonitor | None:
    """The process's monitor, or `None` before `init_distributed`."""
    return _MONITOR


def handle_failure(exc: BaseException, monitor: FaultMonitor | None = None) -> None:
    """Reports an exception raised on this rank, or exits naming the peer that caused it.

    A communication error first waits up to `stale_after + 2 * interval` for a peer's
    record (the peer that died is the culprit, not this rank); any other error is
    published as this rank's failure. Returns when the caller should re-raise.
    """
    monitor = monitor or _MONITOR
    if monitor is None or isinstance(exc, KeyboardInterrupt):
        return
    if isinstance(exc, SystemExit) and not exc.code:
        return
    record = None
    with contextlib.suppress(Exception):
        record = read_failure(monitor.store)
        if record is None and looks_like_comm_error(exc):
            mark_timed_out(monitor.store, monitor.rank)
            record = (monitor.wait_for_failure(monitor.stale_after + 2 * monitor.interval)
                      or monitor.blame_stuck_peer(exc))
    if record is None and looks_like_comm_error(exc) and not monitor.store_reachable():
        record = monitor.store_lost(exc)
    if record is not None and record.rank != monitor.rank:
        monitor.exit_for(record)
        return
    with contextlib.suppress(Exception):
        monitor.fail(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def stage(name: str, deadline: float | None = None) -> Iterator[None]:
    """Runs a block as stage `name` (a workflow node, `weight_sync`, `checkpoint`, …).

    A failure inside is reported to every rank (see `handle_failure`) and re-raised. A
    block still running `deadline` seconds after it started fails the run from the
    monitor thread, naming this rank, the stage and where it is stuck. Without
    `init_distributed` it only re-raises.
    """
    monitor = _MONITOR
    previous = monitor.set_stage(name, deadline) if monitor is not None else None
    try:
        yield
    except BaseException as exc:
        handle_failure(exc, monitor)
        raise
    if monitor is not None and previous is not None:
        monitor.set_stage(previous)


def describe_stage(detail: str) -> None:
    """Says what the current stage works on, named if it fails or gets stuck.

    E.g. `reward 'char_match' on samples 16-31`. A no-op without `init_distributed`.
    """
    if _MONITOR is not None:
        _MONITOR.describe_stage(detail)


def raise_if_failed() -> None:
    """Raises `WorkerFailedError` if a peer's failure is published (a cheap check)."""
    if _MONITOR is None:
        return
    record = read_failure(_MONITOR.store)
    if record is not None and record.rank != _MONITOR.rank:
        raise WorkerFailedError(record.message())
