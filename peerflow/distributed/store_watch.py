"""When the fault store stops answering: name the lost peers and exit within the bound.

A host whose network link is cut keeps running, but every store call of its ranks'
fault monitors blocks (no reset comes back over a dead link) until the store client's
own timeout, which is the rendezvous timeout, not `fault_timeout`. `StoreWatchdog`, a
second thread beside each `FaultMonitor`, sees the monitor's last answered tick grow
older than the heartbeat bound (`stale_after + 2 * interval`, half `fault_timeout` by
default) and exits the process naming the ranks it can no longer reach
(`store_lost_record`), whatever the blocked call is doing.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import attrs

from peerflow.distributed.failure import FailureRecord


def store_lost_record(monitor: Any, exc: BaseException) -> FailureRecord:
    """The failure a rank reports when its fault store is unreachable.

    Under a plain `env://` job rank 0 hosts the store: that rank is named. Otherwise (a
    launcher's or torchrun agent's store) the watched ranks on other hosts are named: the
    store's host is cut off from this one, or they died with it.
    """
    where = os.environ.get("MASTER_ADDR", "?")
    if monitor.store_owner is not None and monitor.store_owner != monitor.rank:
        return FailureRecord(
            rank=monitor.store_owner, host=where, stage="?", reporter=monitor.rank,
            reason=f"it hosted the rendezvous store, which is unreachable ({exc}): the "
            "process died or its host is cut off")
    lost = {r: h for r, h in monitor.peer_hosts.items() if h not in (monitor.host, "?")}
    if not lost:
        return FailureRecord(
            rank=-1, host="?", stage="store", reporter=monitor.rank,
            reason=f"lost the rendezvous store ({exc}); the launcher or the rank hosting "
            "it died")
    rank, host = min(lost.items())
    names = ", ".join(f"rank {r} (host {h})" for r, h in sorted(lost.items()))
    return FailureRecord(
        rank=rank, host=host, stage="?", reporter=monitor.rank,
        reason=f"unreachable from rank {monitor.rank} (host {monitor.host}): the rendezvous "
        f"store on {where} does not answer ({exc}); this host's link is down or the other "
        f"hosts died (lost: {names})")


@attrs.define(eq=False)
class StoreWatchdog:
    """Exits the process when its monitor's store calls stop returning."""

    monitor: Any
    """The `FaultMonitor` whose `last_answer` it watches."""
    closed: threading.Event
    """Set when the monitor closes (the thread then ends at once)."""

    def start(self) -> threading.Thread:
        """Starts the daemon thread (it ends when the monitor closes); returns it."""
        thread = threading.Thread(target=self._run, name="peerflow-store-watchdog", daemon=True)
        thread.start()
        return thread

    @property
    def limit(self) -> float:
        """Seconds without an answered tick after which the store counts as lost."""
        return self.monitor.stale_after + 2 * self.monitor.interval

    def _run(self) -> None:
        monitor = self.monitor
        while not self.closed.wait(monitor.interval):
            silent = time.monotonic() - monitor.last_answer
            if silent > self.limit and not monitor.closed:
                monitor.exit_for(store_lost_record(
                    monitor, TimeoutError(f"no answer for {silent:.1f} s")))
                return
