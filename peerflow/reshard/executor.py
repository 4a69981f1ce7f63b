"""Execute a `ReshardPlan` on one rank: pack, exchange, unpack, load — bucket by bucket.

`run_plan` is engine-agnostic: it reads source tensors through a `materialize` callable
and hands finished destination tensors to a `load` callable. `peerflow.reshard.service`
binds those to `TrainEngine.materialize` and `RolloutEngine.load_weights`.

Per bucket, on every rank of the plan (the same sequence everywhere):

1. `materialize(specs)` on ranks holding source tensors the bucket reads (replicas too);
2. pack this rank's outgoing regions into one flat `uint8` buffer per peer;
3. `transport.exchange(...)` (every rank calls it, even with nothing to move);
4. carve this bucket's destination tensors (from a staging arena reused across buckets,
   or the engine's own tensors via `weight_buffers`), copy regions this rank sends to
   itself directly, unpack received buffers;
5. `load(items)` with complete destination tensors (valid only during the call).

Extra memory is tracked by a `MemoryMeter`: at most max(send + receive, receive +
destination) bytes of one bucket are alive, i.e. at most `2 * max(bucket_bytes, largest
destination tensor)` per rank (a tensor larger than a bucket travels as a bucket of its
own). Tensors the trainer materialises (e.g. a ZeRO-3 gather) are the engine's and are
not counted.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence

import attrs
import torch

from peerflow.engines.base import WeightSyncStats
from peerflow.errors import ShardError
from peerflow.reshard.arena import ALIGN, Arena, MemoryMeter
from peerflow.reshard.buckets import Bucket
from peerflow.reshard.deadline import exchange_bucket
from peerflow.reshard.plan import ReshardPlan, Transfer
from peerflow.reshard.senders import itemsize
from peerflow.reshard.transport import WeightTransport
from peerflow.rounding import pad_to_multiple
from peerflow.shard import ShardSpec

Materialize = Callable[[Sequence[ShardSpec]], contextlib.AbstractContextManager[list[torch.Tensor]]]
Load = Callable[[list[tuple[ShardSpec, torch.Tensor]]], None]
Buffers = Callable[[Sequence[ShardSpec]], "list[torch.Tensor] | None"]


def packed_layout(transfers: Sequence[Transfer]) -> tuple[list[int], int]:
    """Returns each transfer's byte offset in a packed buffer and the buffer's size."""
    offsets, cursor = [], 0
    for t in transfers:
        offsets.append(cursor)
        cursor += pad_to_multiple(t.numel * itemsize(t.wire_dtype), ALIGN)
    return offsets, cursor


def _region(buf: torch.Tensor, offset: int, t: Transfer) -> torch.Tensor:
    n = t.numel * itemsize(t.wire_dtype)
    return buf[offset:offset + n].view(getattr(torch, t.wire_dtype)).view(t.src_box.sizes)


def run_plan(
    plan: ReshardPlan,
    buckets: Sequence[Bucket],
    *,
    rank: int,
    transport: WeightTransport,
    materialize: Materialize | None,
    load: Load | None,
    device: str | torch.device = "cpu",
    meter: MemoryMeter | None = None,
    buffers: Buffers | None = None,
    version: int = 0,
    routes: Sequence[BucketRoutes] | None = None,
    arena: Arena | None = None,
) -> WeightSyncStats:
    """Runs every bucket of `plan` on this rank (call on every rank of the plan).

    Args:
        plan: The plan, identical on every rank.
        buckets: `make_buckets(plan, bucket_bytes)`, identical on every rank.
        rank: This process's global rank.
        transport: This rank's transport instance.
        materialize: Yields source tensors for specs (`None` when this rank has none).
        load: Receives complete destination tensors (`None` when this rank has none).
        device: Where buffers and destination tensors are allocated.
        meter: Memory meter to record into (a fresh one by default).
        buffers: Optional zero-copy hook (`RolloutEngine.weight_buffers`): returns the
            destination's own tensors to write into, or `None` to stage copies.
        version: The weight version the returned stats are labelled with.
        routes: `bucket_routes(buckets, rank)`, when the caller keeps them between syncs
            (they depend on the plan only); computed here otherwise.
        arena: A packing arena the caller keeps between syncs (a transport whose peers
            map send buffers, `WeightTransport.keeps_buffers`); a fresh one, released at
            the end, by default.

    Returns:
        This rank's time split (pack / wire / load), bytes it sent (local copies included)
        and received, bucket count and peak extra memory.

    Raises:
        ShardError: a materialised tensor's shape differs from its spec.
        WorkerFailedError: a peer did not answer within the transport's deadline (names
            the bucket, the transport and the ranks).
    """
    meter = meter or MemoryMeter()
    stats: Counter[str] = Counter()
    my_sources = {s.local_name: s for s in plan.sources.get(rank, ())}
    my_targets = {s.local_name: s for s in plan.destinations.get(rank, ())}
    routes = routes if routes is not None else bucket_routes(buckets, rank)
    # One arena per sync: a bucket's send buffers, then (once sent) its staged tensors.
    # Sized once for the largest bucket so no bucket reallocates (and re-faults) memory.
    own = arena is None
    arena = Arena(meter=meter, device=device) if own else arena
    arena.reserve_total(_arena_bytes(buckets, routes, rank, my_targets, stage=False))
    arena.stage_bytes = _arena_bytes(buckets, routes, rank, my_targets, stage=True)
    try:
        _run_buckets(plan, buckets, routes, rank, transport, materialize, load, buffers,
                     meter, stats, my_sources, my_targets, arena)
    finally:
        if own:
            arena.release()
    return WeightSyncStats(version=version, peak_extra_bytes=meter.peak,
                           senders=plan.senders, sender_share=plan.sender_share, **stats)


def _arena_bytes(buckets: Sequence[Bucket], routes: Sequence[BucketRoutes], rank: int,
                 targets: dict[str, ShardSpec], *, stage: bool) -> int:
    """Largest arena any bucket of this rank needs (send buffers; staged tensors too)."""
    need = 0
    for bucket, route in zip(buckets, routes, strict=True):
        send = sum(pad_to_multiple(packed_layout(ts)[1], ALIGN)
                   for ts in route.outgoing.values())
        staged = sum(pad_to_multiple(math.prod(targets[n].local_shape)
                                     * itemsize(targets[n].dtype), ALIGN)
                     for r, n in bucket.targets
                     if r == rank) if stage and bucket.part is None else 0
        need = max(need, send, staged)
    return need


def _run_buckets(plan: ReshardPlan, buckets: Sequence[Bucket],
                 routes: Sequence[BucketRoutes], rank: int, transport: WeightTransport,
                 materialize: Materialize | None, load: Load | None,
                 buffers: Buffers | None, meter: MemoryMeter,
                 stats: Counter[str], my_sources: dict[str, ShardSpec],
                 my_targets: dict[str, ShardSpec], arena: Arena) -> None:
    sources: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for bucket, route in zip(buckets, routes, strict=True):
            if bucket.part is None or bucket.part[0] == 0:  # later slices: still materialised
                stack.close()
                sources = materialize_sources(bucket, rank, materialize, my_sources, stack, stats)
            _run_bucket(bucket, route, rank, sources, my_targets, transport, load, meter,
                        stats, buffers, arena)
            stats["buckets"] += 1


def materialize_sources(bucket: Bucket, rank: int, materialize: Materialize | None,
                 my_sources: dict[str, ShardSpec], stack: contextlib.ExitStack,
                 stats: Counter[str]) -> dict[str, torch.Tensor]:
    """Enters `materialize` for the bucket's source tensors on this rank (into `stack`).

    Slices of one tensor list the same sources: the caller enters them at the first
    slice and keeps `stack` open until the last (`Bucket.part`).
    """
    specs = [my_sources[n] for n in bucket.source_tensors if n in my_sources]
    if not specs:
        return {}
    if materialize is None:
        raise ShardError(f"rank {rank} holds source tensors {[s.local_name for s in specs]} "
                         "but was given no trainer to read them from.")
    start = time.perf_counter()
    tensors = stack.enter_context(materialize(specs))
    stats["gather_s"] += time.perf_counter() - start
    sources = dict(zip((s.local_name for s in specs), tensors))
    for spec in specs:
        if tuple(sources[spec.local_name].shape) != spec.local_shape:
            raise ShardError(
                f"source tensor {spec.local_name!r} on rank {rank} has shape "
                f"{tuple(sources[spec.local_name].shape)} but its spec says "
                f"{spec.local_shape}; the engine's weight_sources() is wrong."
            )
    return sources


@attrs.frozen
class BucketRoutes:
    """How one bucket's transfers split on one rank."""

    outgoing: dict[int, list[Transfer]]
    """Peer rank → transfers this rank sends it."""
    incoming: dict[int, list[Transfer]]
    """Peer rank → transfers this rank receives from it."""
    local: list[Transfer]
    """Transfers from this rank to itself."""
    routes: list[tuple[int, int, int]]
    """Every cross-rank `(source, destination, bytes)` of the bucket (same on all ranks)."""

    @classmethod
    def of(cls, bucket: Bucket, rank: int) -> BucketRoutes:
        """Splits `bucket`'s transfers as seen from `rank`."""
        outgoing: dict[int, list[Transfer]] = {}
        incoming: dict[int, list[Transfer]] = {}
        local: list[Transfer] = []
        pairs: dict[tuple[int, int], list[Transfer]] = {}
        for t in bucket.transfers:
            if t.src_rank == t.dst_rank:
                if t.src_rank == rank:
                    local.append(t)
                continue
            pairs.setdefault((t.src_rank, t.dst_rank), []).append(t)
            if t.src_rank == rank:
                outgoing.setdefault(t.dst_rank, []).append(t)
            elif t.dst_rank == rank:
                incoming.setdefault(t.src_rank, []).append(t)
        routes = [(s, d, packed_layout(ts)[1]) for (s, d), ts in sorted(pairs.items())]
        return cls(outgoing, incoming, local, routes)


def bucket_routes(buckets: Sequence[Bucket], rank: int) -> tuple[BucketRoutes, ...]:
    """`BucketRoutes.of` every bucket on `rank`: fixed by the plan, so kept between syncs."""
    return tuple(BucketRoutes.of(bucket, rank) for bucket in buckets)


def pack_regions(per_peer: dict[int, list[Transfer]], sources: dict[str, torch.Tensor],
                 take: Callable[[int], torch.Tensor]) -> dict[int, torch.Tensor]:
    """Packs each peer's source regions into one flat `uint8` buffer from `take(nbytes)`."""
    out = {}
    for peer, transfers in per_peer.items():
        offsets, size = packed_layout(transfers)
        buf = take(size)
        for t, off in zip(transfers, offsets):
            _region(buf, off, t).copy_(sources[t.src_tensor][t.src_box.slices()])
        out[peer] = buf
    return out


def destination_tensors(names: Sequence[str], targets: dict[str, ShardSpec],
                        buffers: Buffers | None, arena: Arena, *, sliced: bool = False
                        ) -> dict[str, torch.Tensor]:
    """The tensors a bucket fills on this rank: the engine's own, or staged in `arena`.

    `sliced`: the bucket is one slice of a tensor larger than a bucket; a staged copy is
    then held across its slices (`Arena.hold`) instead of carved from the arena.
    """
    views = buffers([targets[n] for n in names]) if buffers is not None and names else None
    out: dict[str, torch.Tensor] = {}
    if views is not None:
        for name, view in zip(names, views, strict=True):
            if tuple(view.shape) != targets[name].local_shape:
                raise ShardError(f"weight_buffers returned shape {tuple(view.shape)} for "
                                 f"{name!r}, whose spec says {targets[name].local_shape}.")
            out[name] = view
        return out
    if not names:
        return out
    if sliced:
        return {name: arena.hold(targets[name]) for name in names}
    sizes = [math.prod(targets[n].local_shape) * itemsize(targets[n].dtype) for n in names]
    arena.reset()
    arena.reserve_total(max(sum(pad_to_multiple(n, ALIGN) for n in sizes), arena.stage_bytes))
    for name, nbytes in zip(names, sizes):
        spec = targets[name]
        tensor = arena.take(nbytes).view(getattr(torch, spec.dtype)).view(spec.local_shape)
        for box in spec.padding:
            tensor[box.slices()].zero_()
        out[name] = tensor
    return out


def unpack_regions(per_peer: dict[int, list[Transfer]], received: dict[int, torch.Tensor],
                   out: dict[str, torch.Tensor], *, rank: int, bucket: int) -> int:
    """Copies each peer's packed buffer into the destination tensors; returns the bytes.

    Raises:
        ShardError: a buffer's size differs from what the plan says the peer sends.
    """
    nbytes = 0
    for peer, transfers in per_peer.items():
        buf = received.get(peer)
        offsets, size = packed_layout(transfers)
        if buf is None or buf.numel() != size:
            raise ShardError(f"rank {rank} received {None if buf is None else buf.numel()} "
                             f"bytes from rank {peer} in bucket {bucket}, expected {size}; "
                             "the ranks disagree on the plan (were they given the same specs?).")
        for t, off in zip(transfers, offsets):
            out[t.dst_tensor][t.dst_box.slices()].copy_(_region(buf, off, t))
        nbytes += size
    return nbytes


def _run_bucket(bucket: Bucket, routes: BucketRoutes, rank: int, sources: dict[str, torch.Tensor],
                targets: dict[str, ShardSpec], transport: WeightTransport, load: Load | None,
                meter: MemoryMeter, stats: Counter[str], buffers: Buffers | None,
                arena: Arena) -> None:
    start = time.perf_counter()
    arena.reset()
    if routes.outgoing:
        arena.reserve_total(sum(pad_to_multiple(packed_layout(ts)[1], ALIGN)
                                for ts in routes.outgoing.values()))
    sends = pack_regions(routes.outgoing, sources, arena.take)
    stats["bytes"] += sum(buf.numel() for buf in sends.values())
    stats["wire_bytes"] += sum(buf.numel() for buf in sends.values())
    stats["pack_s"] += time.perf_counter() - start

    start = time.perf_counter()
    recv_sizes = {peer: packed_layout(ts)[1] for peer, ts in routes.incoming.items()}
    meter.reserve(sum(recv_sizes.values()))
    received = exchange_bucket(transport, bucket.index, sends, recv_sizes, routes.routes)
    sends.clear()
    stats["wire_s"] += time.perf_counter() - start

    start = time.perf_counter()
    mine = [n for r, n in bucket.targets if r == rank]
    out = destination_tensors(mine, targets, buffers, arena, sliced=bucket.part is not None)
    for t in routes.local:
        out[t.dst_tensor][t.dst_box.slices()].copy_(sources[t.src_tensor][t.src_box.slices()])
        stats["bytes"] += t.numel * itemsize(t.wire_dtype)
    got = unpack_regions(routes.incoming, received, out, rank=rank, bucket=bucket.index)
    stats["bytes"] += got
    meter.release(got)
    received.clear()
    if mine and load is None:
        raise ShardError(f"rank {rank} holds destination tensors but was given no "
                         "rollout engine to load them into.")
    ready = [n for r, n in bucket.loads if r == rank]
    if ready:
        load([(targets[name], out[name]) for name in ready])
        for name in ready:
            arena.drop(name)
    stats["load_s"] += time.perf_counter() - start
