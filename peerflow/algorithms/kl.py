"""KL divergence to a frozen reference model, as a loss term or a reward penalty.

Per-token estimators (Schulman, "Approximating KL divergence"), with
`x = log_ratio = logp - ref_logp` on tokens sampled from the policy π:

* `k1 = x` — its *value* is an unbiased estimate of KL(π ‖ ref);
* `k2 = x² / 2` — biased value, non-negative;
* `k3 = exp(-x) - 1 + x` — unbiased value of KL(π ‖ ref), non-negative (GRPO's).

What matters for training is the *gradient*. With the sampled tokens held fixed (the
loss is differentiated through `logp` only, as every trainer does):

* as a **loss** (`kl.mode: loss`, `RegularizedLoss`): `E_π[∇k1] = E_π[∇logπ] = 0` —
  `k1` has zero expected gradient (a warning says so); `E_π[∇k2] = E_π[x ∇logπ] =
  ∇KL(π ‖ ref)` — `k2` is the forward-KL gradient; `E_π[∇k3] = E_π[(1 - ref/π) ∇logπ] =
  -Σ ref ∇logπ = ∇KL(ref ‖ π)` — `k3` gives the reverse direction's gradient.
* as a **reward** (`kl.mode: reward`, `apply_kl_penalty`): the policy gradient is the
  score function times the penalty, `E_π[∇logπ(y) · Σ_t k_t]`; for `k1` this is
  `∇KL(π ‖ ref)` (the default, as in verl's in-reward penalty), for `k3` it is not.
  Per token for the token-level estimators (`gae`, `reinforce_pp`): `-coef · k1_t` is
  added to `token_rewards`, so each token's return carries only the KL still ahead of it.

Tokens the batch's `loss_mask` does not train (a multi-turn trajectory's observations,
which the policy did not sample) have KL 0 in the penalty and are left out of the loss
term and the metrics.

`tests/unit/test_algorithms_kl.py` checks these four statements on an exact small
categorical policy.
"""

from __future__ import annotations

import torch

from peerflow.algorithms.aggregation import aggregate
from peerflow.algorithms.ragged_ops import (
    LOG_RATIO_LIMIT,
    masked,
    masked_mean,
    segment_sum,
    token_values,
)
from peerflow.batch import Batch, RaggedField

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")



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
    mask = batch.loss_mask()
    kl = masked(kl_estimate(logprobs, ref, estimator), mask)
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
        "kl/mean": masked_mean(kl, mask),
        "kl/penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
    }


def kl_loss_metrics(batch: Batch, coef: float, estimator: str,
                    loss: object = None) -> dict[str, tuple[str, float, float]]:
    """`kl/mean` and `kl/loss` of a whole step, for `kl.mode: loss`.

    Computed once per step on the policy before the update (`old_logprobs`, else
    `rollout_logprobs`) against `ref_logprobs`, aggregated like the policy loss over this
    rank's whole batch — so, unlike a per-micro-batch share, it does not change with the
    micro-batch count. `kl/loss` is `coef` times that aggregate (the KL term's value).

    Returns:
        `{name: ("mean", value, weight)}`, weighted by tokens (`token-mean`) or samples.
    """
    field = "old_logprobs" if "old_logprobs" in batch else "rollout_logprobs"
    if not len(batch) or field not in batch or "ref_logprobs" not in batch:
        return {}
    lengths = batch.lengths("response_ids")
    trained = batch.trained_lengths()
    tokens, samples = int(trained.sum()), int((trained > 0).sum())
    if not tokens:
        return {}
    mask = batch.loss_mask()
    kl = kl_estimate(token_values(batch, field).to(torch.float64),
                     token_values(batch, "ref_logprobs").to(torch.float64), estimator)
    mode = getattr(loss, "aggregation", "token-mean")
    norm_length = getattr(getattr(loss, "options", None), "norm_length", 0) or int(lengths.max())
    value = float(aggregate(kl, lengths, mode, global_tokens=tokens, global_samples=samples,
                            norm_length=norm_length, mask=mask))
    weight = tokens if mode == "token-mean" else samples
    return {"kl/mean": ("mean", masked_mean(kl, mask), tokens),
            "kl/loss": ("mean", coef * value, weight)}
