"""DAPO dynamic sampling: drop groups whose answers all got the same reward.

Such a group has zero advantage under any group-relative estimator, so it adds no
gradient, only noise in the normalisers. The worker calls `filter_groups` after the
reward node; if fewer than the wanted number of groups remain it generates
`refill_groups` more prompts' worth and calls it again on the union (DAPO's loop), then
`take_groups` trims the batch to exactly the wanted number. Samples that training will
leave out whatever happens (failed ones, `peerflow.algorithms.failed_samples`) are passed
as `excluded`: a group is judged on the others alone, so one whose failure policy drops
it all counts as dropped and is refilled like a flat one.
"""

from __future__ import annotations

import attrs
import torch

from peerflow.batch import Batch


@attrs.frozen(kw_only=True)
class DynamicSamplingResult:
    """What `filter_groups` kept and how many groups are still needed."""

    batch: Batch
    """The samples of the kept groups, in their original order."""
    kept_groups: int
    """Groups with reward variance."""
    dropped_groups: int
    """Groups whose kept samples' rewards were all equal (within `tolerance`), or that
    kept no sample."""
    refill_groups: int
    """`max(0, target_groups - kept_groups)`: prompts still to sample."""

    def metrics(self) -> dict[str, float]:
        """Metrics for `metrics.jsonl` (`dynamic_sampling/*`)."""
        total = self.kept_groups + self.dropped_groups
        return {
            "dynamic_sampling/kept_groups": float(self.kept_groups),
            "dynamic_sampling/dropped_groups": float(self.dropped_groups),
            "dynamic_sampling/dropped_fraction": self.dropped_groups / total if total else 0.0,
        }


def filter_groups(
    batch: Batch, target_groups: int | None = None, *, key: str = "reward",
    tolerance: float = 1e-6, excluded: torch.Tensor | None = None,
) -> DynamicSamplingResult:
    """Drops every group whose `key` values are all equal over its kept samples.

    Args:
        batch: Whole groups (samples sharing `group_id`), with a `[num_samples]` `key`.
        target_groups: Groups the step wants; `None` means the groups in `batch`.
        key: Field scored per sample (the reward; `score` to ignore a KL penalty).
        tolerance: Max-minus-min spread below which rewards count as equal.
        excluded: `[num_samples]` bool, samples training leaves out in any case: they
            take no part in the comparison (a group of none, or of one, is dropped).
    """
    values = batch[key]
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"dynamic sampling reads batch field {key!r} as a [num_samples] tensor.")
    uniques, index = torch.unique(batch.group_id, return_inverse=True)
    values = values.to(torch.float64)
    lows, highs = values, values
    if excluded is not None:
        lows = values.masked_fill(excluded, torch.inf)
        highs = values.masked_fill(excluded, -torch.inf)
    high = torch.full((len(uniques),), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, index, highs, reduce="amax")
    low = torch.full((len(uniques),), torch.inf, dtype=torch.float64).scatter_reduce(
        0, index, lows, reduce="amin")
    keep_group = (high - low) > tolerance
    keep = keep_group[index].nonzero().flatten()
    kept = int(keep_group.sum())
    target = len(uniques) if target_groups is None else target_groups
    return DynamicSamplingResult(
        batch=batch.select(keep),
        kept_groups=kept,
        dropped_groups=len(uniques) - kept,
        refill_groups=max(0, target - kept),
    )


def take_groups(batch: Batch, num_groups: int) -> Batch:
    """Keeps the first `num_groups` groups (in order of first appearance)."""
    seen: dict[int, None] = {}
    for gid in batch.group_id.tolist():
        seen.setdefault(gid, None)
    wanted = set(list(seen)[:num_groups])
    return batch.select([i for i, gid in enumerate(batch.group_id.tolist()) if gid in wanted])


def top_up(batch: Batch, flat: Batch) -> Batch:
    """`batch` followed by `flat` groups that only fill the step, with `train_mask`.

    Every dp-rank trains on the same number of groups (train engines step in lock-step),
    so when refills run out the step is topped up with flat groups. They carry zero
    group-relative advantage, but they must not count in the loss's token and sample
    normalisers either: their `train_mask` is `False` and the actor's batch leaves them
    out (`Algorithm.prepare_actor_batch`). Both parts get the field, so batches from
    every rank concatenate.
    """
    batch.set("train_mask", torch.ones(len(batch), dtype=torch.bool))
    flat.set("train_mask", torch.zeros(len(flat), dtype=torch.bool))
    return Batch.concat([batch, flat])
