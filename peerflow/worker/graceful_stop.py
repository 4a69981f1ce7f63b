"""The run driver's side of a graceful stop: agree on the stop step, decide if it is cheap.

Each rank adds two private entries to the step's metrics before the driver exchanges
them: whether it has seen the stop request (`peerflow.distributed.stop`; reduced with
max, so one rank seeing it stops all) and its slowest checkpoint save so far (max). Every
rank of the exchange reads the same reduced values, so all of them stop after the same
step and take the same decision about checkpointing it. A stop checkpoint is *cheap*
when `runtime.stop_checkpoint` is on and the run's slowest save so far took at most half
of `runtime.stop_grace` (a run that has not saved yet counts as cheap; the grace
deadline bounds it: a save cut short has no manifest and is never used).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from peerflow.worker.metrics import StepMetrics

#: Private metric: 1 when a rank has seen the stop request (removed before writing).
REQUESTED = "_stop/requested"
#: Private metric: a rank's slowest checkpoint save so far, seconds (removed too).
SLOWEST_SAVE = "_stop/slowest_save_s"


def _store() -> Any:
    from peerflow.distributed import current_monitor

    monitor = current_monitor()
    return monitor.store if monitor is not None else None


@attrs.define(eq=False)
class GracefulStop:
    """One rank's view of a graceful stop across the steps of a run."""

    enabled: bool
    """`runtime.stop_checkpoint`."""
    grace: float
    """`runtime.stop_grace`, seconds."""
    slowest_save_s: float = 0.0
    """This rank's slowest checkpoint save in this run."""
    cheap: bool = True
    """The agreed decision: checkpoint the stop step."""
    note: str = ""
    """Why a stop step is not checkpointed."""

    def offer(self, metrics: StepMetrics) -> None:
        """Adds this rank's view to the step's metrics before they are exchanged."""
        from peerflow.distributed.stop import stop_reason

        store = _store()
        seen = store is not None and stop_reason(store) is not None
        metrics.max(REQUESTED, 1.0 if seen else 0.0)
        metrics.max(SLOWEST_SAVE, self.slowest_save_s)

    def agreed(self, reduced: dict[str, float]) -> bool:
        """Takes the private entries out of the reduced metrics; returns whether to stop."""
        requested = reduced.pop(REQUESTED, 0.0) > 0
        slowest = reduced.pop(SLOWEST_SAVE, 0.0)
        self.cheap = self.enabled and slowest <= self.grace / 2
        if not self.enabled:
            self.note = "runtime.stop_checkpoint is off"
        elif not self.cheap:
            self.note = (f"the slowest checkpoint save so far took {slowest:.1f} s, more "
                         f"than half of runtime.stop_grace={self.grace:g} s")
        return requested

    def timed(self, save: Callable[[], None]) -> None:
        """Runs a checkpoint save, remembering how long it took."""
        start = time.perf_counter()
        save()
        self.slowest_save_s = max(self.slowest_save_s, time.perf_counter() - start)

    def publish(self, step: int, *, saved: bool) -> None:
        """Records where the run stopped, for the launcher and every worker's exit."""
        from peerflow.distributed.stop import StopRecord, publish_stop

        store = _store()
        if store is not None:
            publish_stop(store, StopRecord(step=step, saved=saved,
                                           note="" if saved else self.note))
