"""Per-turn rewards of multi-turn trajectories for estimators that read only `reward`.

A multi-turn trajectory (`peerflow.agents.rollout`) earns an outcome reward (`reward`) and
optional per-turn rewards, carried in `token_rewards` at each turn's last model token.
`gae` and `reinforce_pp` read `token_rewards` per token. `grpo` and `rloo` compare whole
trajectories of one prompt by `reward` alone; with `algorithm.turn_rewards: sum` (the
default) the advantage node first adds each trajectory's per-turn rewards to its
`reward` (`add_turn_rewards`), so a GRPO group ranks trajectories by their total return.
"""

from __future__ import annotations

import torch

from peerflow.algorithms.ragged_ops import segment_sum, token_values
from peerflow.batch import Batch


def add_turn_rewards(batch: Batch) -> dict[str, float]:
    """Adds each sample's summed `token_rewards` to its `reward`, in place.

    A no-op (empty metrics) when the batch has no `token_rewards`.

    Returns:
        `reward/turn_sum_mean`: the mean per-trajectory sum added.
    """
    if "token_rewards" not in batch:
        return {}
    turn_sum = segment_sum(token_values(batch, "token_rewards").to(torch.float64),
                           batch.lengths("response_ids"))
    reward = batch["reward"]
    batch.set("reward", (reward.to(torch.float64) + turn_sum).to(reward.dtype))
    return {"reward/turn_sum_mean": float(turn_sum.mean()) if len(turn_sum) else 0.0}
