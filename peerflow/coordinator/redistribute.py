"""`redistribute`: move a step's batch from a producer layout to a consumer layout.

Call sequence — every rank of `process_group` (by default the whole world; it must hold
every rank of `route.src ∪ route.dst`, see `RouteGroups`) calls `redistribute` with the
same route; ranks outside `src ∪ dst` return an empty batch at once:

1. equal layouts: return the batch as is (no communication at all), unless
   `keep_groups=False` asks to re-balance single samples over the same layout's dp-ranks
   (after the advantage step: `Route.keep_groups`);
2. metadata: the first rank of each producer dp group sends one message to every other
   rank of `src ∪ dst` — the unit id (prompt-group id, or the sample id with
   `keep_groups=False`), token load and a packed-size bound of each sample (24 bytes a
   sample, `wire.size_bound`); the load is the summed length of the `load_fields` the
   batch has (none of them: an error), 0 for a sample whose `train_mask` is false when
   samples are balanced (it is dropped before training); for consumers that run a prompt
   once for all its samples (`shared_prompts`) the units stay prompt groups, each
   weighing its prompt once and every answer (`units.Balance`);
3. every rank computes the same `TransferPlan` (`plan_transfer`): units (prompt groups or
   samples) kept whole, token loads balanced over the consumer dp-ranks, tp/pp peers of a
   consumer dp-rank receiving the same samples; a sample that stays on its rank moves
   nothing;
4. consumers post one receive per sender, sized from the metadata; producers pack each
   distinct sample set once with `pack_batch` (unknown fields, dtypes and Python objects
   travel untouched) and post each `isend` as soon as it is packed, so packing overlaps
   the wire: one message per pair that exchanges data (`coordinator.exchange`);
5. consumers concatenate what they received in producer-dp order.

So a call costs two rounds of messages — metadata, then payload — and no collective:
gloo's all-gather is a ring (N − 1 sequential steps), and its list `all_to_all` rejects
tensors of different sizes (torch 2.13: `ProcessGroupGloo::alltoall: invalid tensor
size`). `mode="centralized"` is the single-controller baseline: producers send everything
to one rank, which plans and scatters, over the same exchange (a receiver that cannot
know the size posts `HEAD_BYTES` and takes the rest as a second message).

Transport (`transport=`, `coordinator.transport`): both modes run their rounds over the
call's channel — gloo messages, or, when every rank of the route shares this host's
`/dev/shm` (`auto`, the default, or `shm`), shared-memory segments and a wake-up pipe
per process (`coordinator.shm`). A shared channel writes a message addressed to many
ranks once, so p2p over it takes one round instead of two (`coordinator.shared_p2p`): each producer
dp-leader writes its shard's group ids and token loads followed by the whole packed
shard, and every consumer rank plans from all leaders' metadata and copies only its
samples out of the mapped shards — or, on a host whose cores the route's ranks
outnumber, one assembler per core does it for every `cores`-th consumer dp group, whose
ranks map the batch it wrote (`assemblers`). A re-balance within one layout keeps the
two rounds on any channel: most samples stay home, so packing only the few that move
beats writing every shard. The centralized baseline keeps its gather and scatter.

Every wait has a timeout (`runtime.peer_wait_timeout` in a run: a live peer may take a
whole stage); a dead peer is named by the fault monitor within `runtime.fault_timeout`,
and a wait that times out raises `WorkerFailedError` naming the ranks it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from peerflow.batch import Batch
from peerflow.coordinator.exchange import HEAD_BYTES, ExchangeChannel, frame
from peerflow.coordinator.shared_p2p import p2p_shared
from peerflow.coordinator.transfer import dp_members, plan_transfer
from peerflow.coordinator.transport import check_transport, open_channel
from peerflow.coordinator.units import (
    DATA_TAG,
    LOAD_FIELDS,
    Balance,
    TransferStats,
    assemble,
)
from peerflow.coordinator.wire import pack_batch, size_bound, unpack_batch
from peerflow.distributed.comm import default_timeout
from peerflow.layout import ParallelLayout

_METADATA_TAG = 71  # heads; `exchange` sends tails on the next tag


def _layouts(route: Any) -> tuple[ParallelLayout, ParallelLayout]:
    if isinstance(route, tuple):
        return route
    return route.src, route.dst


def _check_load_fields(batch: Batch, load_fields: Sequence[str]) -> None:
    if len(batch) and not any(name in batch for name in load_fields):
        raise ValueError(
            f"redistribute: the batch has none of the load fields {list(load_fields)} that "
            f"balance samples by token count; it has {sorted(batch.fields)}. Pass "
            "`load_fields=` naming its ragged token fields (e.g. the field your generate "
            "node writes)."
        )


def _check_group(process_group: Any, participants: Sequence[int]) -> None:
    if process_group is None:
        return
    group_ranks = dist.get_process_group_ranks(process_group)
    missing = sorted(set(participants) - set(group_ranks))
    if missing:
        raise ValueError(
            f"redistribute: ranks {missing} of the route are not in the process group "
            f"{group_ranks}; pass the process group of route.src ∪ route.dst "
            "(`RouteGroups.get(route)`)."
        )


@attrs.frozen(kw_only=True)
class _ShardMetadata:
    """What every rank learns about one producer dp-shard before any payload moves."""

    group_ids: list[int]
    """Prompt-group id of each sample."""
    loads: list[int]
    """Token load of each sample."""
    sample_bytes: torch.Tensor  # [num_samples], int64
    """Upper bound of each sample's packed bytes (`wire.size_bound`)."""
    fixed_bytes: int
    """Packed bytes that do not depend on the samples (header, padding)."""

    def capacity(self, indices: Sequence[int]) -> int:
        """Upper bound of the packed size of the samples at `indices`."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        return self.fixed_bytes + int(self.sample_bytes[index].sum())


def _encode_metadata(batch: Batch, balance: Balance) -> torch.Tensor:
    """`[length, fixed bytes, n, unit ids…, loads…, sample bytes…]` as one framed message."""
    sample_bytes, fixed = size_bound(batch)
    n = len(batch)
    body = torch.cat([torch.tensor([fixed, n], dtype=torch.int64), balance.units(batch),
                      balance.loads(batch), sample_bytes])
    return frame(body)


def _decode_metadata(message: torch.Tensor) -> _ShardMetadata:
    values = message[8:].view(torch.int64)
    fixed, n = int(values[0]), int(values[1])
    return _ShardMetadata(group_ids=values[2 : 2 + n].tolist(),
                          loads=values[2 + n : 2 + 2 * n].tolist(),
                          sample_bytes=values[2 + 2 * n : 2 + 3 * n], fixed_bytes=fixed)


def _exchange_metadata(
    batch: Batch, src: ParallelLayout, participants: Sequence[int], rank: int,
    balance: Balance, channel: ExchangeChannel, timeout: float, stats: TransferStats,
) -> list[_ShardMetadata]:
    """Every producer dp-leader sends its shard's metadata to every other participant."""
    leaders = [m[0] for m in dp_members(src)]
    mine = _encode_metadata(batch, balance) if rank in leaders else None
    outgoing = [] if mine is None else [(peer, mine, HEAD_BYTES) for peer in participants
                                        if peer != rank]
    incoming = {leader: HEAD_BYTES for leader in leaders if leader != rank}
    received, sent = channel.exchange(outgoing, incoming, tag=_METADATA_TAG,
                                      what="redistribute: metadata", timeout=timeout)
    stats.metadata_bytes += sent + sum(m.numel() for m in received.values())
    return [_decode_metadata(mine if leader == rank else received[leader])
            for leader in leaders]


def _packed_sends(
    batch: Batch, sends: Sequence[tuple[int, tuple[int, ...]]], metadata: _ShardMetadata,
) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Packs each distinct index list once (tp peers of a consumer get the same bytes)."""
    packed: dict[tuple[int, ...], torch.Tensor] = {}
    for receiver, indices in sends:
        if indices not in packed:
            packed[indices] = pack_batch(assemble([(batch, indices)]))
        yield receiver, packed[indices], metadata.capacity(indices)


def _p2p(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
         participants: Sequence[int], balance: Balance, channel: ExchangeChannel, timeout: float,
         stats: TransferStats) -> Batch:
    metadata = _exchange_metadata(batch, src, participants, rank, balance, channel, timeout,
                                  stats)
    plan = plan_transfer(src, dst, [m.group_ids for m in metadata], [m.loads for m in metadata],
                         balance.slack)
    stats.plan = plan
    owner = {r: dp for dp, m in enumerate(dp_members(src)) for r in m}
    receives = plan.receives(rank)
    incoming = {s: metadata[owner[s]].capacity(idx) for s, idx in receives if s != rank}
    mine = [(receiver, indices) for (sender, receiver), indices in plan.sends.items()
            if sender == rank and receiver != rank]
    outgoing = _packed_sends(batch, mine, metadata[owner[rank]]) if mine else ()
    received, sent = channel.exchange(outgoing, incoming, tag=DATA_TAG,
                                      what="redistribute: moving samples", timeout=timeout)
    stats.bytes_sent += sent
    stats.bytes_received += sum(m.numel() for m in received.values())
    if rank not in set(dst.global_ranks):
        return Batch.empty()
    return assemble([(batch, idx) if s == rank else (unpack_batch(received[s]), None)
                      for s, idx in receives])


def _centralized(batch: Batch, src: ParallelLayout, dst: ParallelLayout, rank: int,
                 balance: Balance, channel: ExchangeChannel, timeout: float,
                 stats: TransferStats) -> Batch:
    members = dp_members(src)
    leaders = [m[0] for m in members]
    controller = min(set(src.global_ranks) | set(dst.global_ranks))

    def move(outgoing: Any, incoming: Sequence[int], what: str) -> dict[int, torch.Tensor]:
        received, sent = channel.exchange(outgoing, dict.fromkeys(incoming, HEAD_BYTES),
                                          tag=DATA_TAG, what=what, timeout=timeout)
        stats.bytes_sent += sent
        stats.bytes_received += sum(m.numel() for m in received.values())
        return received

    gathered: dict[int, torch.Tensor] = {}
    if rank in leaders and rank != controller:
        move([(controller, pack_batch(batch), HEAD_BYTES)], [], "centralized gather")
    elif rank == controller:
        gathered = move([], [r for r in leaders if r != controller], "centralized gather")
    if rank != controller:
        if rank not in set(dst.global_ranks):
            return Batch.empty()
        return unpack_batch(move([], [controller], "centralized scatter")[controller])
    shards = [batch if r == controller else unpack_batch(gathered[r]) for r in leaders]
    plan = plan_transfer(src, dst, [balance.units(s).tolist() for s in shards],
                         [balance.loads(s).tolist() for s in shards], balance.slack)
    stats.plan = plan
    consumers = [(group, assemble([(shards[s_dp], idx) for s_dp in range(src.dp)
                                    for (s, r), idx in plan.sends.items()
                                    if r == group[0] and s in members[s_dp]]))
                 for group in dp_members(dst)]

    def scatter() -> Iterator[tuple[int, torch.Tensor, int]]:
        # like p2p: one buffer per consumer dp group, posted as soon as it is packed
        for group, out in consumers:
            packed = None
            for receiver in group:
                if receiver != controller:
                    packed = pack_batch(out) if packed is None else packed
                    yield receiver, packed, HEAD_BYTES

    move(scatter(), [], "centralized scatter")
    return next((out for group, out in consumers if controller in group), Batch.empty())


def redistribute(
    batch: Batch | None,
    route: Any,
    process_group: Any = None,
    *,
    mode: str = "p2p",
    transport: str = "auto",
    load_fields: Sequence[str] = LOAD_FIELDS,
    keep_groups: bool = True,
    shared_prompts: bool = False,
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
        transport: `auto` (shared memory when every rank of the route is on this host,
            else gloo), `gloo` or `shm` (`coordinator.transport`); both modes use it.
        load_fields: Ragged fields whose summed lengths form a sample's token load; the
            batch must have at least one of them.
        keep_groups: Keep each prompt group whole on one consumer dp-rank (what group
            statistics such as GRPO's advantages need); `False` balances single samples,
            and also runs when `route.src == route.dst` (a re-balance over one layout).
        shared_prompts: The consumers run a prompt once for all its samples
            (`CausalLMTrainEngine.shares_prompts`): prompt groups stay whole even with
            `keep_groups=False`, each weighing its prompt once and every answer
            (`units.Balance`). Every rank of the route must pass the same value.
        timeout: Seconds per wait; defaults to the process group's (`fault_timeout`).
        stats: Filled with this rank's bytes and time when given.

    Returns:
        This rank's consumer dp-shard (empty on ranks that only produce).

    Raises:
        WorkerFailedError: a peer failed or did not answer within `timeout`.
        ValueError: `mode` or `transport` is unknown (or `shm` where the route's ranks
            share no memory), the process group misses ranks of the route, or the batch
            has none of `load_fields` (naming the fields it has).
    """
    src, dst = _layouts(route)
    if mode not in ("p2p", "centralized"):
        raise ValueError(f"redistribute: mode={mode!r}; use 'p2p' or 'centralized'.")
    check_transport(transport)
    stats = stats if stats is not None else TransferStats()
    start, cpu_start = time.perf_counter(), time.thread_time()
    rank = dist.get_rank()
    batch = batch if batch is not None and rank in set(src.global_ranks) else Batch.empty()
    stats.samples_in = len(batch)
    timeout = default_timeout() if timeout is None else timeout
    participants = sorted(set(src.global_ranks) | set(dst.global_ranks))
    if src == dst and keep_groups:
        out = batch
    elif rank not in participants:
        out = Batch.empty()
    else:
        _check_group(process_group, participants)
        _check_load_fields(batch, load_fields)
        channel = open_channel(participants, transport, timeout)
        stats.transport = channel.name
        balance = Balance(fields=load_fields, keep_groups=keep_groups,
                          shared_prompts=shared_prompts)
        args = (balance, channel, timeout, stats)
        if mode == "p2p":
            p2p = p2p_shared if channel.shared and src != dst else _p2p
            out = p2p(batch, src, dst, rank, participants, *args)
        else:
            out = _centralized(batch, src, dst, rank, *args)
    stats.samples_out = len(out)
    stats.wall_s = time.perf_counter() - start
    stats.cpu_s = time.thread_time() - cpu_start
    return out
