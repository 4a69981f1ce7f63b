"""`opo`: group advantages against the length-weighted optimal baseline (OPO)."""

from __future__ import annotations

import attrs
import torch

from peerflow.algorithms import AdvantageEstimator
from peerflow.batch import Batch, RaggedField


@attrs.frozen(kw_only=True)
class OPOOptions:
    """Options of the `opo` estimator."""

    min_group_size: int = 2
    """Groups smaller than this get zero advantage (no baseline can be formed)."""


class OPOAdvantage(AdvantageEstimator):
    """Advantage `r_i - b` with `b = Σ_j |y_j| r_j / Σ_j |y_j|` over the prompt's group.

    Weighting the baseline by response length minimises the variance of the token-level
    policy gradient for sequence-level rewards. Every response token gets its sample's
    advantage.
    """

    name = "opo"
    options_class = OPOOptions

    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns `advantages` (ragged, aligned with `response_ids`)."""
        rewards = torch.as_tensor(batch["reward"], dtype=torch.float32)
        lengths = batch.lengths("response_ids").to(torch.float32)
        advantages = torch.zeros_like(rewards)
        for group in torch.unique(batch.group_id):
            members = batch.group_id == group
            if int(members.sum()) < self.options.min_group_size:
                continue
            weights = lengths[members]
            baseline = (weights * rewards[members]).sum() / weights.sum().clamp_min(1.0)
            advantages[members] = rewards[members] - baseline
        per_token = [advantages[i].expand(int(n)) for i, n in enumerate(lengths.tolist())]
        return {"advantages": RaggedField.from_tensors(per_token, dtype=torch.float32)}
