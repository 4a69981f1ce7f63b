"""Setting a weight sync up: every rank's specs gathered, the plan, the `auto` transport.

Collective over the sync's group (`gather_specs`); `WeightSyncService.build`
(`peerflow.reshard.service`) calls these once per run.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from peerflow.distributed.comm import all_gather_values
from peerflow.engines import RolloutEngine, TrainEngine
from peerflow.reshard.plan import ReshardPlan, plan_reshard
from peerflow.reshard.transport import WeightTransport, make_transport
from peerflow.shard import Box, ShardPiece, ShardSpec
from peerflow.wirecodec import register

for _spec_class in (Box, ShardPiece, ShardSpec):  # every rank's specs travel (`gather_specs`)
    register(_spec_class)


def rank_and_world(group: Any) -> tuple[int, int]:
    """This process's global rank and `group`'s size (`(0, 1)` without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(group)
    return 0, 1


def gather_specs(trainer: TrainEngine | None, rollout: RolloutEngine | None, *,
                 group: Any = None) -> tuple[dict[int, list], dict[int, list]]:
    """Collects every rank's source and destination specs (collective over `group`).

    Returns:
        `(sources, destinations)`, each global rank → its specs (ranks without a trainer
        or rollout engine are absent from that side).
    """
    rank, world = rank_and_world(group)
    mine = (rank,
            list(trainer.weight_sources()) if trainer is not None else None,
            list(rollout.weight_targets()) if rollout is not None else None)
    entries = [mine]
    if world > 1:
        entries = all_gather_values(mine, group, what="weight sync: every rank's specs")
    sources = {r: s for r, s, _ in entries if s is not None}
    destinations = {r: d for r, _, d in entries if d is not None}
    return sources, destinations


def plan_weight_sync(trainer: TrainEngine | None, rollout: RolloutEngine | None, *,
                     group: Any = None, ignore: tuple[str, ...] = ()) -> ReshardPlan:
    """Gathers every rank's specs and plans the sync (collective; same plan everywhere).

    Args:
        trainer: This rank's train engine, or `None`.
        rollout: This rank's rollout engine, or `None`.
        group: Process group of every rank in the sync (`None`: world).
        ignore: HF names or patterns the rollout side deliberately does not take.
    """
    sources, destinations = gather_specs(trainer, rollout, group=group)
    return plan_reshard(sources, destinations, ignore=ignore)


def auto_transport(plan: ReshardPlan, *, rank: int, group: Any, device: str
                   ) -> WeightTransport:
    """The transport `auto` stands for (every rank of the group decides alike).

    `inprocess` when no transfer crosses ranks; else `shm` when every rank of the group
    shares this host's memory (CPU buffers); else `cuda_ipc` when ranks share a GPU (one
    host with more ranks than GPUs: NCCL refuses two ranks on one device, and gloo would
    stage every bucket through the host); else `torch`.
    """
    from peerflow.distributed.devices import ranks_share_devices

    if not any(t.src_rank != t.dst_rank for t in plan.transfers):
        return make_transport("inprocess", rank=rank, group=group, device=device)
    shared = make_transport("shm", rank=rank, group=group, device=device)
    if not isinstance(shared.route(), str):
        return shared
    if str(device).startswith("cuda") and ranks_share_devices():
        return make_transport("cuda_ipc", rank=rank, group=group, device=device)
    return make_transport("torch", rank=rank, group=group, device=device)
