"""A policy loss plus its regularisers: KL to the reference model and an entropy bonus.

`RegularizedLoss(loss, kl_coef=β, kl_estimator=k, entropy_coef=c)` returns
`loss + β · aggregate(k_t) - c · aggregate(H_t)`, both terms aggregated like the wrapped
loss, so they stay exact under micro-batching and leave out the tokens the batch's
`loss_mask` does not train (see `peerflow.algorithms.aggregation`).
The KL estimators' gradients are stated in `peerflow.algorithms.kl`; the step-level KL
metrics are written by `Algorithm.prepare_actor_batch`, not here, so they do not depend
on how many micro-batches a step has.
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.algorithms.aggregation import aggregate
from peerflow.algorithms.kl import KL_ESTIMATORS, kl_estimate
from peerflow.algorithms.ragged_ops import token_values
from peerflow.batch import Batch, RaggedField


class RegularizedLoss:
    """A `LossFunction`: the wrapped policy loss, plus KL, minus an entropy bonus."""

    def __init__(self, loss: Any, *, kl_coef: float = 0.0, kl_estimator: str = "k3",
                 entropy_coef: float = 0.0) -> None:
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown KL estimator {kl_estimator!r} (algorithm.kl.estimator); expected "
                f"one of {', '.join(KL_ESTIMATORS)}."
            )
        self.loss = loss
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.entropy_coef = entropy_coef

    @property
    def name(self) -> str:
        """The wrapped loss's name."""
        return getattr(self.loss, "name", type(self.loss).__name__)

    @property
    def options(self) -> Any:
        """The wrapped loss's options."""
        return getattr(self.loss, "options", None)

    @property
    def aggregation(self) -> str:
        """Aggregation of the extra terms (the wrapped loss's)."""
        return getattr(self.loss, "aggregation", "token-mean")

    @property
    def applies_importance_weights(self) -> bool:
        """Whether the wrapped loss applies `is_weights`."""
        return bool(getattr(self.loss, "applies_importance_weights", False))

    @property
    def needs_entropy(self) -> bool:
        """Whether the train engine must set the micro-batch field `entropy` (with grad)."""
        return self.entropy_coef > 0

    def _aggregate(self, values: torch.Tensor, logprobs: RaggedField, batch: Batch,
                   global_tokens: int, global_samples: int) -> torch.Tensor:
        return aggregate(
            values, logprobs.lengths, self.aggregation, global_tokens=global_tokens,
            global_samples=global_samples, norm_length=getattr(self.options, "norm_length", 0),
            mask=batch.loss_mask(),
        )

    def __call__(
        self, logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """See `peerflow.engines.LossFunction`.

        Raises:
            ValueError: the entropy bonus is on but the micro-batch has no `entropy`.
        """
        loss, metrics = self.loss(
            logprobs, batch, global_tokens=global_tokens, global_samples=global_samples
        )
        if self.kl_coef > 0:
            ref = token_values(batch, "ref_logprobs").detach().to(logprobs.values.dtype)
            kl = kl_estimate(logprobs.values, ref, self.kl_estimator)
            loss = loss + self.kl_coef * self._aggregate(kl, logprobs, batch, global_tokens,
                                                         global_samples)
        if self.entropy_coef > 0:
            if "entropy" not in batch:
                raise ValueError(
                    "algorithm.entropy_coef > 0 needs the micro-batch field 'entropy' (the "
                    "policy's per-token entropy with grad), which this train engine did not "
                    "set; use a train engine built on peerflow.training, or set "
                    "algorithm.entropy_coef: 0."
                )
            entropy = token_values(batch, "entropy").to(logprobs.values.dtype)
            loss = loss - self.entropy_coef * self._aggregate(entropy, logprobs, batch,
                                                              global_tokens, global_samples)
        return loss, metrics
