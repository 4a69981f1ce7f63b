"""Cut a `ReshardPlan` into buckets of bounded size, the same way on every rank.

A bucket is a set of whole destination tensors (a rollout engine's `load_weights` takes
complete local tensors), chosen so that the destination bytes of one bucket, summed over
all destination ranks, stay within `bucket_bytes`. Tensors sharing a local name on
several ranks (the tp shards of one parameter) go into the same bucket when they fit, so
the source tensor feeding them is materialised once. A single tensor larger than
`bucket_bytes` travels alone (the "largest piece" term of the memory bound).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from peerflow.errors import ConfigError
from peerflow.reshard.plan import ReshardPlan, Transfer


@attrs.frozen(kw_only=True)
class Bucket:
    """Destination tensors moved together, and the transfers that fill them."""

    index: int
    """Position in the sync (0-based)."""
    targets: tuple[tuple[int, str], ...]
    """`(destination rank, local tensor name)` of every tensor filled by this bucket."""
    transfers: tuple[Transfer, ...]
    """The plan's transfers into those tensors, in plan order."""
    source_tensors: tuple[str, ...]
    """Local names of the source tensors read (every trainer rank materialises its
    specs with these names, replicas included, so collective gathers line up)."""
    nbytes: int
    """Destination bytes of the bucket, all ranks together."""


@functools.cache
def itemsize(dtype: str) -> int:
    """Returns the bytes per element of a torch dtype name."""
    return getattr(torch, dtype).itemsize


def make_buckets(plan: ReshardPlan, bucket_bytes: int) -> list[Bucket]:
    """Splits `plan` into buckets of at most `bucket_bytes` destination bytes.

    Raises:
        ConfigError: `bucket_bytes` is not positive.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"weight_sync.bucket_bytes={bucket_bytes}: must be positive "
                          "(e.g. 268435456 for 256 MiB).")
    groups: dict[str, list[tuple[int, int]]] = {}
    for rank, specs in sorted(plan.destinations.items()):
        for spec in specs:
            size = math.prod(spec.local_shape) * itemsize(spec.dtype)
            groups.setdefault(spec.local_name, []).append((rank, size))
    by_target: dict[tuple[int, str], list[Transfer]] = {}
    for t in plan.transfers:
        by_target.setdefault((t.dst_rank, t.dst_tensor), []).append(t)
    units: list[tuple[list[tuple[int, str]], int]] = []
    for name, members in groups.items():
        total = sum(size for _, size in members)
        if total <= bucket_bytes:
            units.append(([(rank, name) for rank, _ in members], total))
        else:
            units.extend(([(rank, name)], size) for rank, size in members)
    buckets: list[Bucket] = []
    current: list[tuple[int, str]] = []
    current_bytes = 0

    def close() -> None:
        transfers = tuple(t for target in current for t in by_target.get(target, ()))
        buckets.append(Bucket(
            index=len(buckets),
            targets=tuple(current),
            transfers=transfers,
            source_tensors=tuple(dict.fromkeys(t.src_tensor for t in transfers)),
            nbytes=current_bytes,
        ))

    for targets, size in units:
        if current and current_bytes + size > bucket_bytes:
            close()
            current, current_bytes = [], 0
        current.extend(targets)
        current_bytes += size
    if current:
        close()
    return buckets
