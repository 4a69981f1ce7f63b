"""`redistribute`: move a step's batch from a producer layout to a consumer layout.

Call sequence — every rank of `process_group` (by default the whole world; it must hold
every rank of `route.src ∪ route.dst`, see `RouteGroups`) calls `redistribute` with the
same route:

1. equal layouts: return the batch as is (no communication at all);
2. all-gather per-sample *metadata* only — prompt-group id and token load, 16 bytes a
   sample — from the first rank of each producer dp group (`all_gather_ragged`); the load
   is the summed length of the `load_fields` the batch has (none of them: an error);
3. every rank computes the same `TransferPlan` (`plan_transfer`): prompt groups kept whole,
   token loads balanced over the consumer dp-ranks, tp/pp peers of a consumer dp-rank
   receiving the same samples;
4. producers pack each consumer's samples with `pack_batch` (unknown fields, dtypes and
   Python objects travel untouched; one vectorised gather per field, one copy into the
   send buffer) and post each `isend` as soon as that consumer's buffer is packed, so
   packing overlaps the wire; a colocated consumer keeps its samples without packing;
5. consumers concatenate what they received in producer-dp order (views into the
   received buffers, no per-tensor copies).

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
from collections.abc import Iterable, Sequence
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
    outgoing: Iterable[tuple[int, torch.Tensor]], incoming: Sequence[int], what: str,
    timeout: float, stats: TransferStats,
) -> dict[int, torch.Tensor]:
    """Sends each `(peer, buffer)` of `outgoing` and receives one buffer from each `incoming` peer.

    `outgoing` may be a generator that packs lazily: each buffer's size and bytes are
    posted as soon as it is produced, while the next one is packed. isend/irecv address
    global ranks, so no process group is needed.
    """
    sizes_in = {peer: torch.zeros(1, dtype=torch.int64) for peer in incoming}
    size_works = [dist.irecv(t, src=peer, tag=_SIZE_TAG) for peer, t in sizes_in.items()]
    data_works, keep_alive = [], []
    for peer, buf in outgoing:
        size = torch.tensor([buf.numel()], dtype=torch.int64)
        keep_alive += [size, buf]
        data_works.append(dist.isend(size, dst=peer, tag=_SIZE_TAG))
        if buf.numel():
            data_works.append(dist.isend(buf, dst=peer, tag=_DATA_TAG))
        stats.bytes_sent += buf.numel()
    wait_all(size_works, f"{what}: receiving sizes", timeout)
    data_in = {peer: torch.empty(int(t[0]), dtype=torch.uint8) for peer, t in sizes_in.items()}
    data_works += [dist.irecv(t, src=peer, tag=_DATA_TAG)
                   for peer, t in data_in.items() if t.numel()]
    wait_all(data_works, f"{what}: moving samples", timeout)
    stats.bytes_received += sum(t.numel() for t in data_in.values())
    return data_in


def _metadata(batch: Batch, load_fields: Sequence[str]) -> torch.Tensor:
    """`[num_samples, 2]`: prompt-group id and token load of each sample."""
    if len(batch) and not any(name in batch for name in load_fields):
        raise ValueError(
            f"redistribute: the batch has none of the load fields {list(load_fields)} that "
            f"balance samples by token count; it has {sorted(batch.fields)}. Pass "
            "`load_fields=` naming its ragged token fields (e.g. the field your generate "
            "node writes)."
        )
    return torch.stack([batch.group_id, batch.token_count(load_fields)], dim=1)


def _gather_metadata(
    batch: Batch, src: ParallelLayout, rank: int, process_group: Any,
    load_fields: Sequence[str], timeout: float, stats: TransferStats,
) -> tuple[list[list[int]], list[list[int]]]:
    """Per producer dp-rank: the prompt-group id and the token load of each sample."""
    members = dp_members(src)
    leaders = {m[0]: dp for dp, m in enumerate(members)}
    rows = _metadata(batch, load_fields) if rank in leaders else torch.zeros(
        (0, 2), dtype=torch.int64)
    gathered = all_gather_ragged(rows, process_group,
                                 what="redistribute: metadata all-gather", timeout=timeout)
    group_ranks = (list(range(dist.get_world_size())) if process_group is None
                   else dist.get_process_group_ranks(process_group))
    prompt_groups: list[list[int]] = [[] for _ in members]
    loads: list[list[int]] = [[] for _ in members]
    for global_rank, block in zip(group_ranks, gathered):
        if global_rank in leaders:
            dp = leaders[global_rank]
            prompt_groups[dp] = block[:, 0].tolist()
            loads[dp] = block[:, 1].tolist()
        stats.metadata_bytes += block.numel() * 8 if global_rank != rank else 0
    missing = [m[0] for m in members if m[0] not in group_ranks]
    if missing:
        raise ValueError(
            f"redistribute: producer ranks {missing} are not in the process group "
            f"{group_ranks}; pass the process group of route.src ∪ route.dst "
            "(`RouteGroups.get(route)`)."
        )
    return prompt_groups, loads


def _p2p(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
         process_group: Any, load_fields: Sequence[str], timeout: float,
         stats: TransferStats) -> Batch:
    prompt_groups, loads = _gather_metadata(batch, src, rank, process_group, load_fields,
                                            timeout, stats)
    plan = plan_transfer(src, dst, prompt_groups, loads)
    stats.plan = plan
    mine = [(receiver, indices) for (sender, receiver), indices in plan.sends.items()
            if sender == rank]
    outgoing = ((receiver, pack_batch(batch.select(indices)))
                for receiver, indices in mine if receiver != rank)
    senders = [s for s, _ in plan.receives(rank) if s != rank]
    received = _exchange(outgoing, senders, "redistribute", timeout, stats)
    if rank not in set(dst.global_ranks):
        return Batch.empty()
    parts = [batch.select(idx) if s == rank else unpack_batch(received[s])
             for s, idx in plan.receives(rank)]
    return Batch.concat(parts)


def _centralized(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                 process_group: Any, load_fields: Sequence[str], timeout: float,
                 stats: TransferStats) -> Batch:
    members = dp_members(src)
    leaders = [m[0] for m in members]
    controller = min(set(src.global_ranks) | set(dst.global_ranks))
    gathered: dict[int, torch.Tensor] = {}
    if rank in leaders and rank != controller:
        _exchange([(controller, pack_batch(batch))], [], "centralized gather", timeout, stats)
    elif rank == controller:
        gathered = _exchange([], [r for r in leaders if r != controller],
                             "centralized gather", timeout, stats)
    if rank != controller:
        if rank not in set(dst.global_ranks):
            return Batch.empty()
        received = _exchange([], [controller], "centralized scatter", timeout, stats)
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
    _exchange(outgoing.items(), [], "centralized scatter", timeout, stats)
    return result


def redistribute(
    batch: Batch | None,
    route: Any,
    process_group: Any = None,
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
        process_group: The torch.distributed group whose ranks all make this call; it
            must contain every rank of `src ∪ dst` (`RouteGroups.get(route)`). `None`: the
            default group — then every rank of the world calls, including ranks outside
            the route (they return an empty batch).
        mode: `p2p` (peer to peer) or `centralized` (gather to one rank, then scatter).
        load_fields: Ragged fields whose summed lengths form a sample's token load; the
            batch must have at least one of them.
        timeout: Seconds per wait; defaults to the process group's (`fault_timeout`).
        stats: Filled with this rank's bytes and time when given.

    Returns:
        This rank's consumer dp-shard (empty on ranks that only produce).

    Raises:
        WorkerFailedError: a peer failed or did not answer within `timeout`.
        ValueError: `mode` is unknown, the process group misses producer ranks, or the
            batch has none of `load_fields` (naming the fields it has).
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
        out = _p2p(batch, src, dst, rank, process_group, load_fields, timeout, stats)
    elif mode == "centralized":
        out = _centralized(batch, src, dst, rank, process_group, load_fields, timeout,
                           stats)
    else:
        raise ValueError(f"redistribute: mode={mode!r}; use 'p2p' or 'centralized'.")
    stats.samples_out = len(out)
    stats.wall_s = time.perf_counter() - start
    return out
