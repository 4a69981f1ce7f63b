"""Outcome-reward advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++.

Each reads `reward` (`[num_samples]`) and `group_id` and writes `advantages` (ragged,
one value per response token) and `returns` (ragged; equal to `advantages` for these
critic-free estimators). The batch holds whole groups.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from peerflow.algorithms.base import AdvantageEstimator
from peerflow.algorithms.ragged_ops import (
    group_stats,
    pad,
    per_token,
    ragged_like,
    response_lengths,
    token_values,
    whiten,
)
from peerflow.batch import Batch, RaggedField


def _rewards(batch: Batch) -> torch.Tensor:  # [num_samples], float64
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


def _outputs(advantages: torch.Tensor, lengths: torch.Tensor,
             dtype: torch.dtype) -> dict[str, RaggedField]:
    field = ragged_like(advantages.to(dtype), lengths)
    return {"advantages": field, "returns": field}


def _positive(_: object, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}.")


def _unit(_: object, attribute: attrs.Attribute, value: float) -> None:
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
    eps: float = attrs.field(default=1e-6, validator=_positive)
    """Added to the std before dividing."""


class GRPO(AdvantageEstimator):
    """Group-relative advantages: `(r - mean(group)) / (std(group) + eps)`.

    The std is the unbiased (Bessel-corrected) sample std of the group's rewards, as in
    verl and TRL; a group of one sample gets advantage 0.
    """

    name: ClassVar[str] = "grpo"
    options_class: ClassVar[type] = GRPOOptions

    @property
    def preferred_aggregation(self) -> str | None:
        """`seq-mean-token-sum-norm` for Dr.GRPO, else the loss's default."""
        return "seq-mean-token-sum-norm" if self.options.unbiased else None

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` and `returns` (identical ragged fields)."""
        reward = _rewards(batch)
        count, mean, std = group_stats(reward, batch.group_id)
        advantage = reward - mean
        if not self.options.unbiased and self.options.scale_by_std:
            advantage = advantage / (std + self.options.eps)
        advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
        lengths = response_lengths(batch)
        return _outputs(per_token(advantage, lengths), lengths, output_dtype(batch))


@attrs.frozen(kw_only=True)
class RLOOOptions:
    """Options of `algorithm.options.rloo` (none yet)."""


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out: `r_i - mean_{j != i} r_j` within the group.

    Equal to `n / (n - 1) * (r_i - mean(group))`; a group of one sample gets 0.
    """

    name: ClassVar[str] = "rloo"
    options_class: ClassVar[type] = RLOOOptions

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` and `returns` (identical ragged fields)."""
        reward = _rewards(batch)
        count, mean, _ = group_stats(reward, batch.group_id)
        baseline = (mean * count - reward) / (count - 1).clamp(min=1)
        advantage = torch.where(count > 1, reward - baseline, torch.zeros_like(reward))
        lengths = response_lengths(batch)
        return _outputs(per_token(advantage, lengths), lengths, output_dtype(batch))


@attrs.frozen(kw_only=True)
class ReinforcePPOptions:
    """Options of `algorithm.options.reinforce_pp`."""

    gamma: float = attrs.field(default=1.0, validator=_unit)
    """Discount of token-level returns."""
    group_baseline: bool = False
    """REINFORCE++-baseline: subtract the group's mean reward before whitening."""


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++: discounted token-level returns, whitened over the whole batch.

    The sample's reward sits on its last response token, plus `token_rewards` when the
    batch carries them (a per-token KL penalty, say); the return of token t is
    `sum_{k >= t} gamma^(k-t) r_k`. Advantages are the returns normalised to zero mean and
    unit std over every response token of the batch (over all ranks of
    `process_group` when it is set) — the global batch normalisation that replaces
    GRPO's per-group std.
    """

    name: ClassVar[str] = "reinforce_pp"
    options_class: ClassVar[type] = ReinforcePPOptions
    uses_token_rewards: ClassVar[bool] = True

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` (whitened) and `returns` (before whitening)."""
        reward = _rewards(batch)
        if self.options.group_baseline:
            _, mean, _ = group_stats(reward, batch.group_id)
            reward = reward - mean
        lengths = response_lengths(batch)
        token_rewards = _token_rewards(batch, reward, lengths)
        returns = _discounted_returns(token_rewards, lengths, self.options.gamma)
        advantages = whiten(returns, self.process_group, replicas=self.group_replicas)
        return {
            "advantages": ragged_like(advantages.to(output_dtype(batch)), lengths),
            "returns": ragged_like(returns.to(output_dtype(batch)), lengths),
        }


def _token_rewards(batch: Batch, reward: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-token rewards: `token_rewards` if present, plus `reward` on each last token."""
    total = int(lengths.sum())
    if "token_rewards" in batch:
        rewards = token_values(batch, "token_rewards").to(torch.float64).clone()
    else:
        rewards = torch.zeros(total, dtype=torch.float64)
    ends = torch.cumsum(lengths, 0) - 1
    has_tokens = lengths > 0
    rewards[ends[has_tokens]] += reward[has_tokens]
    return rewards


def _discounted_returns(
    rewards: torch.Tensor, lengths: torch.Tensor, gamma: float
) -> torch.Tensor:  # [total_tokens]
    padded, mask = pad(rewards, lengths)
    returns = torch.zeros_like(padded)
    running = torch.zeros(len(lengths), dtype=padded.dtype)
    for t in range(padded.shape[1] - 1, -1, -1):
        running = padded[:, t] + gamma * running
        returns[:, t] = running
    return returns[mask]
