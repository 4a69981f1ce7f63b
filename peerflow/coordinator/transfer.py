"""`TransferPlan`: who sends which samples to whom on one route (pure, no communication).

Built identically on every rank of the route from the all-gathered metadata (group id
and token load of every sample, per producer dp-rank):

* each unit (a prompt group, or a single sample when the caller passes sample ids: a
  re-balance after the advantage step) goes whole to one consumer dp-rank, token loads
  balanced; a unit whose producer is also a rank of a consumer dp group stays there when
  that keeps the busiest load within `slack` (5% for groups) of the balanced one
  (`balance_groups_local`);
* the k-th rank of a consumer dp group (its tp/pp peers all receive the same samples)
  receives from itself when it holds the producer's data (colocated ranks move nothing),
  otherwise from the producer dp group's rank `k mod size`, spreading send load over
  the producer's tp peers;
* a receiver that is assigned nothing still gets an empty message from producer dp 0,
  so it learns the batch's fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from peerflow.coordinator.assign import balance_groups_local
from peerflow.layout import ParallelLayout


def dp_members(layout: ParallelLayout) -> list[tuple[int, ...]]:
    """Returns, for each dp index, the global ranks (tp/pp/… peers) that consume it.

    Computed from mesh arithmetic in one pass (`ParallelLayout.ranks_of_dp` is O(N) per call).
    """
    inner = layout.ep * layout.cp * layout.tp
    members: list[list[int]] = [[] for _ in range(layout.dp)]
    for local, rank in enumerate(layout.global_ranks):
        members[(local // inner) % layout.dp].append(rank)
    return [tuple(m) for m in members]


@attrs.frozen(kw_only=True)
class TransferPlan:
    """The sample movements of one route for one batch."""

    src: ParallelLayout
    """Producer layout."""
    dst: ParallelLayout
    """Consumer layout."""
    dst_of_sample: tuple[tuple[int, ...], ...]
    """For each producer dp-rank, the consumer dp-rank of each of its samples."""
    sends: dict[tuple[int, int], tuple[int, ...]]
    """`(sender, receiver)` global ranks → indices into the sender's dp-shard, in order.
    A pair with `sender == receiver` is a local copy."""
    dst_loads: tuple[int, ...]
    """Token load each consumer dp-rank receives."""
    src_loads: tuple[int, ...] = ()
    """Token load each producer dp-rank held before the move."""

    @property
    def moves(self) -> bool:
        """Whether any sample crosses a process boundary."""
        return any(s != r and idx for (s, r), idx in self.sends.items())

    def receives(self, rank: int) -> list[tuple[int, tuple[int, ...]]]:
        """`(sender, indices)` pairs addressed to `rank`, in producer-dp order."""
        return [(s, idx) for (s, r), idx in self.sends.items() if r == rank]


def plan_transfer(
    src: ParallelLayout,
    dst: ParallelLayout,
    prompt_groups: Sequence[Sequence[int]],
    loads: Sequence[Sequence[int]],
    slack: float = 0.05,
) -> TransferPlan:
    """Plans a route's movements from per-producer-dp metadata.

    Args:
        src: Producer layout.
        dst: Consumer layout.
        prompt_groups: For each producer dp-rank, the unit id of each of its samples: the
            prompt-group id (`Batch.group_id`), so a prompt group goes whole to one
            consumer, or the sample id to balance samples one by one.
        loads: For each producer dp-rank, the token load of each sample.
        slack: Tolerated increase of the busiest consumer's load for keeping units where
            they are (0: only when that costs nothing).

    Returns:
        The plan every rank of the route computes identically.

    Raises:
        ValueError: the metadata does not have one entry per producer dp-rank.
    """
    if len(prompt_groups) != src.dp or len(loads) != src.dp:
        raise ValueError(
            f"plan_transfer: got metadata for {len(prompt_groups)} producer dp-ranks but the "
            f"producer layout {src.describe()} has dp={src.dp}."
        )
    group_index: dict[int, int] = {}
    group_home: list[int] = []
    sample_group: list[list[int]] = []
    src_members = dp_members(src)
    dst_members = dp_members(dst)
    dst_dp_of_rank = {r: d for d, m in enumerate(dst_members) for r in m}
    for gids, lens, senders in zip(prompt_groups, loads, src_members):
        if len(gids) != len(lens):
            raise ValueError("plan_transfer: prompt_groups and loads differ in length.")
        # groups numbered in order of first appearance; a group's home is the consumer
        # dp-rank colocated with the producer of its first sample (-1: none)
        row = [group_index.setdefault(g, len(group_index)) for g in gids]
        home = next((dst_dp_of_rank[r] for r in senders if r in dst_dp_of_rank), -1)
        group_home += [home] * (len(group_index) - len(group_home))
        sample_group.append(row)
    group_load = [0] * len(group_index)
    for row, lens in zip(sample_group, loads):
        for g, load in zip(row, lens):
            group_load[g] += load
    group_dst = balance_groups_local(group_load, dst.dp, group_home, slack)
    dst_loads = [0] * dst.dp
    for g, d in enumerate(group_dst):
        dst_loads[d] += group_load[g]
    dst_of_sample = tuple(tuple(map(group_dst.__getitem__, row)) for row in sample_group)
    sends: dict[tuple[int, int], tuple[int, ...]] = {}
    for targets, senders in zip(dst_of_sample, src_members):
        by_dst: dict[int, list[int]] = {d: [] for d in targets}
        for i, d in enumerate(targets):
            by_dst[d].append(i)
        for d, indices in by_dst.items():
            for k, receiver in enumerate(dst_members[d]):
                sender = receiver if receiver in senders else senders[k % len(senders)]
                sends[(sender, receiver)] = tuple(indices)
    receivers = {r for (_, r) in sends}
    for members in dst_members:
        for k, receiver in enumerate(members):
            if receiver not in receivers:
                senders = src_members[0]
                sender = receiver if receiver in senders else senders[k % len(senders)]
                sends[(sender, receiver)] = ()
    return TransferPlan(src=src, dst=dst, dst_of_sample=dst_of_sample, sends=sends,
                        dst_loads=tuple(dst_loads),
                        src_loads=tuple(sum(int(x) for x in lens) for lens in loads))
