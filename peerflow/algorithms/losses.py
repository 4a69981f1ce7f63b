"""Policy losses: PPO-clip and GSPO's sequence-level ratio.

PPO-clip has DAPO's decoupled clip-higher, dual-clip, and decoupled PPO's importance
weights (the batch field `is_weights`, see `peerflow.algorithms.off_policy`).

Both follow `peerflow.engines.LossFunction`: called once per micro-batch with the current
policy's per-token log-probs, they return this micro-batch's share of the mini-batch
loss (see `peerflow.algorithms.aggregation`) and micro-batch-local metrics.

The ratio's denominator is `old_logprobs` (the trainer's log-probs before the update)
when the batch has them, else the current log-probs detached (the proximal fast path,
see `peerflow.workflow.on_policy`: the ratio is 1 in value and its gradient is the plain
policy gradient; `peerflow.algorithms.off_policy.CurrentProximal` then weighs the
tokens against `rollout_logprobs`).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from peerflow.algorithms.aggregation import AGGREGATIONS, aggregate
from peerflow.algorithms.base import PolicyLoss
from peerflow.algorithms.ragged_ops import (
    LOG_RATIO_LIMIT,
    masked_mean,
    segment_mean,
    token_values,
)
from peerflow.batch import Batch, RaggedField


def _aggregation(_: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in AGGREGATIONS:
        raise ValueError(
            f"{attribute.name} {value!r} is not one of {', '.join(AGGREGATIONS)}."
        )


def _non_negative(_: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}.")


def old_logprobs(batch: Batch, logprobs: torch.Tensor) -> torch.Tensor:  # [total_tokens]
    """The ratio's denominator: `old_logprobs`, else the current log-probs detached."""
    if "old_logprobs" in batch:
        return token_values(batch, "old_logprobs").detach().to(logprobs.dtype)
    return logprobs.detach()


def batch_is_weights(batch: Batch, like: torch.Tensor) -> torch.Tensor | None:
    """The batch's decoupled-PPO weights `is_weights` (no grad), or `None` without them.

    Written once per step by `Algorithm.prepare_actor_batch` (see
    `peerflow.algorithms.off_policy`).
    """
    if "is_weights" not in batch:
        return None
    return token_values(batch, "is_weights").detach().to(like.dtype)


@attrs.frozen(kw_only=True)
class PPOClipOptions:
    """Options of `algorithm.options.ppo_clip`."""

    clip_low: float = attrs.field(default=0.2, validator=_non_negative)
    """The ratio is clipped below at `1 - clip_low`."""
    clip_high: float = attrs.field(default=0.2, validator=_non_negative)
    """The ratio is clipped above at `1 + clip_high` (DAPO's clip-higher: e.g. 0.28)."""
    dual_clip: float = attrs.field(default=0.0, validator=_non_negative)
    """Dual-clip constant c > 1: for negative advantages the loss is capped at `-c * A`;
    0 disables."""
    aggregation: str | None = attrs.field(default=None, validator=_aggregation)
    """`token-mean` (DAPO), `seq-mean-token-mean`, `seq-mean-token-sum` or
    `seq-mean-token-sum-norm`; `None` takes the advantage estimator's preference
    (Dr.GRPO asks for `seq-mean-token-sum-norm`), else `token-mean`."""
    norm_length: int = 0
    """Constant length of `seq-mean-token-sum-norm`; 0 uses
    `rollout.sampling.max_tokens`."""

    def __attrs_post_init__(self) -> None:
        if 0 < self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}.")


class PPOClip(PolicyLoss):
    """PPO's clipped surrogate, optionally dual-clipped and importance-weighted.

    Per token `max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))` with
    `r = exp(logp - logp_old)`, then aggregated.
    """

    name: ClassVar[str] = "ppo_clip"
    options_class: ClassVar[type] = PPOClipOptions
    applies_importance_weights: ClassVar[bool] = True
    default_aggregation: ClassVar[str] = "token-mean"

    @property
    def aggregation(self) -> str:
        """The aggregation mode in use."""
        return self.options.aggregation or self.default_aggregation

    def ratios(
        self, logprobs: torch.Tensor, old: torch.Tensor, lengths: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token importance ratios (with grad through `logprobs`); `mask`: `loss_mask`."""
        return (logprobs - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()

    def __call__(
        self, logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """See `peerflow.engines.LossFunction`."""
        current = logprobs.values
        lengths = logprobs.lengths
        old = old_logprobs(batch, current)
        advantages = token_values(batch, "advantages").detach().to(current.dtype)
        mask = batch.loss_mask()
        ratio = self.ratios(current, old, lengths, mask)
        opts = self.options
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - opts.clip_low, 1 + opts.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)
        if opts.dual_clip > 0:
            cap = -advantages * opts.dual_clip
            dual_clipped = (advantages < 0) & (per_token > cap)
            per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
        weights = batch_is_weights(batch, current)
        if weights is not None:
            per_token = per_token * weights
        loss = aggregate(
            per_token, lengths, self.aggregation, global_tokens=global_tokens,
            global_samples=global_samples, norm_length=opts.norm_length, mask=mask,
        )
        metrics = {
            "actor/pg_loss": masked_mean(per_token, mask),
            "actor/clipfrac": masked_mean(clipped > unclipped, mask),
            "actor/ppo_kl": masked_mean(old - current, mask),
            "actor/ratio_mean": masked_mean(ratio, mask),
        }
        if opts.dual_clip > 0:
            metrics["actor/dual_clipfrac"] = masked_mean(dual_clipped, mask)
        return loss, metrics


@attrs.frozen(kw_only=True)
class GSPOOptions(PPOClipOptions):
    """Options of `algorithm.options.gspo` (GSPO's clip ranges are tiny: 3e-4 / 4e-4)."""

    clip_low: float = attrs.field(default=3e-4, validator=_non_negative)
    """The sequence ratio is clipped below at `1 - clip_low`."""
    clip_high: float = attrs.field(default=4e-4, validator=_non_negative)
    """The sequence ratio is clipped above at `1 + clip_high`."""


class GSPO(PPOClip):
    """GSPO: PPO-clip on the sequence-level ratio, shared by every token of a sample.

    The ratio of sample i is `s_i = exp(mean_t (logp_t - logp_old_t))`, the mean over its
    trained tokens (`loss_mask`).

    Per token the ratio is `sg(s_i) * exp(logp_t - sg(logp_t))` (GSPO-token): its value
    is `s_i` and its gradient is `s_i * grad logp_t`, so each token's own advantage can be
    used. Default aggregation `seq-mean-token-mean`, as in the paper.
    """

    name: ClassVar[str] = "gspo"
    options_class: ClassVar[type] = GSPOOptions
    default_aggregation: ClassVar[str] = "seq-mean-token-mean"

    def ratios(
        self, logprobs: torch.Tensor, old: torch.Tensor, lengths: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sequence-level ratios (over trained tokens) broadcast to tokens, per-token grads."""
        seq_log_ratio = segment_mean(logprobs - old, lengths, mask).detach()
        per_token_log = (
            torch.repeat_interleave(seq_log_ratio, lengths)
            + logprobs - logprobs.detach()
        )
        return per_token_log.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
