"""Small ragged-tensor helpers the estimators and losses share.

A ragged field stores every sample's tokens back to back (`values`, `[total_tokens]`)
with per-sample `lengths` (`[num_samples]`); these helpers do per-sample reductions and
broadcasts on that flat layout without padding.

Device: every helper computes where its arguments live and creates what it needs there;
its tensor arguments share one device (all of one `Batch` do, by its invariant): host
for the estimators, the engine's device inside a loss.
"""

from __future__ import annotations

import torch

from peerflow.batch import Batch, RaggedField, offsets_from_lengths

#: Log-ratios are clamped to ±this before `exp` (ratios, importance weights, k3), so one
#: wild token cannot overflow; verl clamps at the same bound.
LOG_RATIO_LIMIT = 20.0


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:  # [total_tokens]
    """Returns, for every token, the index of the sample it belongs to."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)


def segment_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # [num_samples]
    """Sums each sample's tokens (differentiable)."""
    out = values.new_zeros(len(lengths))
    return out.index_add(0, segment_ids(lengths), values)


def segment_mean(values: torch.Tensor, lengths: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:  # [num_samples]
    """Averages each sample's tokens (only those where `mask` is true); empty samples give 0."""
    counts = lengths if mask is None else segment_sum(mask.long(), lengths)
    return segment_sum(masked(values, mask), lengths) / counts.clamp(min=1).to(values.dtype)


def masked(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`values` with untrained tokens (`mask` false) set to 0; unchanged when `mask` is `None`.

    A `where`, not a product: a masked token's value and gradient are exactly 0 even when
    its unmasked value is not finite.
    """
    if mask is None:
        return values
    return torch.where(mask, values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> float:
    """Mean of `values` over the trained tokens (`mask` true; all when `None`); 0 if none."""
    with torch.no_grad():
        kept = on_trained_tokens(values, mask)
        return float(kept.double().mean()) if kept.numel() else 0.0


def per_token(per_sample: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # [total_tokens]
    """Broadcasts one value per sample to every token of that sample."""
    return torch.repeat_interleave(per_sample, lengths)


def response_lengths(batch: Batch) -> torch.Tensor:  # [num_samples]
    """Per-sample response lengths (of `response_ids`)."""
    return batch.lengths("response_ids")


def ragged_like(values: torch.Tensor, lengths: torch.Tensor) -> RaggedField:
    """Wraps flat per-token `values` as a ragged field with the given `lengths`."""
    return RaggedField(values=values, offsets=offsets_from_lengths(lengths))


def token_values(batch: Batch, name: str) -> torch.Tensor:  # [total_tokens]
    """Returns ragged field `name` as flat values, checking it lines up with `response_ids`.

    Raises:
        ValueError: the field's per-sample lengths differ from `response_ids`'.
    """
    field = batch.ragged(name)
    expected = response_lengths(batch)
    if not torch.equal(field.lengths, expected):
        bad = int((field.lengths != expected).nonzero()[0, 0])
        raise ValueError(
            f"batch field {name!r} is not aligned with 'response_ids': sample {bad} has "
            f"{int(field.lengths[bad])} values for {int(expected[bad])} response tokens; "
            f"the node that writes {name!r} must emit one value per response token."
        )
    return field.values


def group_index(group_id: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Maps arbitrary group ids to `0 … num_groups-1`, for reductions.

    Returns:
        `(index [num_samples], num_groups)`.
    """
    uniques, inverse = torch.unique(group_id, return_inverse=True)
    return inverse, len(uniques)


def group_stats(
    values: torch.Tensor, group_id: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for size-1 groups).

    Args:
        values: `[num_samples]` float values (e.g. rewards).
        group_id: `[num_samples]` group ids.

    Returns:
        `(count, mean, std)`, each `[num_samples]`, the statistics of the sample's group.
    """
    index, num_groups = group_index(group_id)
    values = values.to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=values.device)
    count = zeros.index_add(0, index, torch.ones_like(values))
    mean = zeros.index_add(0, index, values) / count
    sq = zeros.index_add(0, index, (values - mean[index]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return count[index], mean[index], std[index]


def whiten(values: torch.Tensor, process_group: object = None, eps: float = 1e-8,
           replicas: int = 1) -> torch.Tensor:
    """Normalises `values` to zero mean and unit (unbiased) std over the whole batch.

    With a `process_group`, the count, sum and sum of squares are all-reduced first, so
    every rank normalises by the statistics of all ranks' values together; `replicas`
    ranks of the group hold each shard (tensor/pipeline peers), so the sums are divided
    by it. Estimators whiten the values of trained tokens only (`on_trained_tokens`).
    """
    flat = values.detach().to(torch.float64)
    stats = torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(), (flat**2).sum()])
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(stats, group=process_group)
        stats = stats / max(replicas, 1)
    count, total, sq = stats.tolist()
    if count == 0:
        return values
    mean = total / count
    var = (sq - count * mean * mean) / max(count - 1, 1)
    return ((values - mean) / (max(var, 0.0) ** 0.5 + eps)).to(values.dtype)


def on_trained_tokens(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The values of the trained tokens only (`mask` true), samples still back to back."""
    return values if mask is None else values[mask]


def to_response_tokens(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Spreads per-trained-token `values` back over all response tokens, 0 on the others."""
    if mask is None:
        return values
    full = values.new_zeros(len(mask))
    full[mask] = values
    return full


def pad(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads flat per-token values to `[num_samples, max_len]` with zeros.

    Returns:
        `(padded, mask)`; `padded[mask]` gives `values` back.
    """
    width = int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    padded = values.new_zeros((len(lengths), width))
    padded[mask] = values
    return padded, mask
