"""The few data-parallel reductions a training step needs, and device moves.

Every function takes the group (or `None` for one process) and the device its backend
reduces on (`cpu` for gloo, the rank's GPU for NCCL); with no group, or a group of one,
nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from peerflow.batch import Batch, RaggedField


def _spans_ranks(group: object | None) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(device: torch.device) -> torch.device:
    """The device a dp-group reduction runs on for an engine on `device` (NCCL on GPU)."""
    return device if device.type == "cuda" else torch.device("cpu")


def all_reduce_max(value: int, group: object | None, device: torch.device | str = "cpu") -> int:
    """The largest `value` over the ranks of `group`."""
    if not _spans_ranks(group):
        return value
    agreed = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed.item())


def all_reduce_sum(values: Sequence[float], group: object | None,
                   device: torch.device | str = "cpu") -> list[float]:
    """Element-wise sums of `values` over the ranks of `group` (float64)."""
    if not _spans_ranks(group):
        return [float(v) for v in values]
    total = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return total.tolist()


def global_counts(batch: Batch, group: object | None,
                  device: torch.device | str = "cpu") -> tuple[int, int]:
    """`(trained response tokens, trained samples)` of `batch` summed over the ranks of `group`.

    These are the normalisers a `LossFunction` receives (`global_tokens`,
    `global_samples`), so its micro-batch losses add up to the mini-batch loss. Only
    tokens the batch's `loss_mask` trains count (every response token without one), and
    only samples with at least one such token (see `peerflow.algorithms.aggregation`).
    """
    trained = batch.trained_lengths() if len(batch) else torch.zeros(0, dtype=torch.int64)
    summed = all_reduce_sum([int(trained.sum()), int((trained > 0).sum())], group, device)
    return int(summed[0]), int(summed[1])


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its tensor fields on `device` (the batch itself on CPU)."""
    if device.type == "cpu":
        return batch
    fields = {}
    for name, column in batch.fields.items():
        if isinstance(column, RaggedField):
            fields[name] = RaggedField(values=column.values.to(device),
                                       offsets=column.offsets.to(device))
        elif isinstance(column, torch.Tensor):
            fields[name] = column.to(device)
        else:
            fields[name] = column
    return Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                 weight_version=batch.weight_version, fields=fields)
