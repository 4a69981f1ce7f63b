from __future__ import annotations

import json

import pytest

from peerflow.worker import checkpoint as ckpt
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


def test_checkpoint_discovery_and_metrics_truncation(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        d = ckpt.checkpoint_dir(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            ckpt.write_json_atomic(d / ckpt.COMPLETE, {"step": step})
    assert ckpt.latest_checkpoint(tmp_path)[0] == 4
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    ckpt.truncate_metrics(metrics, 4)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_without_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(Exception, match="no complete checkpoint"):
        ckpt.find_resume_checkpoint(tmp_path)


def test_rng_state_round_trip():
    import random

    import torch

    state = ckpt.rng_state()
    a = (torch.rand(3), random.random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
