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
    Balance,
    TransferStats,
    assemble,
)
from peerflow.coordinator.wire import pack_batch, padded, spans_bytes, unpack_batch
from peerflow.layout import ParallelLayout

_SHARE_TAG = 75


def assemblers(channel: Any, participants: Sequence[int],
               groups: Sequence[tuple[int, ...]]) -> list[int] | None:
    """For each consumer dp group, the rank that reads the shards and assembles its batch.

    `None` (every consumer rank assembles its own) unless the route's ranks outnumber
    the host's cores (`ShmRoute.cores`): then work done by more ranks than cores costs
    wall time, since they take turns on the cores. So as many consumer groups' first
    ranks as there are cores (at least one) each read the shards once, plan once and
    assemble the batches of every `cores`-th group, and each group's ranks map the batch
    its assembler wrote (copy on write) — no rank gathers and scatters for all, unless
    the host has a single core.
    """
    if len(participants) <= channel.cores:
        return None
    count = max(1, min(len(groups), channel.cores))
    return [groups[i % count][0] for i in range(len(groups))]


def _read_shards(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                 targets: Sequence[int], balance: Balance, messages: dict[int, torch.Tensor],
                 stats: TransferStats) -> list[Batch]:
    """Plans from every producer leader's metadata and copies out each target's samples.

    `messages` holds every leader's message (this rank's own too, when it leads);
    `targets` are consumer ranks (the first rank of each consumer dp group this rank
    assembles for, or this rank itself); returns their batches in that order.
    """
    members = dp_members(src)
    group_ids, loads, shards = [], [], []
    for leader in (m[0] for m in members):
        message = messages[leader]
        length = message_length(message)
        values = message[8:length].view(torch.int64)
        n = len(values) // 2
        group_ids.append(values[:n].tolist())
        loads.append(values[n:].tolist())
        shards.append(None if leader == rank else message[padded(length):])
        stats.metadata_bytes += 0 if leader == rank else length
    plan = plan_transfer(src, dst, group_ids, loads, balance.slack)
    stats.plan = plan
    owner = {r: dp for dp, m in enumerate(members) for r in m}
    unpacked: dict[int, Batch] = {}
    built = []
    for target in targets:
        parts, remote, start = [], [], 0
        for sender, indices in plan.receives(target):
            s_dp = owner[sender]
            if rank in members[s_dp]:
                parts.append((batch, indices))
            else:
                if s_dp not in unpacked:
                    unpacked[s_dp] = unpack_batch(shards[s_dp])
                parts.append((unpacked[s_dp], indices))
                remote.append((start, start + len(indices)))
            start += len(indices)
        out = assemble(parts)
        stats.bytes_received += spans_bytes(out, remote)
        built.append(out)
    return built


def _hand_out(built: dict[int, Batch], groups: Sequence[tuple[int, ...]], builder: list[int],
              rank: int, channel: Any, timeout: float, stats: TransferStats) -> Batch:
    """Gives each consumer dp group the batch its assembler built (`built`: group → batch).

    An assembler writes each batch it built once, for the ranks of that group other
    than itself; they map it copy on write (a rank's batch is its own: changing it
    changes no other rank's) instead of assembling it again.
    """
    outgoing = []
    for index, out in built.items():
        peers = [peer for peer in groups[index] if peer != rank]
        if peers:
            message = pack_batch(out)
            outgoing += [(peer, message, 0) for peer in peers]
            stats.bytes_sent += message.numel()
    mine = next(i for i, g in enumerate(groups) if rank in g)
    source = builder[mine]
    received, _ = channel.exchange(outgoing, {} if source == rank else {source: 0},
                                   tag=_SHARE_TAG, what="redistribute: assembled batches",
                                   timeout=timeout)
    if source == rank:
        return built[mine]
    stats.bytes_received += received[source].numel()
    return unpack_batch(received[source])


def p2p_shared(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                participants: Sequence[int], balance: Balance, channel: Any, timeout: float,
                stats: TransferStats) -> Batch:
    """p2p in one round over a `shared` channel (same host: `coordinator.shm`).

    Each producer dp-leader writes one message once — its shard's group ids and token
    loads, then the whole packed shard — for the ranks that read it; each of them reads
    all leaders' group ids and loads, plans, and copies only the samples it assembles
    out of the shards that hold them (zero-copy views until the gather). The readers are
    every consumer rank, or, on a host whose cores the route's ranks outnumber, one
    assembler per core (`assemblers`), which then writes each batch it built once for
    that group's ranks (a second round).
    """
    leaders = [m[0] for m in dp_members(src)]
    groups = dp_members(dst)
    builder = assemblers(channel, participants, groups)
    readers = sorted(set(builder)) if builder else list(dst.global_ranks)
    outgoing: list[tuple[int, torch.Tensor, int]] = []
    if rank in leaders:
        meta = frame(torch.cat([balance.units(batch), balance.loads(batch)]))
        message = pack_batch(batch, reserve=padded(meta.numel()))
        message[: meta.numel()] = meta
        outgoing = [(peer, message, 0) for peer in readers if peer != rank]
        stats.bytes_sent += message.numel() if outgoing else 0  # written once
    reads = rank in readers
    incoming = {r: 0 for r in leaders if r != rank} if reads else {}
    received, _ = channel.exchange(outgoing, incoming, tag=DATA_TAG,
                                   what="redistribute: shards", timeout=timeout)
    if rank not in set(dst.global_ranks):
        return Batch.empty()
    if rank in leaders:
        received[rank] = message  # its own metadata, read like the others'
    if builder is None:
        return _read_shards(batch, src, dst, rank, [rank], balance, received, stats)[0]
    mine = [i for i, b in enumerate(builder) if b == rank]
    built = {}
    if mine:
        batches = _read_shards(batch, src, dst, rank, [groups[i][0] for i in mine],
                               balance, received, stats)
        built = dict(zip(mine, batches))
    return _hand_out(built, groups, builder, rank, channel, timeout, stats)
