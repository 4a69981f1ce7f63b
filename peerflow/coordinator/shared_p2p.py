"""p2p `redistribute` in one round over a shared channel (same host: `coordinator.shm`).

A shared channel writes a message addressed to many ranks once, so each producer
dp-leader writes its shard once and the consumers copy their samples straight out of it;
see `p2p_shared`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from peerflow.batch import Batch
from peerflow.coordinator.exchange import frame, message_length
from peerflow.coordinator.transfer import dp_members, plan_transfer
from peerflow.coordinator.units import (
    DATA_TAG,
    TransferStats,
    assemble,
    plan_slack,
    sample_loads,
    sample_units,
)
from peerflow.coordinator.wire import pack_batch, padded, spans_bytes, unpack_batch
from peerflow.layout import ParallelLayout

_SHARE_TAG = 75


def shares_assembly(channel: Any, participants: Sequence[int]) -> bool:
    """Whether the tp/pp peers of a consumer dp group share one assembled batch.

    Only when the route's ranks outnumber the host's cores (`ShmRoute.cores`): then a
    batch assembled by every peer costs wall time, since the peers take turns on the
    cores. With a core per rank the peers assemble in parallel, and sharing would only
    add a hop.
    """
    return len(participants) > channel.cores


def _read_shards(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                 load_fields: Sequence[str], keep_groups: bool,
                 received: dict[int, torch.Tensor], stats: TransferStats) -> Batch:
    """Plans from every producer leader's metadata and copies this rank's samples out."""
    members = dp_members(src)
    leaders = [m[0] for m in members]
    group_ids, loads, shards = [], [], []
    for leader in leaders:
        if leader == rank:
            group_ids.append(sample_units(batch, keep_groups).tolist())
            loads.append(sample_loads(batch, load_fields, keep_groups).tolist())
            shards.append(None)
            continue
        message = received[leader]
        length = message_length(message)
        values = message[8:length].view(torch.int64)
        n = len(values) // 2
        group_ids.append(values[:n].tolist())
        loads.append(values[n:].tolist())
        shards.append(message[padded(length):])
        stats.metadata_bytes += length
    plan = plan_transfer(src, dst, group_ids, loads, plan_slack(keep_groups))
    stats.plan = plan
    owner = {r: dp for dp, m in enumerate(members) for r in m}
    parts, remote, start = [], [], 0
    for sender, indices in plan.receives(rank):
        s_dp = owner[sender]
        if rank in members[s_dp]:
            parts.append((batch, indices))
        else:
            parts.append((unpack_batch(shards[s_dp]), indices))
            remote.append((start, start + len(indices)))
        start += len(indices)
    out = assemble(parts)
    stats.bytes_received += spans_bytes(out, remote)
    return out


def _share_assembly(out: Batch, group: tuple[int, ...], rank: int, channel: Any,
                    timeout: float, stats: TransferStats) -> Batch:
    """Gives a consumer dp group's assembled batch to its tp/pp peers.

    The group's first rank writes it once; each peer maps it copy on write (its batch is
    its own: changing it changes no other rank's) instead of assembling it again.
    """
    first = group[0]
    outgoing = []
    if rank == first:
        message = pack_batch(out)
        outgoing = [(peer, message, 0) for peer in group[1:]]
        stats.bytes_sent += message.numel()
    received, _ = channel.exchange(outgoing, {} if rank == first else {first: 0},
                                   tag=_SHARE_TAG, what="redistribute: sharing a tp group's batch",
                                   timeout=timeout)
    if rank == first:
        return out
    stats.bytes_received += received[first].numel()
    return unpack_batch(received[first])


def p2p_shared(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                participants: Sequence[int], load_fields: Sequence[str], keep_groups: bool,
                channel: Any, timeout: float, stats: TransferStats) -> Batch:
    """p2p in one round over a `shared` channel (same host: `coordinator.shm`).

    Each producer dp-leader writes one message once — its shard's group ids and token
    loads, then the whole packed shard — for the consumers that read it; each of them
    reads all leaders' group ids and loads, plans, and copies only its own samples out
    of the shards that hold them (zero-copy views until `select`/`concat`). The readers
    are every consumer rank, or, when the tp/pp peers of a consumer dp group share one
    assembly (`shares_assembly`), only its first rank, which then writes the assembled
    batch once for its peers (a second round, within the group).
    """
    leaders = [m[0] for m in dp_members(src)]
    groups = dp_members(dst)
    share = shares_assembly(channel, participants)
    readers = [g[0] for g in groups] if share else list(dst.global_ranks)
    outgoing: list[tuple[int, torch.Tensor, int]] = []
    if rank in leaders:
        meta = frame(torch.cat([sample_units(batch, keep_groups),
                                sample_loads(batch, load_fields, keep_groups)]))
        message = pack_batch(batch, reserve=padded(meta.numel()))
        message[: meta.numel()] = meta
        outgoing = [(peer, message, 0) for peer in readers if peer != rank]
        stats.bytes_sent += message.numel() if outgoing else 0  # written once
    reads = rank in readers
    incoming = {r: 0 for r in leaders if r != rank} if reads else {}
    received, _ = channel.exchange(outgoing, incoming, tag=DATA_TAG,
                                   what="redistribute: shards", timeout=timeout)
    group = next((g for g in groups if rank in g), None)
    if group is None:
        return Batch.empty()
    out = (_read_shards(batch, src, dst, rank, load_fields, keep_groups, received, stats)
           if reads else None)
    if not share or len(group) == 1:
        return out
    return _share_assembly(out, group, rank, channel, timeout, stats)
