"""`sync_weights`: the call the runtime makes on every rank taking part in a weight sync.

Call order (every rank of the sync group — trainer ranks, rollout ranks, or both when
colocated — makes the same calls in the same order):

1. Once, or whenever an engine is rebuilt:
   `plan = plan_weight_sync(trainer, rollout, group=group)` — gathers every rank's
   `TrainEngine.weight_sources()` and `RolloutEngine.weight_targets()` metadata
   (one `all_gather_object`) and runs `plan_reshard`. Collective.
2. Each sync: `stats = sync_weights(trainer, rollout, plan=plan, version=v, group=group,
   transport=…, bucket_bytes=…)`. Pass `trainer=None` on ranks without a trainer shard
   and `rollout=None` on ranks without a rollout engine. Inside, per rank:
   `rollout.begin_weight_update(v)`; for each bucket `trainer.materialize(specs)` (every
   trainer rank, same specs), pack, `transport.exchange`, unpack (into
   `rollout.weight_buffers(specs)` when the engine offers its own tensors, else into
   staged copies), `rollout.load_weights(items)`; then `rollout.finish_weight_update()`. The
   `peerflow_before_weight_sync` / `peerflow_after_weight_sync` plugin hooks run here,
   once per engine on this rank (roles `actor` and `rollout`).

Colocated (one process holds both engines, e.g. one rank, or dp ranks each holding a
trainer shard and a rollout replica): same call; transfers within a rank are direct
copies, and with no cross-rank transfer at all the `inprocess` transport is chosen.
Split (trainer and rollout on different ranks): the default transport is `torch`
(gloo p2p on CPU, NCCL on GPU) over `group` (default: the world group).

With `plan=None`, `sync_weights` plans on first use and caches the plan on the engines
(step 1 done implicitly, collectively, on the first call).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from peerflow.engines import RolloutEngine, TrainEngine, WeightSyncStats
from peerflow.reshard.buckets import make_buckets
from peerflow.reshard.executor import MemoryMeter, run_plan
from peerflow.reshard.plan import ReshardPlan, plan_reshard
from peerflow.reshard.transport import WeightTransport, make_transport

#: Default bucket size (bytes of destination tensors moved together).
DEFAULT_BUCKET_BYTES = 256 * 2**20

_CACHE_ATTR = "_peerflow_reshard_plan"


def _rank_and_world(group: Any) -> tuple[int, int]:
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
    rank, world = _rank_and_world(group)
    mine = (rank,
            list(trainer.weight_sources()) if trainer is not None else None,
            list(rollout.weight_targets()) if rollout is not None else None)
    entries = [mine]
    if world > 1:
        entries = [None] * world
        dist.all_gather_object(entries, mine, group=group)
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


def sync_weights(
    trainer: TrainEngine | None,
    rollout: RolloutEngine | None,
    *,
    version: int,
    plan: ReshardPlan | None = None,
    transport: str | WeightTransport | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: Any = None,
    device: str | None = None,
) -> WeightSyncStats:
    """Moves the trainer's weights into the rollout engine(s); call on every rank.

    Args:
        trainer: This rank's train engine (`None` on rollout-only ranks).
        rollout: This rank's rollout engine (`None` on trainer-only ranks).
        version: Weight version the rollout engines publish after the sync.
        plan: From `plan_weight_sync`; `None` plans on first use and caches it.
        transport: Registered transport name or instance; default `inprocess` when no
            transfer crosses ranks, else `torch`.
        bucket_bytes: Most destination bytes moved per bucket (all ranks together).
        group: Process group of every rank in the sync (`None`: world).
        device: Where buffers live; default the engines' `context.device`.

    Returns:
        This rank's time split (plan / pack / wire / load), bytes it sent and received,
        bucket count and peak extra memory.
    """
    start = time.perf_counter()
    if plan is None:
        plan = _cached_plan(trainer, rollout, group)
    rank, _ = _rank_and_world(group)
    if device is None:
        engine = trainer if trainer is not None else rollout
        device = getattr(getattr(engine, "context", None), "device", "cpu") or "cpu"
    if not isinstance(transport, WeightTransport):
        if transport is None:
            cross = any(t.src_rank != t.dst_rank for t in plan.transfers)
            transport = "torch" if cross else "inprocess"
        transport = make_transport(transport, rank=rank, group=group, device=device)
    buckets = make_buckets(plan, bucket_bytes)
    plan_s = time.perf_counter() - start
    roles = [("actor", trainer), ("rollout", rollout)]
    hooks = _hooks()
    for role, engine in roles:
        if engine is not None and hooks is not None:
            hooks.peerflow_before_weight_sync(version=version, role=role, rank=rank)
    if rollout is not None:
        rollout.begin_weight_update(version)
    meter = MemoryMeter()
    stats = run_plan(
        plan, buckets, rank=rank, transport=transport,
        materialize=trainer.materialize if trainer is not None else None,
        load=rollout.load_weights if rollout is not None else None,
        buffers=getattr(rollout, "weight_buffers", None),
        device=device, meter=meter,
    )
    if rollout is not None:
        finish = time.perf_counter()
        rollout.finish_weight_update()
        stats.load_s += time.perf_counter() - finish
    result = WeightSyncStats(
        version=version, plan_s=plan_s, pack_s=stats.pack_s, wire_s=stats.wire_s,
        load_s=stats.load_s, bytes=stats.bytes_sent + stats.bytes_received,
        buckets=stats.buckets, peak_extra_bytes=stats.peak_extra_bytes,
    )
    for role, engine in roles:
        if engine is not None and hooks is not None:
            hooks.peerflow_after_weight_sync(version=version, role=role, rank=rank, stats=result)
    return result


def _hooks() -> Any:
    from peerflow.plugins import get_plugin_manager

    return get_plugin_manager().hook


def _cached_plan(trainer: Any, rollout: Any, group: Any) -> ReshardPlan:
    key = (id(trainer), id(rollout), id(group))
    holder = trainer if trainer is not None else rollout
    cached = getattr(holder, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = plan_weight_sync(trainer, rollout, group=group)
    setattr(holder, _CACHE_ATTR, (key, plan))
    return plan


def forget_plan(engine: Any) -> None:
    """Drops the plan `sync_weights` cached on `engine` (call on every rank together)."""
    if hasattr(engine, _CACHE_ATTR):
        delattr(engine, _CACHE_ATTR)
