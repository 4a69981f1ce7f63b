"""Issue 33: nothing reported the share of groups without reward spread (no signal)."""

from __future__ import annotations

import logging

import torch

from peerflow.batch import Batch
from peerflow.worker.executors import record_reward_spread
from peerflow.worker.metrics import SignalWatch, StepMetrics


def _batch(rewards: list[float], groups: list[int]) -> Batch:
    n = len(rewards)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.tensor(groups),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    return batch.set("reward", torch.tensor(rewards))


def test_the_share_of_groups_without_reward_spread_is_a_metric():
    metrics = StepMetrics()
    # group 0 all equal, group 1 spread, group 2 a single answer (no spread to speak of)
    record_reward_spread(_batch([1.0, 1.0, 0.0, 1.0, 0.5], [0, 0, 1, 1, 2]), metrics)
    how, weighted_sum, weight = metrics.raw()["reward/frac_zero_std"]
    assert how == "mean" and weight == 4 and weighted_sum / weight == 0.5


def test_a_step_without_signal_warns_then_stays_quiet_for_a_while(caplog):
    watch = SignalWatch(every=10)
    with caplog.at_level(logging.WARNING, logger="peerflow.worker"):
        warned = [watch.check(step, {"reward/frac_zero_std": value})
                  for step, value in [(1, 0.5), (2, 1.0), (3, 1.0), (11, 1.0), (12, 1.0)]]
    assert warned == [False, True, False, False, True]
    assert "step 2: every prompt's answers got the same reward" in caplog.text
    assert "algorithm.dynamic_sampling" in caplog.text
