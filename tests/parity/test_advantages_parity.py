"""Advantage estimators against verl's: GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline), GAE.

Deliberate difference: a group of one answer. verl gives it its raw reward as advantage
(group mean 0, std 1); PeerFlow gives it 0 — one answer has no group to be compared
with, and a raw reward (all positive for a 0/1 task) would push up whatever was sampled.
The comparisons leave those samples out (and the whitened estimators use batches
without them, since whitening couples every sample); `test_one_answer_groups_differ`
pins the difference down.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peerflow.algorithms.advantages import GRPO, RLOO, GRPOOptions, ReinforcePP, ReinforcePPOptions
from peerflow.algorithms.gae import GAE, GAEOptions
from tests.parity.batches import TOLERANCE, RaggedCase


def _ours(estimator, batch, case):
    out = estimator.compute(batch)
    return case.pad(out["advantages"].values), case.pad(out["returns"].values)


def _several(case):
    """`[n]` bool: the sample's group has more than one answer."""
    return torch.tensor([int((case.group_id == g).sum()) > 1 for g in case.group_id.tolist()])


def _close(ours, theirs, mask):
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours[mask], theirs.to(torch.float64)[mask], rtol=0,
                               atol=TOLERANCE)


@pytest.mark.parametrize("unbiased", [False, True], ids=["grpo", "dr_grpo"])
def test_grpo(verl, case, unbiased):
    ours, _ = _ours(GRPO(GRPOOptions(unbiased=unbiased)), case.batch(), case)
    theirs, _ = verl.compute_grpo_outcome_advantage(
        case.outcome_rewards(), case.mask.to(torch.float64), np.array(case.group_id.tolist()),
        epsilon=1e-6, norm_adv_by_std_in_grpo=not unbiased)
    keep = case.mask & _several(case)[:, None]
    _close(ours, theirs, keep)


def test_rloo(verl, case):
    ours, _ = _ours(RLOO(), case.batch(), case)
    theirs, _ = verl.compute_rloo_outcome_advantage(
        case.outcome_rewards(), case.mask.to(torch.float64), np.array(case.group_id.tolist()))
    _close(ours, theirs, case.mask & _several(case)[:, None])


def test_one_answer_groups_differ(verl):
    case = RaggedCase(0, group_sizes=(3, 1))
    ours, _ = _ours(GRPO(), case.batch(), case)
    theirs, _ = verl.compute_grpo_outcome_advantage(
        case.outcome_rewards(), case.mask.to(torch.float64), np.array(case.group_id.tolist()))
    single = case.mask[3]
    assert torch.all(ours[3][single] == 0)
    torch.testing.assert_close(theirs[3][single], case.reward[3].expand(int(single.sum())),
                               rtol=0, atol=TOLERANCE)


@pytest.fixture(params=[10, 11, 12])
def grouped(request) -> RaggedCase:
    """A ragged batch whose groups all have several answers (whitening couples samples)."""
    return RaggedCase(request.param, group_sizes=(4, 2, 3, 5))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp(verl, grouped, gamma):
    from verl.trainer.config import AlgoConfig

    case = grouped
    kl_rewards = case.tokens(scale=0.05)  # a per-token KL penalty, say
    batch = case.batch(token_rewards=kl_rewards)
    ours, ours_returns = _ours(ReinforcePP(ReinforcePPOptions(gamma=gamma)), batch, case)
    theirs, returns = verl.compute_reinforce_plus_plus_outcome_advantage(
        case.outcome_rewards() + case.pad(kl_rewards), case.mask.to(torch.float64),
        config=AlgoConfig(gamma=gamma))
    _close(ours, theirs, case.mask)
    _close(ours_returns, returns, case.mask)


def test_reinforce_pp_baseline(verl, grouped):
    case = grouped
    ours, _ = _ours(ReinforcePP(ReinforcePPOptions(group_baseline=True)), case.batch(), case)
    theirs, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(
        case.outcome_rewards(), case.mask.to(torch.float64), np.array(case.group_id.tolist()))
    _close(ours, theirs, case.mask)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9)])
def test_gae(verl, grouped, gamma, lam):
    case = grouped
    values = case.tokens(scale=0.5)
    batch = case.batch(values=values)
    ours, ours_returns = _ours(GAE(GAEOptions(gamma=gamma, lam=lam)), batch, case)
    theirs, returns = verl.compute_gae_advantage_return(
        case.outcome_rewards(), case.pad(values), case.mask.to(torch.float64), gamma, lam)
    _close(ours, theirs, case.mask)
    _close(ours_returns, returns, case.mask)
