"""Off-policy correction (decoupled PPO) and the rollout-vs-trainer mismatch metrics.

Three policies meet in one update (Hilton et al., "Batch size-invariance for policy
optimization"; AReaL's decoupled PPO):

* the behaviour policy `π_behav` that sampled the tokens — the rollout engine's
  log-probs, `rollout_logprobs`, possibly several weight versions old (async mode,
  `weight_sync.every > 1`) and computed by another engine (vLLM vs FSDP);
* the proximal policy `π_prox` the PPO ratio is taken against — the trainer's log-probs
  of the current weights before the update, `old_logprobs`;
* the policy being trained `π_θ`.

The loss of token t is `w_t · max(-A_t r_t, -A_t clip(r_t))` with `r_t = π_θ / π_prox`
and the importance weight `w_t = π_prox / π_behav` (no grad), truncated (`tis`,
`min(w, cap)`) or masked (`mis`, `w` inside `[lower, cap]`, else 0). `importance_weights`
computes `w` once per step, before `train_step`, and the policy loss multiplies it in
(the batch field `is_weights`).

`mismatch_metrics` reports how far apart the two log-prob sources are on the tokens
actually sampled — the number to watch for inference/training drift.

Tokens the batch's `loss_mask` does not train (a multi-turn trajectory's observations;
their `rollout_logprobs` are 0 by convention, as the rollout did not sample them) get
weight 1 — the loss leaves them out anyway — and count in neither the weights'
statistics nor the mismatch metrics.

On the proximal fast path (no `old_logprob` node, see `peerflow.workflow.on_policy`)
`π_prox` is `π_θ` itself, detached: `CurrentProximal` wraps the policy loss and runs the
same `importance_weights` and `mismatch_metrics` on every micro-batch against the
current log-probs.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from peerflow.algorithms.ragged_ops import (
    LOG_RATIO_LIMIT,
    on_trained_tokens,
    ragged_like,
    response_lengths,
    token_values,
)
from peerflow.batch import Batch

CORRECTIONS: tuple[str, ...] = ("tis", "mis", "none")


@attrs.frozen(kw_only=True)
class ImportanceWeights:
    """Per-token importance weights of one batch and what they did."""

    weights: torch.Tensor  # [total_tokens], no grad, the dtype of `old_logprobs`
    """`w_t` after truncation or masking, aligned with `response_ids`."""
    raw_mean: float
    """Mean of `w_t` before truncation or masking."""
    raw_max: float
    """Largest `w_t` before truncation or masking."""
    mean: float
    """Mean of the weights applied."""
    limited_fraction: float
    """Fraction of tokens truncated (`tis`) or masked (`mis`)."""
    tokens: int
    """Tokens the statistics are over (the weight of the means across ranks)."""

    def metrics(self, correction: str) -> dict[str, tuple[str, float, float]]:
        """The `off_policy/*` metrics, as `{name: (reduction, value, weight)}`."""
        limited = "masked_fraction" if correction == "mis" else "truncated_fraction"
        return {
            "off_policy/is_weight_mean": ("mean", self.raw_mean, self.tokens),
            "off_policy/is_weight_max": ("max", self.raw_max, 1.0),
            "off_policy/applied_weight_mean": ("mean", self.mean, self.tokens),
            f"off_policy/{limited}": ("mean", self.limited_fraction, self.tokens),
        }


def importance_weights(batch: Batch, correction: str, cap: float,
                       lower: float = 0.0) -> ImportanceWeights | None:
    """Decoupled-PPO weights `π_prox / π_behav` per token, truncated or masked.

    Args:
        batch: Has `rollout_logprobs` (behaviour) and `old_logprobs` (proximal).
        correction: `tis` (truncate at `cap`), `mis` (zero outside `[lower, cap]`) or
            `none`.
        cap: Upper bound of a weight.
        lower: `mis` only: weights below it are masked too.

    Returns:
        The weights, or `None` when `correction` is `none` or the batch has no
        `old_logprobs` (then the loss's ratio is taken against `rollout_logprobs`
        itself and already is the importance weight).

    Raises:
        ValueError: an unknown `correction`, or `old_logprobs` without
            `rollout_logprobs`.
    """
    if correction not in CORRECTIONS:
        raise ValueError(
            f"algorithm.off_policy.correction={correction!r}: expected one of "
            f"{', '.join(CORRECTIONS)}."
        )
    if correction == "none" or "old_logprobs" not in batch:
        return None
    if "rollout_logprobs" not in batch:
        raise ValueError(
            "algorithm.off_policy.correction needs batch field 'rollout_logprobs' (the "
            "behaviour policy's log-probs, written by the generate node); keep the generate "
            "node's rollout_logprobs output, or set algorithm.off_policy.correction: none "
            "for an on-policy run."
        )
    log_w = (token_values(batch, "old_logprobs").to(torch.float64)
             - token_values(batch, "rollout_logprobs").to(torch.float64))
    raw = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    if correction == "tis":
        limited = raw > cap
        weights = raw.clamp(max=cap)
    else:
        limited = (raw > cap) | (raw < lower)
        weights = torch.where(limited, torch.zeros_like(raw), raw)
    mask = batch.loss_mask()
    if mask is not None:  # observation tokens: not sampled, weight 1, out of the statistics
        weights = torch.where(mask, weights, torch.ones_like(weights))
        raw, limited, kept = raw[mask], limited[mask], weights[mask]
    else:
        kept = weights
    n = raw.numel()
    return ImportanceWeights(
        weights=weights.to(token_values(batch, "old_logprobs").dtype),
        raw_mean=float(raw.mean()) if n else 1.0,
        raw_max=float(raw.max()) if n else 1.0,
        mean=float(kept.mean()) if n else 1.0,
        limited_fraction=float(limited.double().mean()) if n else 0.0,
        tokens=n,
    )


def mismatch_metrics(batch: Batch) -> dict[str, tuple[str, float, float]]:
    """Rollout-vs-trainer log-prob mismatch on the sampled tokens.

    With `Δ_t = rollout_logprobs - old_logprobs` on tokens drawn from the rollout policy:
    `mismatch/abs_mean` and `mismatch/abs_max` are the mean and max `|Δ_t|`;
    `mismatch/kl` estimates KL(π_rollout ‖ π_trainer) per token with Schulman's k3,
    `exp(-Δ) - 1 + Δ` (non-negative, unbiased for samples of π_rollout); `mismatch/kl_k1`
    is the plain `mean Δ_t`. Both policies at the same temperature and weights give 0.

    Returns:
        `{name: (reduction, value, weight)}` with reduction `mean` or `max`; empty when the
        batch lacks either field.
    """
    if "old_logprobs" not in batch or "rollout_logprobs" not in batch:
        return {}
    delta = (token_values(batch, "rollout_logprobs").to(torch.float64)
             - token_values(batch, "old_logprobs").to(torch.float64))
    delta = on_trained_tokens(delta, batch.loss_mask())
    n = delta.numel()
    if not n:
        return {}
    clamped = delta.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    k3 = torch.exp(-clamped) - 1 + clamped
    return {
        "mismatch/abs_mean": ("mean", float(delta.abs().mean()), n),
        "mismatch/abs_max": ("max", float(delta.abs().max()), 1.0),
        "mismatch/kl": ("mean", float(k3.mean()), n),
        "mismatch/kl_k1": ("mean", float(delta.mean()), n),
    }


def record_metrics(metrics: Any, values: dict[str, tuple[str, float, float]]) -> None:
    """Records `(reduction, value, weight)` triples in a `StepMetrics`-like object."""
    for name, (how, value, weight) in values.items():
        if how == "mean":
            metrics.mean(name, value, weight)
        else:
            metrics.max(name, value)


def attach_weights(batch: Batch, weights: ImportanceWeights) -> Batch:
    """Sets the batch field `is_weights` (ragged, aligned with `response_ids`)."""
    return batch.set("is_weights", ragged_like(weights.weights, response_lengths(batch)))


class CurrentProximal:
    """A `LossFunction` wrapper: without `old_logprobs`, `π_prox` is the current policy.

    Each such micro-batch gets `old_logprobs` = the current log-probs without grad (the
    wrapped loss's ratio is then 1 in value, its gradient the policy gradient), and the
    `is_weights` and `mismatch/*` / `off_policy/*` metrics that
    `Algorithm.prepare_actor_batch` computes per step when the graph recomputes
    `old_logprobs`. Those metrics come back as
    loss metrics, averaged over micro-batches like the others (a `*_max` metric is then
    the mean of the micro-batch maxima). Batches with `old_logprobs`, or without
    `rollout_logprobs`, go to the wrapped loss unchanged. Other attributes
    (`aggregation`, `needs_entropy`, …) are the wrapped loss's.
    """

    def __init__(self, loss: Any, off_policy: Any) -> None:
        """`off_policy` is `algorithm.off_policy` (`correction`, `cap`, `lower`)."""
        self.loss = loss
        self.off_policy = off_policy

    def __getattr__(self, name: str) -> Any:
        if name in ("loss", "off_policy"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.loss, name)

    def __call__(self, logprobs: Any, batch: Batch, *, global_tokens: int,
                 global_samples: int) -> tuple[torch.Tensor, dict[str, float]]:
        """See `peerflow.engines.LossFunction`."""
        values: dict[str, tuple[str, float, float]] = {}
        if "old_logprobs" not in batch and "rollout_logprobs" in batch:
            batch = attrs.evolve(batch, fields=dict(batch.fields))  # the caller's stays as is
            batch.set("old_logprobs", ragged_like(logprobs.values.detach(), logprobs.lengths))
            values = mismatch_metrics(batch)
            config = self.off_policy
            weights = importance_weights(batch, config.correction, config.cap, config.lower)
            if weights is not None:
                batch = attach_weights(batch, weights)
                values.update(weights.metrics(config.correction))
        loss, metrics = self.loss(logprobs, batch, global_tokens=global_tokens,
                                  global_samples=global_samples)
        return loss, {**metrics, **{name: value for name, (_, value, _) in values.items()}}
