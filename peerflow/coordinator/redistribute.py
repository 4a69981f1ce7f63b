"""`redistribute`: move a step's batch from a producer layout to a consumer layout.

Call sequence — every rank of `route.src ∪ route.dst` calls `redistribute` with the same
route (ranks outside it must not):

1. equal layouts: return the batch as is (no communication at all);
2. all-gather per-sample *metadata* only — group id and token load, 16 bytes a sample —
   from the first rank of each producer dp group (`all_gather_ragged`);
3. every rank computes the same `TransferPlan` (`plan_transfer`): groups kept whole,
   token loads balanced over the consumer dp-ranks, tp/pp peers of a consumer dp-rank
   receiving the same samples;
4. producers pack each consumer's samples with `pack_batch` (unknown fields, dtypes and
   Python objects travel untouched) and send them straight to the consumer with
   `isend`/`irecv` (a size, then the bytes); a colocated consumer copies locally;
5. consumers concatenate what they received in producer-dp order.

Gloo's list `all_to_all` rejects tensors of different sizes (torch 2.13:
`ProcessGroupGloo::alltoall: invalid tensor size`), and a route seldom connects every
pair, so point-to-point sends are used: each pair that exchanges data costs two
messages and no other pair exchanges anything. `mode="centralized"` is the single-controller
baseline: producers send everything to one rank, which plans and scatters.

Every wait has a timeout (`runtime.fault_timeout`); a dead peer raises
`WorkerFailedError` naming it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from peerflow.batch import Batch
from peerflow.coordinator.transfer import TransferPlan, dp_members, plan_transfer
from peerflow.coordinator.wire import pack_batch, unpack_batch
from peerflow.distributed.comm import all_gather_ragged, default_timeout, wait_all
from peerflow.layout import ParallelLayout

#: Ragged fields whose lengths make up a sample's token load.
LOAD_FIELDS: tuple[str, ...] = ("prompt_ids", "response_ids")

_SIZE_TAG = 71
_DATA_TAG = 72


@attrs.define(eq=False)
class TransferStats:
    """What one rank sent and received in one `redistribute` call."""

    bytes_sent: int = 0
    """Bytes this rank sent to other processes (local copies excluded)."""
    bytes_received: int = 0
    """Bytes this rank received from other processes."""
    metadata_bytes: int = 0
    """Bytes of the metadata all-gather this rank received."""
    samples_in: int = 0
    """Samples this rank held as a producer."""
    samples_out: int = 0
    """Samples this rank holds as a consumer afterwards."""
    wall_s: float = 0.0
    """Seconds spent in the call."""
    plan: TransferPlan | None = None
    """The plan it executed (p2p mode)."""

    @property
    def bytes_total(self) -> int:
        """Bytes through this rank's network interface (sent + received + metadata)."""
        return self.bytes_sent + self.bytes_received + self.metadata_bytes


def _layouts(route: Any) -> tuple[ParallelLayout, ParallelLayout]:
    if isinstance(route, tuple):
        return route
    return route.src, route.dst


def _exchange(
    outgoing: dict[int, torch.Tensor], incoming: Sequence[int], group: Any, what: str,
    timeout: float, stats: TransferStats,
) -> dict[int, torch.Tensor]:
    """Sends `outgoing[peer]` buffers and receives one buffer from each `incoming` peer."""
    del group  # isend/irecv address global ranks, with or without a group
    sizes_in = {peer: torch.zeros(1, dtype=torch.int64) for peer in incoming}
    works = [dist.irecv(t, src=peer, tag=_SIZE_TAG) for peer, t in sizes_in.items()]
    for peer, buf in outgoing.items():
        works.append(dist.isend(torch.tensor([buf.numel()], dtype=torch.int64), dst=peer,
                                tag=_SIZE_TAG))
    wait_all(works, f"{what}: exchanging sizes", timeout)
    data_in = {peer: torch.empty(int(t[0]), dtype=torch.uint8) for peer, t in sizes_in.items()}
    works = [dist.irecv(t, src=peer, tag=_DATA_TAG) for peer, t in data_in.items() if t.numel()]
    for peer, buf in outgoing.items():
        if buf.numel():
            works.append(dist.isend(buf, dst=peer, tag=_DATA_TAG))
        stats.bytes_sent += buf.numel()
    wait_all(works, f"{what}: moving samples", timeout)
    stats.bytes_received += sum(t.numel() for t in data_in.values())
    return data_in


def _metadata(batch: Batch, load_fields: Sequence[str]) -> torch.Tensor:
    return torch.stack([batch.group_id, batch.token_count(load_fields)], dim=1)


def _gather_metadata(
    batch: Batch, src: ParallelLayout, rank: int, group: Any, load_fields: Sequence[str],
    timeout: float, stats: TransferStats,
) -> tuple[list[list[int]], list[list[int]]]:
    members = dp_members(src)
    leaders = {m[0]: dp for dp, m in enumerate(members)}
    rows = _metadata(batch, load_fields) if rank in leaders else torch.zeros(
        (0, 2), dtype=torch.int64)
    gathered = all_gather_ragged(rows, group, what="redistribute: metadata all-gather",
                                 timeout=timeout)
    group_ranks = (list(range(dist.get_world_size())) if group is None
                   else dist.get_process_group_ranks(group))
    group_ids: list[list[int]] = [[] for _ in members]
    loads: list[list[int]] = [[] for _ in members]
    for global_rank, block in zip(group_ranks, gathered):
        if global_rank in leaders:
            dp = leaders[global_rank]
            group_ids[dp] = block[:, 0].tolist()
            loads[dp] = block[:, 1].tolist()
        stats.metadata_bytes += block.numel() * 8 if global_rank != rank else 0
    missing = [m[0] for m in members if m[0] not in group_ranks]
    if missing:
        raise ValueError(
            f"redistribute: producer ranks {missing} are not in the process group "
            f"{group_ranks}; pass the group of route.src ∪ route.dst."
        )
    return group_ids, loads


def _p2p(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int, group: Any,
         load_fields: Sequence[str], timeout: float, stats: TransferStats) -> Batch:
    group_ids, loads = _gather_metadata(batch, src, rank, group, load_fields, timeout, stats)
    plan = plan_transfer(src, dst, group_ids, loads)
    stats.plan = plan
    outgoing: dict[int, torch.Tensor] = {}
    local: Batch | None = None
    for (sender, receiver), indices in plan.sends.items():
        if sender != rank:
            continue
        part = batch.select(indices)
        if receiver == rank:
            local = part
        else:
            outgoing[receiver] = pack_batch(part)
    senders = [s for s, _ in plan.receives(rank) if s != rank]
    received = _exchange(outgoing, senders, group, "redistribute", timeout, stats)
    if rank not in set(dst.global_ranks):
        return Batch.empty()
    parts = [local if s == rank else unpack_batch(received[s]) for s, _ in plan.receives(rank)]
    return Batch.concat(parts)


def _centralized(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                 group: Any, load_fields: Sequence[str], timeout: float,
                 stats: TransferStats) -> Batch:
    members = dp_members(src)
    leaders = [m[0] for m in members]
    controller = min(set(src.global_ranks) | set(dst.global_ranks))
    gathered: dict[int, torch.Tensor] = {}
    if rank in leaders and rank != controller:
        _exchange({controller: pack_batch(batch)}, [], group, "centralized gather", timeout,
                  stats)
    elif rank == controller:
        gathered = _exchange({}, [r for r in leaders if r != controller], group,
                             "centralized gather", timeout, stats)
    if rank != controller:
        if rank not in set(dst.global_ranks):
            return Batch.empty()
        received = _exchange({}, [controller], group, "centralized scatter", timeout, stats)
        return unpack_batch(received[controller])
    shards = [batch if r == controller else unpack_batch(gathered[r]) for r in leaders]
    plan = plan_transfer(src, dst, [s.group_id.tolist() for s in shards],
                         [s.token_count(load_fields).tolist() for s in shards])
    stats.plan = plan
    outgoing: dict[int, torch.Tensor] = {}
    result = Batch.empty()
    for receiver in dst.global_ranks:
        parts = [shards[s_dp].select(idx) for s_dp in range(src.dp)
                 for (s, r), idx in plan.sends.items()
                 if r == receiver and s in members[s_dp]]
        out = Batch.concat(parts)
        if receiver == controller:
            result = out
        else:
            outgoing[receiver] = pack_batch(out)
    _exchange(outgoing, [], group, "centralized scatter", timeout, stats)
    return result


def redistribute(
    batch: Batch | None,
    route: Any,
    group: Any = None,
    *,
    mode: str = "p2p",
    load_fields: Sequence[str] = LOAD_FIELDS,
    timeout: float | None = None,
    stats: TransferStats | None = None,
) -> Batch:
    """Moves a batch from `route.src`'s dp-shards to `route.dst`'s (see module docstring).

    Args:
        batch: This rank's producer dp-shard (tp/pp peers pass identical shards); ignored
            (may be `None`) on ranks that are only consumers.
        route: A planner `Route` (or anything with `src`/`dst` `ParallelLayout`s, or a
            `(src, dst)` tuple).
        group: Process group containing every rank of `src ∪ dst` (`None`: the default
            group, which must then be exactly those ranks or a superset that all call).
        mode: `p2p` (peer to peer) or `centralized` (gather to one rank, then scatter).
        load_fields: Ragged fields whose lengths form a sample's token load.
        timeout: Seconds per wait; defaults to the process group's (`fault_timeout`).
        stats: Filled with this rank's bytes and time when given.

    Returns:
        This rank's consumer dp-shard (empty on ranks that only produce).

    Raises:
        WorkerFailedError: a peer failed or did not answer within `timeout`.
        ValueError: `mode` is unknown or the group misses producer ranks.
    """
    src, dst = _layouts(route)
    stats = stats if stats is not None else TransferStats()
    start = time.perf_counter()
    rank = dist.get_rank()
    batch = batch if batch is not None and rank in set(src.global_ranks) else Batch.empty()
    stats.samples_in = len(batch)
    timeout = default_timeout() if timeout is None else timeout
    if src == dst:
        out = batch
    elif mode == "p2p":
        out = _p2p(batch, src, dst, rank, group, load_fields, timeout, stats)
    elif mode == "centralized":
        out = _centralized(batch, src, dst, rank, group, load_fields, timeout, stats)
    else:
        raise ValueError(f"redistribute: mode={mode!r}; use 'p2p' or 'centralized'.")
    stats.samples_out = len(out)
    stats.wall_s = time.perf_counter() - start
    return out
