"""Modelled traffic of a route at any scale, from the same planning code the runtime uses.

`simulate_route` builds synthetic per-sample metadata (seeded token loads), runs the
runtime's `plan_transfer` on it, and counts the bytes each rank would send and receive
in `p2p` mode and in the `centralized` baseline — without starting processes, so it
reaches N = 1024 in well under a second per point.
"""

from __future__ import annotations

import random

import attrs

from peerflow.coordinator.transfer import dp_members, plan_transfer
from peerflow.layout import ParallelLayout

#: Bytes per sample of metadata (group id, load and packed-size bound, int64 each).
METADATA_BYTES = 24
#: Bytes of a metadata message besides its samples (length, fixed bytes, sample count).
METADATA_HEADER_BYTES = 24


@attrs.frozen(kw_only=True)
class RouteTraffic:
    """Bytes one route moves, per rank and at the busiest rank."""

    mode: str
    """`p2p` or `centralized`."""
    nprocs: int
    """Ranks in the route."""
    samples: int
    """Samples moved."""
    busiest_rank_bytes: int
    """Largest `sent + received` over ranks (metadata included)."""
    total_bytes: int
    """Bytes over all links (each byte counted once)."""
    busiest_rank: int
    """Which rank that is."""


def synthetic_metadata(
    src: ParallelLayout, samples_per_dp: int, group_size: int, mean_tokens: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Group ids and token loads for each producer dp-rank (groups never straddle ranks)."""
    rng = random.Random(seed)
    group_ids, loads = [], []
    group = 0
    for _ in range(src.dp):
        gids, lens = [], []
        for i in range(samples_per_dp):
            if i and i % group_size == 0:
                group += 1
            gids.append(group)
            lens.append(max(1, int(rng.expovariate(1 / mean_tokens))))
        group += 1
        group_ids.append(gids)
        loads.append(lens)
    return group_ids, loads


def simulate_route(
    src: ParallelLayout,
    dst: ParallelLayout,
    *,
    samples_per_dp: int,
    group_size: int = 8,
    mean_tokens: int = 256,
    bytes_per_token: int = 16,
    mode: str = "p2p",
    seed: int = 0,
) -> RouteTraffic:
    """Models one `redistribute` call on `src ∪ dst`.

    Args:
        src: Producer layout.
        dst: Consumer layout.
        samples_per_dp: Samples each producer dp-rank holds.
        group_size: Answers per prompt.
        mean_tokens: Mean token load of a sample (exponentially distributed).
        bytes_per_token: Payload bytes per token over all ragged fields (ids, log-probs,
            advantages, …: 16 ≈ int64 ids + two float32 columns).
        mode: `p2p` or `centralized`.
        seed: Seed of the synthetic lengths.

    Returns:
        The modelled traffic.
    """
    group_ids, loads = synthetic_metadata(src, samples_per_dp, group_size, mean_tokens, seed)
    samples = sum(len(row) for row in loads)
    if src == dst:  # `redistribute` returns at once: nothing moves
        return RouteTraffic(mode=mode, nprocs=src.world_size, samples=samples,
                            busiest_rank_bytes=0, total_bytes=0, busiest_rank=src.global_ranks[0])
    plan = plan_transfer(src, dst, group_ids, loads)
    members = dp_members(src)
    sample_bytes = [[t * bytes_per_token for t in row] for row in loads]
    ranks = sorted(set(src.global_ranks) | set(dst.global_ranks))
    sent = dict.fromkeys(ranks, 0)
    received = dict.fromkeys(ranks, 0)
    owner = {r: dp for dp, m in enumerate(members) for r in m}
    if mode == "p2p":
        # each producer leader sends its metadata message to every other rank of the route
        message = {m[0]: METADATA_HEADER_BYTES + len(row) * METADATA_BYTES
                   for m, row in zip(members, loads)}
        all_metadata = sum(message.values())
        for rank in ranks:
            sent[rank] += message.get(rank, 0) * (len(ranks) - 1)
            received[rank] += all_metadata - message.get(rank, 0)
        for (sender, receiver), indices in plan.sends.items():
            if sender != receiver:
                nbytes = sum(sample_bytes[owner[sender]][i] for i in indices)
                sent[sender] += nbytes
                received[receiver] += nbytes
    elif mode == "centralized":
        controller = ranks[0]
        for dp, m in enumerate(members):
            if m[0] != controller:
                nbytes = sum(sample_bytes[dp])
                sent[m[0]] += nbytes
                received[controller] += nbytes
        for (sender, receiver), indices in plan.sends.items():
            if receiver != controller:
                nbytes = sum(sample_bytes[owner[sender]][i] for i in indices)
                sent[controller] += nbytes
                received[receiver] += nbytes
    else:
        raise ValueError(f"simulate_route: mode={mode!r}; use 'p2p' or 'centralized'.")
    busiest = max(ranks, key=lambda r: (sent[r] + received[r], -r))
    return RouteTraffic(mode=mode, nprocs=len(ranks), samples=samples,
                        busiest_rank_bytes=sent[busiest] + received[busiest],
                        total_bytes=sum(sent.values()), busiest_rank=busiest)
