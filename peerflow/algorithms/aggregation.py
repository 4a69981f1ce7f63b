"""Loss aggregation: how a per-token loss becomes one number, exact under micro-batching.

The modes are verl's `loss_agg_mode`.

Every mode divides by a *global* normaliser (`global_tokens`, `global_samples`, both
counted over the whole mini-batch on every dp-rank), so summing the gradients of all
micro-batches on all ranks gives exactly the gradient of the whole mini-batch at once.

Modes:

* `token-mean` — sum of every token's loss / `global_tokens` (DAPO's token-level loss;
  long answers weigh more).
* `seq-mean-token-mean` — each sample's token mean, summed / `global_samples` (GRPO's
  original sample-level loss, GSPO).
* `seq-mean-token-sum` — each sample's token sum, summed / `global_samples`.
* `seq-mean-token-sum-norm` — sum of every token's loss / (`global_samples` ×
  `norm_length`), a constant length (Dr.GRPO: no length normalisation).

With a per-token `mask` (the batch's `loss_mask`: false on a multi-turn trajectory's
observation tokens), only trained tokens count: a masked token adds nothing to any sum
(and gets zero gradient), a sample's token mean is over its trained tokens, and the
normalisers count trained tokens and samples with at least one trained token
(`Batch.trained_lengths`, summed by `peerflow.training.global_counts`). An all-true
mask gives exactly the loss of no mask.
"""

from __future__ import annotations

from typing import Literal

import torch

from peerflow.algorithms.ragged_ops import masked, segment_mean, segment_sum

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
)


def aggregate(
    per_token: torch.Tensor,
    lengths: torch.Tensor,
    mode: str,
    *,
    global_tokens: int,
    global_samples: int,
    norm_length: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduces a flat per-token loss (`[total_tokens]`) to this micro-batch's share.

    Args:
        per_token: Loss of every response token of the micro-batch, samples back to back.
        lengths: `[num_samples]` response lengths of the micro-batch.
        mode: One of `AGGREGATIONS`.
        global_tokens: Response tokens in the whole mini-batch across dp-ranks.
        global_samples: Samples in the whole mini-batch across dp-ranks.
        norm_length: The constant length of `seq-mean-token-sum-norm`.
        mask: `[total_tokens]` bool, false on untrained tokens; `None` trains all.

    Raises:
        ValueError: an unknown mode, a non-positive normaliser.
    """
    per_token = masked(per_token, mask)
    if mode == "token-mean":
        return per_token.sum() / _positive(global_tokens, "global_tokens")
    if mode == "seq-mean-token-mean":
        means = segment_mean(per_token, lengths, mask)
        return means.sum() / _positive(global_samples, "global_samples")
    if mode == "seq-mean-token-sum":
        return segment_sum(per_token, lengths).sum() / _positive(global_samples, "global_samples")
    if mode == "seq-mean-token-sum-norm":
        if norm_length <= 0:
            raise ValueError(
                "loss aggregation 'seq-mean-token-sum-norm' needs norm_length > 0 (the "
                f"generation budget), got {norm_length}; set the loss option norm_length or "
                "rollout.sampling.max_tokens."
            )
        return per_token.sum() / (_positive(global_samples, "global_samples") * norm_length)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}."
    )


def _positive(value: int, name: str) -> int:
    if value <= 0:
        raise ValueError(f"loss normaliser {name}={value}; it must count the whole mini-batch "
                         "(> 0) across dp-ranks.")
    return value
