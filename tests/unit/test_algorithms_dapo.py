"""DAPO's overlong shaping and filtering, and dynamic sampling's flat top-up groups."""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.dynamic_sampling import top_up
from peerflow.algorithms.overlong import overlong_penalty
from peerflow.algorithms.setup import build_algorithm
from peerflow.batch import Batch
from peerflow.config import AlgorithmConfig, structure
from peerflow.worker.metrics import StepMetrics, reduce_metrics


def batch_of(lengths, reward, finish=None, groups=None):
    n = len(lengths)
    batch = Batch(sample_id=torch.arange(n),
                  group_id=torch.tensor(groups if groups is not None else list(range(n))),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", [torch.zeros(k, dtype=torch.int64) for k in lengths])
    batch.set("reward", torch.tensor(reward))
    batch.set_objects("finish_reason", finish or ["stop"] * n)
    return batch


def test_soft_overlong_punishment_follows_the_dapo_formula():
    # L_max 20, L_cache 8: no penalty up to 12 tokens, linear to -1 at 20
    lengths = torch.tensor([5, 12, 13, 16, 20])
    penalty = overlong_penalty(lengths, max_tokens=20, buffer=8, penalty=1.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -1 / 8, -4 / 8, -1.0])
    with pytest.raises(ValueError, match="overlong.buffer"):
        overlong_penalty(lengths, max_tokens=20, buffer=21, penalty=1.0)


def test_overlong_shaping_and_filtering_reach_the_actor_batch(plugin_manager):
    algo = build_algorithm(structure(AlgorithmConfig, {
        "overlong": {"buffer": 2, "penalty": 0.5, "filter": True}}), max_tokens=4,
        plugin_manager=plugin_manager)
    batch = batch_of([2, 3, 4], [1.0, 1.0, 0.0], finish=["stop", "stop", "length"])
    metrics = StepMetrics()
    algo.shape_rewards(batch, metrics)
    assert batch["reward"].tolist() == pytest.approx([1.0, 0.75, -0.5])
    assert batch["score"].tolist() == [1.0, 1.0, 0.0]
    assert batch["train_mask"].tolist() == [True, True, False]
    m = reduce_metrics([metrics.raw()])
    assert m["overlong/filtered_fraction"] == pytest.approx(1 / 3)
    assert m["overlong/penalty_mean"] == pytest.approx(0.75 / 3)
    assert algo.prepare_actor_batch(batch, StepMetrics()).sample_id.tolist() == [0, 1]


def test_flat_top_up_groups_do_not_count_in_the_normaliser(plugin_manager):
    kept = batch_of([2, 2], [0.0, 1.0], groups=[0, 0])
    flat = batch_of([5, 5], [1.0, 1.0], groups=[1, 1])
    step = top_up(kept, flat)
    assert step["train_mask"].tolist() == [True, True, False, False]
    algo = build_algorithm(structure(AlgorithmConfig, {}), plugin_manager=plugin_manager)
    actor = algo.prepare_actor_batch(step, StepMetrics())
    assert int(actor.lengths("response_ids").sum()) == 4  # the flat groups' 10 tokens are out
    assert top_up(kept, flat.select([]))["train_mask"].tolist() == [True, True]


def test_an_overlong_buffer_past_the_budget_is_refused(plugin_manager):
    from peerflow.algorithms.setup import check_algorithm
    from peerflow.config import load_config

    config = load_config(None, ["rollout.sampling.max_tokens=4", "algorithm.overlong.buffer=6"])
    [problem] = check_algorithm(config, plugin_manager)
    assert "algorithm.overlong.buffer=6 exceeds rollout.sampling.max_tokens=4" in problem
