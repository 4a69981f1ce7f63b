"""The few data-parallel reductions a training step needs.

Every function takes the group (or `None` for one process); with no group, or a group of
one, nothing is communicated. What is reduced here are host numbers (counts, metric
sums), so the tensors are host tensors and travel over the group's gloo backend (every
PeerFlow group has one: `peerflow.distributed.devices`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from peerflow.batch import Batch


def _spans_ranks(group: object | None) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_max(value: int, group: object | None) -> int:
    """The largest `value` over the ranks of `group`."""
    if not _spans_ranks(group):
        return value
    agreed = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed.item())


def all_reduce_sum(values: Sequence[float], group: object | None) -> list[float]:
    """Element-wise sums of `values` over the ranks of `group` (float64)."""
    if not _spans_ranks(group):
        return [float(v) for v in values]
    total = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total.tolist()


def global_counts(batch: Batch, group: object | None) -> tuple[int, int]:
    """`(trained response tokens, trained samples)` of `batch` summed over the ranks of `group`.

    These are the normalisers a `LossFunction` receives (`global_tokens`,
    `global_samples`), so its micro-batch losses add up to the mini-batch loss. Only
    tokens the batch's `loss_mask` trains count (every response token without one), and
    only samples with at least one such token (see `peerflow.algorithms.aggregation`).
    """
    trained = batch.trained_lengths() if len(batch) else torch.zeros(0, dtype=torch.int64)
    summed = all_reduce_sum([int(trained.sum()), int((trained > 0).sum())], group)
    return int(summed[0]), int(summed[1])


def check_layout_spans_world(layout: object, *, backend: str, why: str, fix: str) -> None:
    """Raises unless a train engine's layout covers every process of the default group.

    For engines whose parallel state is global (DeepSpeed's ZeRO partitions, Megatron's
    parallel state): they cannot train on a subset of the ranks.

    Args:
        layout: The engine's `ParallelLayout`.
        backend: The `trainer.backend` named in the error.
        why: Why this engine needs every rank.
        fix: What to change.

    Raises:
        ConfigError: `layout.world_size` is not the default group's size.
    """
    from peerflow.errors import ConfigError

    world = dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError(f"trainer.backend={backend}: the trainer layout {layout.describe()} "
                          f"must span all {world} processes ({why}); {fix}.")
