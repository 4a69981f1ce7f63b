"""Step metrics reduced across gloo ranks: the numbers-only gather equals the object gather.

`MetricsExchange` gathers objects (`all_gather_values`) on its first step and only numbers
while every rank records the names it recorded then; when one rank's names change it
falls back. Every step's result must equal `reduce_metrics` over the ranks' raw metrics,
bit for bit.
"""

from __future__ import annotations

import math

import pytest

from peerflow.worker.metrics import MetricsExchange, StepMetrics, reduce_metrics
from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed


def _record(rank: int, step: int) -> StepMetrics:
    """Rank 1 adds a metric at step 3 (a layout change); rank 0 records `only0`."""
    m = StepMetrics()
    m.mean("reward/mean", 0.1 * step + rank / 3, 7 + rank)
    m.sum("tokens/total", 100 * step + rank)
    m.max("time/step", 1.0 / (step + rank + 1))
    m.min("reward/min", -rank - 0.25 * step)
    m.max("inf", math.inf if rank else -1.0)
    if rank == 0:
        m.sum("only0", step)
    if rank == 1 and step >= 3:
        m.mean("late/metric", 2.0 ** -step, 3)
    return m


def _worker(rank: int, world: int) -> tuple[list[dict[str, float]], int]:
    from peerflow.distributed import comm

    object_gathers = 0
    gather = comm.all_gather_values

    def counted(*args, **kwargs):
        nonlocal object_gathers
        object_gathers += 1
        return gather(*args, **kwargs)

    comm.all_gather_values = counted
    exchange = MetricsExchange()
    return [exchange.reduce(_record(rank, step)) for step in range(1, 6)], object_gathers


def test_numbers_only_gather_matches_the_object_gather():
    got = run_gloo(_worker, 2, timeout_s=60)
    for step in range(1, 6):
        want = reduce_metrics([_record(r, step).raw() for r in range(2)])
        for rank in range(2):
            assert got[rank][0][step - 1] == want, (rank, step)
    assert "late/metric" in got[0][0][2] and "late/metric" not in got[0][0][1]
    # objects on step 1 and on step 3 (rank 1's names changed); numbers only otherwise
    assert [got[rank][1] for rank in range(2)] == [2, 2]
