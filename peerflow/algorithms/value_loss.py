"""The critic's clipped value loss (PPO)."""

from __future__ import annotations

import attrs
import torch

from peerflow.algorithms.aggregation import AGGREGATIONS, aggregate
from peerflow.algorithms.ragged_ops import masked_mean, token_values
from peerflow.batch import Batch, RaggedField


@attrs.frozen(kw_only=True)
class ValueLossOptions:
    """Options of the value loss (set through `algorithm.options.gae`)."""

    clip: float = 0.2
    """Values may move at most this far from the sampling-time values before the clipped
    term takes over (0 disables clipping)."""
    coef: float = 1.0
    """Scale of the loss."""
    aggregation: str = attrs.field(
        default="token-mean", validator=attrs.validators.in_(AGGREGATIONS)
    )
    """How per-token losses are reduced (see `peerflow.algorithms.aggregation`)."""


class ClippedValueLoss:
    """PPO's clipped value loss `coef * 0.5 * max((V - R)^2, (V_clip - R)^2)`.

    `V_clip = V_old + clip(V - V_old, -clip, clip)`.

    Satisfies `peerflow.engines.LossFunction`; its first argument is the critic's current
    per-token values (what `forward_values` computes, with grad). Reads `values` (the
    values at sampling time, `V_old`) and `returns` (targets from GAE). Tokens the
    batch's `loss_mask` does not train (observations) are left out, as in the policy loss.
    """

    name = "value_clip"
    options_class = ValueLossOptions

    def __init__(self, options: ValueLossOptions | None = None) -> None:
        self.options = options if options is not None else ValueLossOptions()

    def __call__(
        self, logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns `(loss, metrics)` for one micro-batch; `logprobs` holds the values."""
        values = logprobs.values
        old = token_values(batch, "values").detach().to(values.dtype)
        returns = token_values(batch, "returns").detach().to(values.dtype)
        unclipped = (values - returns) ** 2
        clip = self.options.clip
        if clip > 0:
            clipped_values = old + (values - old).clamp(-clip, clip)
            clipped = (clipped_values - returns) ** 2
            per_token = 0.5 * torch.maximum(unclipped, clipped)
        else:
            clipped = unclipped
            per_token = 0.5 * unclipped
        mask = batch.loss_mask()
        loss = self.options.coef * aggregate(
            per_token, logprobs.lengths, self.options.aggregation,
            global_tokens=global_tokens, global_samples=global_samples, mask=mask,
        )
        metrics = {
            "critic/vf_loss": masked_mean(per_token, mask),
            "critic/vf_clipfrac": masked_mean(clipped > unclipped, mask),
            "critic/vpred_mean": masked_mean(values, mask),
        }
        return loss, metrics
