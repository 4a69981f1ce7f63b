"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from peerflow.algorithms.advantages import (
    GRPO,
    RLOO,
    GRPOOptions,
    ReinforcePP,
    ReinforcePPOptions,
)
from peerflow.algorithms.gae import GAE, GAEOptions
from peerflow.batch import Batch, RaggedField


def make_batch(rewards, groups, lengths, **ragged):
    n = len(rewards)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.tensor(groups),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", RaggedField.from_tensors([torch.zeros(k, dtype=torch.int64)
                                                        for k in lengths]))
    batch.set("reward", torch.tensor(rewards, dtype=torch.float32))
    for name, rows in ragged.items():
        batch.set(name, RaggedField.from_tensors([torch.tensor(r, dtype=torch.float32)
                                                  for r in rows]))
    return batch


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # group 7: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    # group 9: one sample -> advantage 0
    batch = make_batch([1, 0, 0, 1, 5], [7, 7, 7, 7, 9], [2, 1, 3, 1, 2])
    out = GRPO().compute(batch)["advantages"]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = [a, a, -a, -a, -a, -a, a, 0.0, 0.0]
    assert torch.allclose(out.values, torch.tensor(expected), atol=1e-5)
    assert out.lengths.tolist() == [2, 1, 3, 1, 2]


def test_dr_grpo_skips_std_and_asks_for_constant_length_normalisation():
    batch = make_batch([1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1])
    estimator = GRPO(GRPOOptions(unbiased=True))
    assert estimator.compute(batch)["advantages"].values.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert estimator.preferred_aggregation == "seq-mean-token-sum-norm"
    assert GRPO().preferred_aggregation is None


def test_grpo_all_equal_group_gives_zero():
    batch = make_batch([1, 1, 1], [0, 0, 0], [1, 2, 1])
    assert torch.equal(GRPO().compute(batch)["advantages"].values, torch.zeros(4))


def test_rloo_leave_one_out_baseline():
    # rewards 1,2,3: baselines 2.5, 2, 1.5 -> -1.5, 0, 1.5
    batch = make_batch([1, 2, 3], [4, 4, 4], [1, 1, 2])
    out = RLOO().compute(batch)["advantages"]
    assert torch.allclose(out.values, torch.tensor([-1.5, 0.0, 1.5, 1.5]))


def test_reinforce_pp_whitens_returns_over_the_batch():
    # gamma 1: token returns [1, 1, 0]; mean 2/3, unbiased var 1/3
    batch = make_batch([1, 0], [0, 1], [2, 1])
    out = ReinforcePP().compute(batch)
    s = math.sqrt(1 / 3)
    assert torch.allclose(out["returns"].values, torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(out["advantages"].values,
                          torch.tensor([1 / 3 / s, 1 / 3 / s, -2 / 3 / s]), atol=1e-5)


def test_reinforce_pp_discount_token_rewards_and_group_baseline():
    # gamma 0.5, token reward -0.2 on the first token, reward 1 on the last:
    # returns: t1 = 1, t0 = -0.2 + 0.5 * 1 = 0.3
    batch = make_batch([1, 1], [0, 0], [2, 1], token_rewards=[[-0.2, 0.0], [0.0]])
    out = ReinforcePP(ReinforcePPOptions(gamma=0.5)).compute(batch)
    assert torch.allclose(out["returns"].values, torch.tensor([0.3, 1.0, 1.0]))
    # group baseline: both rewards 1 -> centred to 0, leaving only the token reward
    out = ReinforcePP(ReinforcePPOptions(gamma=0.5, group_baseline=True)).compute(batch)
    assert torch.allclose(out["returns"].values, torch.tensor([-0.2, 0.0, 0.0]))


def test_gae_hand_computed():
    # values [0.5, 0.2], reward 1 on the last token, gamma 1, lambda 0.5:
    # delta1 = 1 - 0.2 = 0.8, A1 = 0.8; delta0 = 0.2 - 0.5 = -0.3, A0 = -0.3 + 0.5 * 0.8 = 0.1
    # second sample: one token, value 0.25, reward 0: A = -0.25
    batch = make_batch([1, 0], [0, 1], [2, 1], values=[[0.5, 0.2], [0.25]])
    out = GAE(GAEOptions(lam=0.5, whiten_advantages=False)).compute(batch)
    assert torch.allclose(out["advantages"].values, torch.tensor([0.1, 0.8, -0.25]))
    assert torch.allclose(out["returns"].values, torch.tensor([0.6, 1.0, 0.0]))
    assert GAE.needs_values


def test_gae_gamma_discounts_next_value():
    # gamma 0.9, lambda 1: A0 = r0 + 0.9 V1 - V0 + 0.9 * (r1 - V1) = 0.9 * 1 - 0.5 = 0.4
    batch = make_batch([1], [0], [2], values=[[0.5, 0.2]])
    out = GAE(GAEOptions(gamma=0.9, lam=1.0, whiten_advantages=False)).compute(batch)
    assert torch.allclose(out["advantages"].values, torch.tensor([0.4, 0.8]))


def test_gae_rejects_misaligned_values():
    batch = make_batch([1], [0], [2], values=[[0.5]])
    with pytest.raises(ValueError, match="'values' is not aligned"):
        GAE().compute(batch)


def test_bad_reward_field_is_named():
    batch = make_batch([1], [0], [1])
    batch.set("reward", torch.zeros(1, 2))
    with pytest.raises(TypeError, match="'reward' must be"):
        GRPO().compute(batch)
