"""Rewards over multi-turn trajectories reach the advantage estimators.

GRPO groups are the trajectories of one prompt; per-turn rewards (`token_rewards`, each
at its turn's last model token) reach the token-level estimators per token and, with
`algorithm.turn_rewards: sum`, the outcome-only ones summed into `reward`.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.setup import build_algorithm
from peerflow.batch import Batch, RaggedField
from peerflow.config import AlgorithmConfig, structure
from peerflow.worker.metrics import StepMetrics, reduce_metrics

# two prompts x three trajectories; M = model token, o = observation token
MASKS = ["MMooM", "MMM", "MooMMoM", "MMoooMM", "M", "MMoMM"]
TURN_ENDS = [[1, 4], [2], [0, 4, 6], [1, 6], [0], [1, 4]]
TURN_REWARDS = [[0.5, 0.0], [0.0], [0.25, 0.25, -0.5], [0.5, 0.5], [0.0], [1.0, 0.0]]
OUTCOME = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def trajectories() -> Batch:
    n = len(MASKS)
    batch = Batch(sample_id=range(n), group_id=[7, 7, 7, 9, 9, 9], weight_version=[0] * n)
    batch.set("prompt_ids", [torch.tensor([1, 2, 3])] * n)
    batch.set("response_ids", [torch.arange(4, 4 + len(m)) for m in MASKS])
    batch.set("loss_mask", [torch.tensor([c == "M" for c in m]) for m in MASKS])
    rows = []
    for mask, ends, rewards in zip(MASKS, TURN_ENDS, TURN_REWARDS, strict=True):
        row = torch.zeros(len(mask))
        row[ends] = torch.tensor(rewards)
        rows.append(row)
    batch.set("token_rewards", RaggedField.from_tensors(rows))
    batch.set("reward", torch.tensor(OUTCOME, dtype=torch.float64))
    batch.set_objects("finish_reason", ["stop"] * n)
    return batch


def advantages_of(config: dict, plugin_manager) -> tuple[Batch, dict[str, float]]:
    algo = build_algorithm(structure(AlgorithmConfig, config), plugin_manager=plugin_manager)
    batch, metrics = trajectories(), StepMetrics()
    if algo.shapes_rewards:
        algo.shape_rewards(batch, metrics)
    for name, column in algo.estimator.compute(batch).items():
        batch.set(name, column)
    return batch, reduce_metrics([metrics.raw()])


def grpo(rewards: list[float], groups: list[list[int]]) -> list[float]:
    out = [0.0] * len(rewards)
    for group in groups:
        values = torch.tensor([rewards[i] for i in group], dtype=torch.float64)
        normed = (values - values.mean()) / (values.std() + 1e-6)
        for i, value in zip(group, normed.tolist(), strict=True):
            out[i] = value
    return out


@pytest.mark.parametrize("mode", ["sum", "ignore"])
def test_grpo_groups_trajectories_of_a_prompt_with_turn_rewards_summed(mode, plugin_manager):
    batch, metrics = advantages_of({"advantage": "grpo", "turn_rewards": mode}, plugin_manager)
    totals = [o + (sum(r) if mode == "sum" else 0.0) for o, r in zip(OUTCOME, TURN_REWARDS)]
    assert batch["reward"].tolist() == pytest.approx(totals)
    expected = grpo(totals, [[0, 1, 2], [3, 4, 5]])
    mask = batch.loss_mask()
    sample = torch.repeat_interleave(torch.arange(6), batch.lengths("response_ids"))
    adv = batch.ragged("advantages").values
    assert torch.all(adv[~mask] == 0)
    torch.testing.assert_close(adv[mask], torch.tensor(expected, dtype=adv.dtype)[sample[mask]])
    if mode == "sum":
        assert metrics["reward/turn_sum_mean"] == pytest.approx(
            sum(map(sum, TURN_REWARDS)) / 6)


def test_reinforce_pp_returns_carry_turn_rewards_from_their_turn_back(plugin_manager):
    batch, _ = advantages_of({"advantage": "reinforce_pp", "options": {
        "reinforce_pp": {"gamma": 0.5}}}, plugin_manager)
    assert batch["reward"].tolist() == OUTCOME  # token-level: nothing summed into reward
    returns = batch.ragged("returns").rows()
    # sample 2, "MooMMoM": model tokens 0, 3, 4, 6 with rewards 0.25, 0, 0.25, -0.5 + 1
    # (outcome on the last model token); gamma counts model tokens only
    r6 = -0.5 + 1.0
    r4 = 0.25 + 0.5 * r6
    r3 = 0.0 + 0.5 * r4
    r0 = 0.25 + 0.5 * r3
    torch.testing.assert_close(returns[2], torch.tensor([r0, 0, 0, r3, r4, 0, r6],
                                                        dtype=torch.float64))
    # sample 3, "MMoooMM": rewards 0, 0.5 | 0, 0.5 + 0 (outcome 0)
    torch.testing.assert_close(returns[3], torch.tensor(
        [0.5 * (0.5 + 0.5 * 0.25), 0.5 + 0.5 * 0.25, 0, 0, 0, 0.25, 0.5], dtype=torch.float64))


def test_gae_with_turn_rewards_and_a_per_token_kl_penalty(plugin_manager):
    algo = build_algorithm(structure(AlgorithmConfig, {
        "advantage": "gae", "kl": {"coef": 0.1, "mode": "reward"},
        "options": {"gae": {"gamma": 1.0, "lam": 1.0, "whiten_advantages": False}}}),
        plugin_manager=plugin_manager)
    batch = trajectories()
    mask = batch.loss_mask()
    total = len(mask)
    g = torch.Generator().manual_seed(0)
    batch.set("rollout_logprobs", RaggedField(
        values=torch.where(mask, -torch.rand(total, generator=g), 0.0),
        offsets=batch.ragged("response_ids").offsets))
    batch.set("ref_logprobs", RaggedField(values=-torch.rand(total, generator=g),
                                          offsets=batch.ragged("response_ids").offsets))
    batch.set("values", RaggedField(values=torch.zeros(total),
                                    offsets=batch.ragged("response_ids").offsets))
    algo.shape_rewards(batch, StepMetrics())
    rewards = batch.ragged("token_rewards").values
    assert torch.all(rewards[~mask] == 0)  # the KL penalty never lands on an observation
    out = algo.estimator.compute(batch)
    # gamma = lam = 1, V = 0: a model token's advantage is the sum of the rewards from it on
    kl = batch.ragged("kl").rows()
    first = batch.ragged("response_ids").offsets[:-1]
    expected = [OUTCOME[i] + sum(TURN_REWARDS[i]) - 0.1 * float(kl[i].sum()) for i in range(6)]
    torch.testing.assert_close(out["advantages"].values[first],
                               torch.tensor(expected, dtype=torch.float64))


def test_turn_rewards_option_is_validated():
    from peerflow.errors import ConfigError

    with pytest.raises((ConfigError, ValueError, TypeError), match="turn_rewards"):
        structure(AlgorithmConfig, {"turn_rewards": "average"})
