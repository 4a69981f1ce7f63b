"""Observability of the streaming mode: staleness, idle time, overlap, queue depths, spans.

Metric names (one value per training step, written to `metrics.jsonl`):

* `staleness/mean`, `staleness/max`, `staleness/hist_<k>` — how many versions the
  trained samples lagged the trainer (`hist_<k>` = fraction of samples with staleness k);
* `idle/rollout_s`, `idle/trainer_s`, `idle/rollout_fraction`, `idle/trainer_fraction` —
  time a group waited with nothing to do (rollout: blocked by the staleness bound or
  waiting for weights; trainer: waiting for samples) and its share of the step;
* `overlap/fraction` — share of the trainer's busy time during which rollout was also
  generating (0 in synchronous split placement, near 1 when the pipeline is full);
* `queue/trainer_pending`, `queue/rollout_in_flight`, `queue/rollout_finished` —
  samples waiting in the trainer's buffer, prompts being generated, finished groups not
  yet placed into a step.

The streaming loops record their phases as spans of `peerflow.outputs.Tracer` (the
per-rank Chrome-trace files), named `rollout/…` and `trainer/…` so the timeline shows
both groups side by side.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import attrs

Interval = tuple[float, float]


def staleness_metrics(staleness: Iterable[int], bound: int = 0) -> dict[str, float]:
    """Returns `staleness/*` for the samples of one step.

    Args:
        staleness: Versions each sample lagged the trainer by.
        bound: `max_staleness`; `hist_0 … hist_<bound>` are always present (so every rank
            reports the same names), larger values add their own bins.
    """
    values = [int(s) for s in staleness]
    if not values:
        return {}
    counts = Counter(values)
    out = {
        "staleness/mean": sum(values) / len(values),
        "staleness/max": float(max(values)),
    }
    for k in range(max(max(values), bound) + 1):
        out[f"staleness/hist_{k}"] = counts.get(k, 0) / len(values)
    return out


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Returns the union of intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of intervals."""
    return sum(b - a for a, b in merge_intervals(intervals))


def overlap_fraction(busy: Sequence[Interval], other: Sequence[Interval]) -> float:
    """Share of `busy`'s time during which `other` was busy too (0 when `busy` is empty)."""
    mine = merge_intervals(busy)
    theirs = merge_intervals(other)
    length = sum(b - a for a, b in mine)
    if length <= 0:
        return 0.0
    both, j = 0.0, 0
    for a, b in mine:
        while j < len(theirs) and theirs[j][1] <= a:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < b:
            both += max(0.0, min(b, theirs[k][1]) - max(a, theirs[k][0]))
            k += 1
    return both / length


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """Intervals cut to `window`."""
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


@attrs.define(eq=False)
class ActivityLog:
    """Busy and idle intervals of one rank (wall clock, `time.time()`), for one group."""

    busy: list[Interval] = attrs.field(factory=list)
    idle: list[Interval] = attrs.field(factory=list)

    @contextlib.contextmanager
    def track(self, kind: str) -> Iterator[None]:
        """Records the time spent inside the block as `busy` or `idle`."""
        start = time.time()
        try:
            yield
        finally:
            (self.busy if kind == "busy" else self.idle).append((start, time.time()))

    def take(self) -> tuple[list[Interval], list[Interval]]:
        """Returns and forgets the intervals recorded so far."""
        busy, idle = self.busy, self.idle
        self.busy, self.idle = [], []
        return busy, idle
