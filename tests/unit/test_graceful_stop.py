"""Ranks agree on a graceful stop and on whether its checkpoint is cheap through the
step's metrics exchange; the private entries never reach `metrics.jsonl`."""

from __future__ import annotations

from peerflow.worker.graceful_stop import REQUESTED, SLOWEST_SAVE, GracefulStop
from peerflow.worker.metrics import StepMetrics, finish_metrics, reduce_metrics


def _exchange(stops: list[GracefulStop], seen: list[bool]) -> list[dict[str, float]]:
    per_rank = []
    for stop, saw in zip(stops, seen, strict=True):
        metrics = StepMetrics()
        metrics.mean("reward/mean", 0.5)
        stop.offer(metrics)  # no fault monitor here: this rank has seen nothing
        if saw:
            metrics.max(REQUESTED, 1.0)
        per_rank.append(metrics.raw())
    return [finish_metrics(reduce_metrics(per_rank), 3) for _ in stops]


def test_one_rank_seeing_the_request_stops_all_and_slow_saves_are_not_cheap() -> None:
    stops = [GracefulStop(enabled=True, grace=10.0), GracefulStop(enabled=True, grace=10.0)]
    stops[1].timed(lambda: None)
    reduced = _exchange(stops, [False, False])
    assert [s.agreed(r) for s, r in zip(stops, reduced, strict=True)] == [False, False]
    assert all(s.cheap for s in stops)
    assert REQUESTED not in reduced[0] and SLOWEST_SAVE not in reduced[0]
    assert reduced[0]["reward/mean"] == 0.5

    stops[1].slowest_save_s = 6.0  # one rank's save took more than half the grace
    reduced = _exchange(stops, [False, True])
    assert [s.agreed(r) for s, r in zip(stops, reduced, strict=True)] == [True, True]
    assert [s.cheap for s in stops] == [False, False]
    assert "took 6.0 s, more than half of runtime.stop_grace=10 s" in stops[0].note

    off = [GracefulStop(enabled=False, grace=10.0)]
    assert off[0].agreed(_exchange(off, [True])[0]) and not off[0].cheap
    assert off[0].note == "runtime.stop_checkpoint is off"
