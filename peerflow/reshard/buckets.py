"""Cut a `ReshardPlan` into buckets of bounded size, the same way on every rank.

A bucket is a set of whole destination tensors (a rollout engine's `load_weights` takes
complete local tensors), chosen so that the destination bytes of one bucket, summed over
all destination ranks, stay within `bucket_bytes`. Tensors sharing a local name on
several ranks (the tp shards of one parameter) go into the same bucket when they fit, so
the source tensor feeding them is materialised once. A single tensor larger than
`bucket_bytes` (fused MoE experts, a large fused qkv or embedding) is streamed in
slices: its transfers, cut into row ranges, fill buckets of at most `bucket_bytes`
(`Bucket.part`); the executor writes each slice into the destination tensor and loads
it after the last one, so the send and receive buffers stay within a bucket.
"""

from __future__ import annotations

import math

import attrs

from peerflow.errors import ConfigError
from peerflow.reshard.plan import ReshardPlan, Transfer
from peerflow.reshard.senders import itemsize
from peerflow.shard import Box


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
    specs with these names, replicas included, so collective gathers line up). Every
    slice of a sliced tensor lists them all: the first slice materialises them and they
    stay materialised until the last."""
    nbytes: int
    """Destination bytes of the bucket, all ranks together."""
    part: tuple[int, int] | None = None
    """`(index, count)` when the bucket is one slice of a single destination tensor larger
    than a bucket (loaded after slice `count - 1`); `None` for whole tensors."""

    @property
    def loads(self) -> tuple[tuple[int, str], ...]:
        """Targets complete after this bucket (given to `load`)."""
        if self.part is None or self.part[0] == self.part[1] - 1:
            return self.targets
        return ()



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

    def add(targets: tuple, transfers: tuple, nbytes: int, part: tuple | None = None,
            sources: tuple | None = None) -> None:
        buckets.append(Bucket(
            index=len(buckets), targets=targets, transfers=transfers,
            source_tensors=sources or tuple(dict.fromkeys(t.src_tensor for t in transfers)),
            nbytes=nbytes, part=part))

    def close() -> None:
        add(tuple(current), tuple(t for target in current for t in by_target.get(target, ())),
            current_bytes)

    for targets, size in units:
        if current and current_bytes + size > bucket_bytes:
            close()
            current, current_bytes = [], 0
        if size > bucket_bytes:  # one tensor larger than a bucket: stream it in slices
            whole = by_target.get(targets[0], [])
            sources = tuple(dict.fromkeys(t.src_tensor for t in whole))  # read once, slice 0
            slices = _slices(whole, bucket_bytes)
            for index, (transfers, nbytes) in enumerate(slices):
                add(tuple(targets), tuple(transfers), nbytes, (index, len(slices)), sources)
            continue
        current.extend(targets)
        current_bytes += size
    if current:
        close()
    return buckets


def _slices(transfers: list[Transfer], bucket_bytes: int) -> list[tuple[list[Transfer], int]]:
    """One tensor's transfers cut into row ranges and grouped up to `bucket_bytes` each.

    A single row larger than a bucket stays whole (then that slice exceeds the bucket).
    """
    pieces = [p for t in transfers for p in _rows(t, bucket_bytes)]
    out: list[tuple[list[Transfer], int]] = []
    for piece in pieces:
        nbytes = piece.numel * itemsize(piece.wire_dtype)
        if out and out[-1][1] + nbytes <= bucket_bytes:
            out[-1][0].append(piece)
            out[-1] = (out[-1][0], out[-1][1] + nbytes)
        else:
            out.append(([piece], nbytes))
    return out or [([], 0)]


def _rows(t: Transfer, bucket_bytes: int) -> list[Transfer]:
    """`t` cut along its first dimension into parts of at most `bucket_bytes` (≥ 1 row)."""
    nbytes = t.numel * itemsize(t.wire_dtype)
    if nbytes <= bucket_bytes or not t.src_box.sizes or t.src_box.sizes[0] < 2:
        return [t]
    rows = t.src_box.sizes[0]
    step = max(1, rows * bucket_bytes // nbytes)
    return [attrs.evolve(t, src_box=_sub_rows(t.src_box, lo, min(step, rows - lo)),
                         dst_box=_sub_rows(t.dst_box, lo, min(step, rows - lo)))
            for lo in range(0, rows, step)]


def _sub_rows(box: Box, start: int, count: int) -> Box:
    """Rows `start:start + count` of `box` (relative to its first row)."""
    return Box(offsets=(box.offsets[0] + start, *box.offsets[1:]),
               sizes=(count, *box.sizes[1:]))
