"""The metrics every train engine reports from `train_step`, under the same names.

* the loss's own metrics (`actor/pg_loss`, `kl/mean`, …), averaged over this rank's
  micro-batches (the run's metrics writer weights ranks by their samples);
* `loss`: the mini-batch loss (the sum of its micro-batch losses over every dp-rank),
  averaged over mini-batches;
* `entropy`: mean entropy of the tempered policy over every trained response token of
  the step (`loss_mask`), on every dp-rank (policy engines only);
* `padded_tokens`: positions the model's forward and backward ran over, padding
  included, summed over micro-batches, mini-batches and dp-ranks (the step's compute
  in tokens; compare with the batch's real tokens to see the padding);
* `grad_norm`: global gradient norm before clipping, averaged over mini-batches;
* `lr`: the learning rate of the last optimiser step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from peerflow.training.collectives import all_reduce_sum


@attrs.define(eq=False)
class StepTally:
    """Accumulates one `train_step`'s metrics on one rank."""

    _sums: dict[str, float] = attrs.field(factory=dict)
    _counts: dict[str, int] = attrs.field(factory=dict)
    _loss: float = 0.0
    _entropy_sum: float = 0.0
    _entropy_tokens: int = 0
    _padded_tokens: int = 0
    _grad_norms: list[float] = attrs.field(factory=list)
    _lr: float | None = None

    def add_micro_batch(self, loss: torch.Tensor, metrics: Mapping[str, Any],
                        entropy: torch.Tensor | None, padded_tokens: int) -> None:
        """Records one micro-batch's loss, the loss's metrics and token entropies.

        `entropy` holds one value per trained response token (`None` for a critic);
        `padded_tokens` is the size of the micro-batch's padded inputs.
        """
        self._loss += float(loss.detach())
        self._padded_tokens += padded_tokens
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)
            self._counts[key] = self._counts.get(key, 0) + 1
        if entropy is not None:
            self._entropy_sum += float(entropy.detach().sum())
            self._entropy_tokens += int(entropy.numel())

    def add_optimizer_step(self, grad_norm: float, lr: float | None = None) -> None:
        """Records one mini-batch's optimiser step and the learning rate it applied."""
        self._grad_norms.append(float(grad_norm))
        if lr is not None:
            self._lr = float(lr)

    def summary(self, *, group: object | None, lr: float,
                share: Callable[[Any], Any] = lambda value: value) -> dict[str, float]:
        """The step's metrics (collective over `group`, the dp group).

        Args:
            group: The data-parallel group the loss and entropy are summed over.
            lr: The learning rate, reported when no optimiser step recorded its own.
            share: Hands the metrics computed where the loss runs (a pipeline's last
                stage) to every rank; identity without pipelining.
        """
        loss, entropy_sum, tokens, padded = all_reduce_sum(
            [self._loss, self._entropy_sum, self._entropy_tokens, self._padded_tokens], group)
        steps = max(len(self._grad_norms), 1)
        metrics = {key: self._sums[key] / self._counts[key] for key in self._sums}
        metrics["loss"] = loss / steps
        metrics["padded_tokens"] = padded
        if tokens:
            metrics["entropy"] = entropy_sum / tokens
        metrics = dict(share(metrics))
        norms = self._grad_norms
        metrics["grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        metrics["lr"] = float(lr if self._lr is None else self._lr)
        return metrics
