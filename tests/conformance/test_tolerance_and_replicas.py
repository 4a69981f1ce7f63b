"""Unit tests of the suite's derived log-prob tolerance and its layer-1 replica check."""

from __future__ import annotations

import pytest
import torch

from peerflow.conformance.checks import check_replicas
from peerflow.conformance.models import LAYOUT_MODELS, hf_config
from peerflow.conformance.tolerance import FACTOR, FLOOR, derive, worst_gap
from peerflow.layout import ParallelLayout
from peerflow.models import RankCoords, hf_layout, vllm_layout


def _scorer(noise: dict):
    truth = [torch.tensor([-1.0, -2.0], dtype=torch.float64)]

    def score(dtype, attn):
        return [t + noise.get((dtype, attn), 0.0) for t in truth]

    return score


def test_tolerance_is_a_multiple_of_the_reference_spread_and_says_so():
    truth, tol = derive(_scorer({(torch.float32, "eager"): 3e-5, (torch.float32, "sdpa"): 1e-4}))
    assert torch.equal(truth[0], torch.tensor([-1.0, -2.0], dtype=torch.float64))
    assert tol.spread == pytest.approx(1e-4)
    assert tol.atol == pytest.approx(FACTOR * 1e-4)
    assert "the reference's own spread 1.00e-04 across float64 eager, float32 eager, " \
        "float32 sdpa" in tol.explain()


def test_tolerance_has_a_floor_and_can_be_fixed():
    assert derive(_scorer({}))[1].atol == FLOOR
    _, fixed = derive(_scorer({(torch.float32, "sdpa"): 1.0}), fixed=1e-3)
    assert fixed.atol == 1e-3 and fixed.spread is None and "fixed" in fixed.explain()


def test_worst_gap_is_infinite_when_lengths_differ():
    assert worst_gap([torch.zeros(2)], [torch.zeros(3)]) == float("inf")


@pytest.mark.parametrize("model", ["llama-mha-untied", "qwen3-gqa4-tied"])
def test_replica_check_names_shard_layout_and_the_fix(model):
    config = hf_config(LAYOUT_MODELS[model])
    layout = ParallelLayout(dp=2)
    unmarked = {r: hf_layout(config) for r in layout.global_ranks}
    problems = check_replicas(unmarked, "MyEngine")
    assert problems and "ranks 0 and 1 both hold it as replica 0" in problems[0]
    assert "MyEngine.shard_layout must give every other copy `replica > 0`" in problems[0]
    for builder in (hf_layout, vllm_layout):
        marked = {r: builder(config, RankCoords.of(layout, r)) for r in layout.global_ranks}
        assert check_replicas(marked) == [], builder.__name__


def test_hf_layout_takes_the_replica_from_the_coordinates_like_vllm_layout():
    config = hf_config(LAYOUT_MODELS["llama-mha-untied"])
    coords = RankCoords.of(ParallelLayout(dp=2), 1)
    assert {s.replica for s in hf_layout(config, coords)} == {1}
    assert {s.replica for s in hf_layout(config, coords, replica=0)} == {0}
    assert {s.replica for s in hf_layout(config, coords, shard_rank=1, shard_size=2)} == {0}
