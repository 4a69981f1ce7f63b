"""Outcome-reward advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++.

Each reads `reward` (`[num_samples]`) and `group_id` and writes `advantages` (ragged,
one value per response token) and `returns` (ragged; equal to `advantages` for these
critic-free estimators). The batch holds whole groups.

Multi-turn trajectories (a `loss_mask`, false on observation tokens): a sample is a whole
trajectory and a group the trajectories of one prompt, so GRPO and RLOO compare
trajectories. Every estimator writes advantage 0 on observation tokens. The token-level
ones (`reinforce_pp` here, `gae`) run on the model's tokens only, as if the observations
were not there (verl's multi-turn GAE "skips values and TD-error on observation tokens"
the same way): the outcome `reward` sits on the trajectory's last *model* token, a
per-turn reward in `token_rewards` at its turn's last model token, discounting counts
model tokens, and the whitening statistics are over model tokens.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from peerflow.algorithms.base import AdvantageEstimator
from peerflow.algorithms.ragged_ops import (
    group_stats,
    masked,
    on_trained_tokens,
    pad,
    per_token,
    ragged_like,
    response_lengths,
    to_response_tokens,
    token_values,
    whiten,
)
from peerflow.batch import Batch, RaggedField


def sample_rewards(batch: Batch) -> torch.Tensor:  # [num_samples], float64
    """The batch's `reward` per sample, as float64 (a 1-D tensor, else `TypeError`)."""
    reward = batch["reward"]
    if not isinstance(reward, torch.Tensor) or reward.dim() != 1:
        raise TypeError(
            "batch field 'reward' must be a float tensor of shape [num_samples] (one scalar "
            f"per answer); got {type(reward).__name__}"
            f"{tuple(reward.shape) if isinstance(reward, torch.Tensor) else ''}."
        )
    return reward.to(torch.float64)


def output_dtype(batch: Batch) -> torch.dtype:
    """Advantages and returns are float32, or float64 when the rewards are (tests)."""
    return torch.float64 if batch["reward"].dtype == torch.float64 else torch.float32


def _outputs(per_sample: torch.Tensor, batch: Batch) -> dict[str, RaggedField]:
    """Each sample's advantage on its trained tokens (0 on observation tokens)."""
    lengths = response_lengths(batch)
    values = masked(per_token(per_sample, lengths), batch.loss_mask())
    field = ragged_like(values.to(output_dtype(batch)), lengths)
    return {"advantages": field, "returns": field}


def unit_interval(_: object, attribute: attrs.Attribute, value: float) -> None:
    """An attrs validator: the value lies in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must lie in [0, 1], got {value}.")


@attrs.frozen(kw_only=True)
class GRPOOptions:
    """Options of `algorithm.options.grpo`."""

    unbiased: bool = False
    """Dr.GRPO: subtract the group mean but do not divide by the group std, and ask the
    loss for `seq-mean-token-sum-norm` aggregation (no length normalisation)."""
    scale_by_std: bool = True
    """Divide by the group's (unbiased) reward std; ignored when `unbiased` is set."""
    eps: float = attrs.field(default=1e-6, validator=attrs.validators.gt(0))
    """Added to the std before dividing."""


class GRPO(AdvantageEstimator):
    """Group-relative advantages: `(r - mean(group)) / (std(group) + eps)`.

    The std is the unbiased (Bessel-corrected) sample std of the group's rewards, as in
    verl and TRL; a group of one sample gets advantage 0.
    """

    name: ClassVar[str] = "grpo"
    options_class: ClassVar[type] = GRPOOptions

    @property
    def compares_within_groups(self) -> bool:
        """Advantages are relative to the prompt's group."""
        return True

    @property
    def preferred_aggregation(self) -> str | None:
        """`seq-mean-token-sum-norm` for Dr.GRPO, else the loss's default."""
        return "seq-mean-token-sum-norm" if self.options.unbiased else None

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` and `returns` (identical ragged fields)."""
        reward = sample_rewards(batch)
        count, mean, std = group_stats(reward, batch.group_id)
        advantage = reward - mean
        if not self.options.unbiased and self.options.scale_by_std:
            advantage = advantage / (std + self.options.eps)
        advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
        return _outputs(advantage, batch)


@attrs.frozen(kw_only=True)
class RLOOOptions:
    """Options of `algorithm.options.rloo` (none yet)."""


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out: `r_i - mean_{j != i} r_j` within the group.

    Equal to `n / (n - 1) * (r_i - mean(group))`; a group of one sample gets 0.
    """

    name: ClassVar[str] = "rloo"
    options_class: ClassVar[type] = RLOOOptions

    @property
    def compares_within_groups(self) -> bool:
        """Advantages are relative to the prompt's group."""
        return True

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` and `returns` (identical ragged fields)."""
        reward = sample_rewards(batch)
        count, mean, _ = group_stats(reward, batch.group_id)
        baseline = (mean * count - reward) / (count - 1).clamp(min=1)
        advantage = torch.where(count > 1, reward - baseline, torch.zeros_like(reward))
        return _outputs(advantage, batch)


@attrs.frozen(kw_only=True)
class ReinforcePPOptions:
    """Options of `algorithm.options.reinforce_pp`."""

    gamma: float = attrs.field(default=1.0, validator=unit_interval)
    """Discount of token-level returns."""
    group_baseline: bool = False
    """REINFORCE++-baseline: subtract the group's mean reward before whitening."""


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++: discounted token-level returns, whitened over the whole batch.

    The sample's reward sits on its last response token, plus `token_rewards` when the
    batch carries them (a per-token KL penalty, per-turn rewards); the return of token t is
    `sum_{k >= t} gamma^(k-t) r_k`. Advantages are the returns normalised to zero mean and
    unit std over every response token of the batch (over all ranks of
    `process_group` when it is set) — the global batch normalisation that replaces
    GRPO's per-group std. With a `loss_mask`, on model tokens only (see the module).
    """

    name: ClassVar[str] = "reinforce_pp"
    options_class: ClassVar[type] = ReinforcePPOptions
    uses_token_rewards: ClassVar[bool] = True

    @property
    def compares_within_groups(self) -> bool:
        """REINFORCE++-baseline subtracts the group's mean reward."""
        return self.options.group_baseline

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` (whitened) and `returns` (before whitening)."""
        reward = sample_rewards(batch)
        if self.options.group_baseline:
            _, mean, _ = group_stats(reward, batch.group_id)
            reward = reward - mean
        mask = batch.loss_mask()
        lengths = batch.trained_lengths()
        returns = _discounted_returns(trained_token_rewards(batch, reward, lengths), lengths,
                                      self.options.gamma)
        advantages = whiten(returns, self.process_group, replicas=self.group_replicas)
        return {"advantages": response_field(advantages, batch, mask),
                "returns": response_field(returns, batch, mask)}


def response_field(values: torch.Tensor, batch: Batch,
                   mask: torch.Tensor | None) -> RaggedField:
    """Per-trained-token `values` as a field aligned with `response_ids` (0 elsewhere)."""
    return ragged_like(to_response_tokens(values, mask).to(output_dtype(batch)),
                       response_lengths(batch))


def trained_token_rewards(batch: Batch, reward: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
    """Rewards of the trained tokens: `token_rewards`, plus `reward` on each last one.

    Args:
        batch: Its `loss_mask` (if any) picks the trained tokens.
        reward: `[num_samples]` outcome rewards.
        lengths: `[num_samples]` trained tokens a sample (`Batch.trained_lengths`).

    Returns:
        `[trained tokens]` float64, samples back to back.

    Raises:
        ValueError: `token_rewards` puts a reward on an untrained (observation) token.
    """
    mask = batch.loss_mask()
    if "token_rewards" in batch:
        rewards = token_values(batch, "token_rewards").to(torch.float64)
        if mask is not None and bool((rewards[~mask] != 0).any()):
            at = int((~mask & (rewards != 0)).nonzero()[0, 0])
            raise ValueError(
                f"batch field 'token_rewards' has reward {float(rewards[at])} at response "
                f"token {at}, whose loss_mask is false (an observation); put a turn's reward "
                "on that turn's last model token."
            )
        rewards = on_trained_tokens(rewards, mask).clone()
    else:
        rewards = torch.zeros(int(lengths.sum()), dtype=torch.float64, device=lengths.device)
    ends = torch.cumsum(lengths, 0) - 1
    has_tokens = lengths > 0
    rewards[ends[has_tokens]] += reward[has_tokens]
    return rewards


def _discounted_returns(
    rewards: torch.Tensor, lengths: torch.Tensor, gamma: float
) -> torch.Tensor:  # [total_tokens]
    padded, mask = pad(rewards, lengths)
    returns = torch.zeros_like(padded)
    running = padded.new_zeros(len(lengths))
    for t in range(padded.shape[1] - 1, -1, -1):
        running = padded[:, t] + gamma * running
        returns[:, t] = running
    return returns[mask]
