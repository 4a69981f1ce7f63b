"""KL divergence to a frozen reference model, as a loss term or a reward penalty.

Per-token estimators of `KL(policy || reference)` from samples of the policy
(Schulman, "Approximating KL divergence"), with `log_ratio = logp - ref_logp`:

* `k1 = log_ratio` — unbiased, high variance, can be negative;
* `k2 = log_ratio^2 / 2` — biased, low variance, non-negative;
* `k3 = exp(-log_ratio) - 1 + log_ratio` — unbiased, low variance, non-negative
  (GRPO's choice).

The worker uses them in one of two ways (`algorithm.kl.mode`):

* `loss` — wrap the policy loss in `KLRegularizedLoss`, which adds
  `coef * aggregate(kl_t)` computed on the current log-probs (with grad);
* `reward` — call `apply_kl_penalty(batch, coef, estimator)` before the advantage node:
  it subtracts `coef * sum_t kl_t` from each sample's `reward` (keeping the raw reward
  in `score`); with `per_token=True` (for the token-level estimators `gae` and
  `reinforce_pp`, see `Algorithm.kl_penalty`) it subtracts `coef * kl_t` from each
  token's `token_rewards` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.algorithms.aggregation import aggregate
from peerflow.algorithms.ragged_ops import segment_sum, token_values
from peerflow.batch import Batch, RaggedField

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

#: Log-ratios are clamped here before `exp` in k3 (verl's low-variance KL does the same).
LOG_RATIO_LIMIT = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs; differentiable in `logprobs`).

    Raises:
        ValueError: `estimator` is not k1, k2 or k3.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(
        f"unknown KL estimator {estimator!r} (algorithm.kl.estimator); expected one of "
        f"{', '.join(KL_ESTIMATORS)}."
    )


class KLRegularizedLoss:
    """A policy loss plus `coef * KL(policy || reference)` (a `LossFunction`).

    The KL term is aggregated like the wrapped loss (its `aggregation` attribute when it
    has one, else `token-mean`) and uses the batch's `ref_logprobs`.
    """

    def __init__(self, loss: Any, coef: float, estimator: str = "k3") -> None:
        if estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown KL estimator {estimator!r} (algorithm.kl.estimator); expected one of "
                f"{', '.join(KL_ESTIMATORS)}."
            )
        self.loss = loss
        self.coef = coef
        self.estimator = estimator

    @property
    def name(self) -> str:
        """The wrapped loss's name."""
        return getattr(self.loss, "name", type(self.loss).__name__)

    @property
    def aggregation(self) -> str:
        """Aggregation of the KL term (the wrapped loss's)."""
        return getattr(self.loss, "aggregation", "token-mean")

    def __call__(
        self, logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """See `peerflow.engines.LossFunction`."""
        loss, metrics = self.loss(
            logprobs, batch, global_tokens=global_tokens, global_samples=global_samples
        )
        ref = token_values(batch, "ref_logprobs").detach().to(logprobs.values)
        kl = kl_estimate(logprobs.values, ref, self.estimator)
        options = getattr(self.loss, "options", None)
        kl_loss = aggregate(
            kl, logprobs.lengths, self.aggregation, global_tokens=global_tokens,
            global_samples=global_samples, norm_length=getattr(options, "norm_length", 0),
        )
        metrics = dict(metrics)
        metrics["kl/mean"] = float(kl.detach().mean()) if kl.numel() else 0.0
        metrics["kl/loss"] = float(kl_loss.detach()) * self.coef
        return loss + self.coef * kl_loss, metrics


def apply_kl_penalty(
    batch: Batch,
    coef: float,
    estimator: str = "k1",
    logprobs_field: str | None = None,
    *,
    per_token: bool = False,
) -> dict[str, float]:
    """Subtracts `coef * sum_t kl_t` from every sample's `reward`, in place.

    With `per_token`, subtracts `coef * kl_t` from `token_rewards` (created as zeros when
    missing) and leaves `reward` alone.

    Args:
        batch: Has `reward`, `ref_logprobs` and the sampling policy's log-probs.
        coef: KL coefficient.
        estimator: `k1`, `k2` or `k3`.
        logprobs_field: Field holding the policy's log-probs; default `old_logprobs` when
            present, else `rollout_logprobs`.
        per_token: Penalise `token_rewards` per token instead of the sample's `reward`.

    Returns:
        Metrics `kl/mean` (per-token mean) and `kl/penalty_mean` (mean penalty a sample).

    Raises:
        KeyError: a needed field is missing (naming it).
    """
    if logprobs_field is None:
        logprobs_field = "old_logprobs" if "old_logprobs" in batch else "rollout_logprobs"
    logprobs = token_values(batch, logprobs_field).detach().to(torch.float64)
    ref = token_values(batch, "ref_logprobs").detach().to(torch.float64)
    kl = kl_estimate(logprobs, ref, estimator)
    penalty = coef * segment_sum(kl, batch.lengths("response_ids"))
    offsets = batch.ragged(logprobs_field).offsets
    if per_token:
        previous = (token_values(batch, "token_rewards").to(torch.float64)
                    if "token_rewards" in batch else torch.zeros_like(kl))
        batch.set("token_rewards", RaggedField(
            values=(previous - coef * kl).to(torch.float32), offsets=offsets))
    else:
        reward = batch["reward"]
        if "score" not in batch:
            batch.set("score", reward.clone())
        batch.set("reward", (reward.to(torch.float64) - penalty).to(reward.dtype))
    batch.set("kl", RaggedField(values=kl.to(torch.float32), offsets=offsets))
    return {
        "kl/mean": float(kl.mean()) if kl.numel() else 0.0,
        "kl/penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
    }
