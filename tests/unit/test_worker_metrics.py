from __future__ import annotations

import pytest

from peerflow.worker.metrics import StepMetrics, all_reduce_metrics, finish_metrics, reduce_metrics


def test_reduction_kinds_across_ranks():
    a, b = StepMetrics(), StepMetrics()
    a.mean("reward/mean", 0.5, 2)
    b.mean("reward/mean", 0.2, 8)
    a.sum("tokens/response", 10)
    b.sum("tokens/response", 30)
    a.max("time/generate", 1.0)
    b.max("time/generate", 3.0)
    a.min("reward/min", 0.1)
    b.min("reward/min", 0.0)
    out = reduce_metrics([a.raw(), b.raw()])
    assert out["reward/mean"] == pytest.approx((0.5 * 2 + 0.2 * 8) / 10)
    assert out["tokens/response"] == 40
    assert out["time/generate"] == 3.0
    assert out["reward/min"] == 0.0


def test_mixed_reductions_are_rejected():
    a, b = StepMetrics(), StepMetrics()
    a.sum("x", 1)
    b.max("x", 1)
    with pytest.raises(ValueError, match="'x'"):
        reduce_metrics([a.raw(), b.raw()])


def test_single_process_reduction_and_derived_metrics():
    m = StepMetrics()
    m.mean("reward/mean", 0.5, 4)
    m.mean("reward/_sq", 0.5, 4)  # rewards 0,1,0,1
    m.sum("tokens/prompt", 20)
    m.sum("tokens/response", 30)
    m.sum("samples", 4)
    m.max("time/step", 2.0)
    out = finish_metrics(all_reduce_metrics(m), step=3)
    assert out["step"] == 3 and list(out)[0] == "step"
    assert out["reward/std"] == pytest.approx(0.5)
    assert out["throughput/tokens_per_s"] == pytest.approx(25.0)
    assert "reward/_sq" not in out


def test_each_rewards_mean_comes_from_the_samples_components():
    """Read on the trainer from the batch, so async runs (rewards on the rollout ranks)
    log `reward/<name>/mean` too; NaN (an environment's reward it did not give) is left
    out of its own mean and weights the cross-rank mean by the samples that have it."""
    import math

    import torch

    from peerflow.batch import Batch
    from peerflow.worker.metrics import REWARD_COMPONENTS, record_batch_metrics

    ranks = []
    for rows in ([{"acc": 1.0, "env": 0.5}, {"acc": 0.0, "env": math.nan}],
                 [{"acc": 1.0, "env": 0.25}]):
        n = len(rows)
        batch = Batch(sample_id=range(n), group_id=[0] * n, weight_version=[0] * n)
        batch.set("reward", torch.tensor([r["acc"] for r in rows]))
        batch.set_objects(REWARD_COMPONENTS, rows)
        metrics = StepMetrics()
        record_batch_metrics(batch, metrics)
        ranks.append(metrics.raw())
    out = reduce_metrics(ranks)
    assert out["reward/acc/mean"] == pytest.approx(2 / 3)
    assert out["reward/env/mean"] == pytest.approx(0.375)
