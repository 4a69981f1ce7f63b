"""The learning-rate schedule on the fsdp engine: its values, its metric, an exact resume."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from peerflow import ParallelLayout
from peerflow.engines import EngineContext, OptimSettings
from tests.engines.fsdp.fsdp_testlib import make_batch, nll_loss

PEAK, FLOOR, WARMUP, TOTAL = 1e-2, 0.1, 2, 8


def _cosine_with_floor(step: int) -> float:
    """The oracle: linear warm-up from the floor, then half a cosine down to it."""
    if step < WARMUP:
        return PEAK * (FLOOR + (1 - FLOOR) * step / WARMUP)
    progress = (step - WARMUP) / (TOTAL - WARMUP)
    return PEAK * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def _engine(model: str):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine

    optim = OptimSettings(lr=PEAK, eps=1e-3, mini_batches=2, lr_schedule="cosine",
                          warmup_steps=WARMUP, total_steps=TOTAL, min_lr_ratio=FLOOR)
    engine = FSDPTrainEngine(EngineContext(model_path=model, layout=ParallelLayout()), None,
                             optim)
    engine.context = attrs.evolve(engine.context, temperature=0.7)
    return engine


def test_schedule_counts_optimiser_steps_and_resumes_exactly(tiny_untied_qwen, tmp_path):
    batch = make_batch(tiny_untied_qwen)[0]
    engine = _engine(tiny_untied_qwen)
    lrs = [engine.train_step(batch, nll_loss)["lr"] for _ in range(2)]
    # two optimiser steps per training step; the metric is the last one's rate
    assert lrs == pytest.approx([_cosine_with_floor(1), _cosine_with_floor(3)], rel=1e-12)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    after = [engine.train_step(batch, nll_loss)["lr"] for _ in range(2)]
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    assert after == pytest.approx([_cosine_with_floor(5), _cosine_with_floor(7)], rel=1e-12)
    assert math.isclose(engine.current_lr(), PEAK * FLOOR)  # the floor at the run's end

    resumed = _engine(tiny_untied_qwen)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert [resumed.train_step(batch, nll_loss)["lr"] for _ in range(2)] == after
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), params[name], atol=0, rtol=0, msg=name)
