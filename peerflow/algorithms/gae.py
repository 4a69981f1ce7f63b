"""Generalised advantage estimation (PPO with a critic)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from peerflow.algorithms.advantages import (
    response_field,
    sample_rewards,
    trained_token_rewards,
    unit_interval,
)
from peerflow.algorithms.base import AdvantageEstimator
from peerflow.algorithms.ragged_ops import on_trained_tokens, pad, token_values, whiten
from peerflow.algorithms.value_loss import ClippedValueLoss, ValueLossOptions
from peerflow.batch import Batch, RaggedField


@attrs.frozen(kw_only=True)
class GAEOptions:
    """Options of `algorithm.options.gae`."""

    gamma: float = attrs.field(default=1.0, validator=unit_interval)
    """Discount factor."""
    lam: float = attrs.field(default=0.95, validator=unit_interval)
    """GAE lambda: 0 is one-step TD, 1 is Monte-Carlo returns minus the value."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean and unit std over the batch (PPO's default)."""
    value_clip: float = attrs.field(default=0.2)
    """Clip range of the critic's value loss around the sampling-time values (0 disables);
    see `peerflow.algorithms.value_loss.ClippedValueLoss`."""
    value_coef: float = 1.0
    """Scale of the critic's value loss."""


class GAE(AdvantageEstimator):
    """Generalised advantage estimation over response tokens.

    `delta_t = r_t + gamma V_{t+1} - V_t` (with `V_T = 0` after the last token),
    `A_t = delta_t + gamma lam A_{t+1}`, `returns = A + V`.

    Reads `values` (the critic's values at sampling time, one per response token) and
    `reward` (placed on the last token, plus `token_rewards` if present). `returns` are
    the critic's regression targets (before any whitening of the advantages).

    Multi-turn trajectories (`loss_mask` false on observation tokens): the recursion runs
    over the model's tokens only, as if the observations were not there — the next value
    of a turn's last token is the value of the next turn's first model token, one `gamma`
    apart; rewards sit on model tokens (the outcome on the last one); the whitening is
    over model tokens; observation tokens get advantage and return 0 (the losses mask
    them). This is verl's `compute_gae_advantage_return` with a `response_mask` ("skip
    values and TD-error on observation tokens"), except that verl silently drops a
    reward on an observation token where this raises.
    """

    name: ClassVar[str] = "gae"
    options_class: ClassVar[type] = GAEOptions
    needs_values: ClassVar[bool] = True
    uses_token_rewards: ClassVar[bool] = True

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` and `returns`."""
        mask = batch.loss_mask()
        lengths = batch.trained_lengths()
        rewards = trained_token_rewards(batch, sample_rewards(batch), lengths)
        values = on_trained_tokens(token_values(batch, "values").detach().to(torch.float64), mask)
        r, valid = pad(rewards, lengths)
        v, _ = pad(values, lengths)
        gamma, lam = self.options.gamma, self.options.lam
        advantages = torch.zeros_like(r)
        running = r.new_zeros(len(lengths))
        for t in range(r.shape[1] - 1, -1, -1):
            next_value = v[:, t + 1] * valid[:, t + 1] if t + 1 < r.shape[1] else 0.0
            delta = r[:, t] + gamma * next_value - v[:, t]
            running = (delta + gamma * lam * running) * valid[:, t]
            advantages[:, t] = running
        returns = (advantages + v)[valid]
        flat = advantages[valid]
        if self.options.whiten_advantages:
            flat = whiten(flat, self.process_group, replicas=self.group_replicas)
        return {"advantages": response_field(flat, batch, mask),
                "returns": response_field(returns, batch, mask)}

    def value_loss(self) -> ClippedValueLoss:
        """The critic loss configured by these options (for the `train_critic` node)."""
        return ClippedValueLoss(
            ValueLossOptions(clip=self.options.value_clip, coef=self.options.value_coef)
        )

