"""`WeightSyncService`: the one weight sync of a run — plan, buckets, transport, memory.

Built once per run on every rank of the sync group (`WeightSyncService.build`, a
collective), it serves both schedules on one executor (`peerflow.reshard.executor`):

* **Lockstep** (sync mode): `sync(version)` on every rank together. Per bucket:
  materialise, pack, `transport.exchange`, unpack into the rollout engine's own tensors
  (`weight_buffers`) or staged copies, `load_weights`. At most two buckets of extra memory.
* **Streaming** (async mode; `peerflow.streaming.weight_push` schedules it): a trainer
  rank `pack(version)`s every bucket into one of `depth` reusable buffers (double
  buffering: training goes on while the bytes travel), then `transfer(packed)` runs the
  same per-bucket `transport.exchange` on a background thread; a rollout rank's thread
  calls `transfer(None, version)` in the same order and the rollout loop later
  `apply(received)`s it between requests. Any registered transport works in both
  schedules, the zero-copy `weight_buffers` path included.

Time sharing (colocated placement, `Capabilities.sleep`; `peerflow.reshard.time_share`):
`generating()` wraps generation and puts the rollout engine to sleep after it; `sync`
wakes its weights, loads them, then wakes its KV cache (verl's hybrid-engine order).

Plugin hooks `peerflow_before_weight_sync` / `peerflow_after_weight_sync` fire once per
engine and version on this rank (role `actor` when packing or syncing, `rollout` when
loading).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

import attrs
import torch

from peerflow.engines import RolloutEngine, TrainEngine, WeightSyncStats
from peerflow.reshard.buckets import Bucket, make_buckets
from peerflow.reshard.deadline import exchange_bucket
from peerflow.reshard.delta import DEFAULT_FULL_EVERY, DeltaTransport, with_encoding
from peerflow.reshard.executor import (
    Arena,
    BucketRoutes,
    MemoryMeter,
    bucket_routes,
    destination_tensors,
    materialize_sources,
    pack_regions,
    packed_layout,
    run_plan,
    unpack_regions,
)
from peerflow.reshard.plan import ReshardPlan
from peerflow.reshard.planning import (
    auto_transport,
    gather_specs,
    plan_weight_sync,
    rank_and_world,
)
from peerflow.reshard.time_share import KV_CACHE, WEIGHTS, TimeSharing
from peerflow.reshard.transport import WeightTransport, make_transport

__all__ = ["DEFAULT_BUCKET_BYTES", "VersionBytes", "WeightSyncService", "gather_specs",
           "plan_weight_sync", "sync_weights"]

#: Default bucket size (bytes of destination tensors moved together).
DEFAULT_BUCKET_BYTES = 256 * 2**20


def _hooks() -> Any:
    from peerflow.plugins import get_plugin_manager

    return get_plugin_manager().hook


@attrs.frozen(kw_only=True)
class VersionBytes:
    """One version's packed bytes in flight (from `pack`, or received by `transfer`)."""

    regions: tuple[dict[int, torch.Tensor], ...]
    """Per bucket: peer rank → packed `uint8` regions (packed: the destinations, this rank
    too when colocated; received: the sources)."""
    stats: WeightSyncStats
    """The version, its bytes on this rank and the time so far (`pack_s` or `wire_s`)."""


@attrs.define(eq=False)
class WeightSyncService:
    """This rank's part of the run's weight sync (build with `WeightSyncService.build`)."""

    plan: ReshardPlan
    """The reshard plan, identical on every rank."""
    buckets: tuple[Bucket, ...]
    """`make_buckets(plan, bucket_bytes)`, identical on every rank."""
    transport: WeightTransport
    """This rank's transport instance."""
    rank: int
    """This process's global rank."""
    trainer: TrainEngine | None = None
    """The engine whose weights are read (`None` on rollout-only ranks)."""
    rollout: RolloutEngine | None = None
    """The engine that loads them (`None` on trainer-only ranks)."""
    device: str = "cpu"
    """Where buffers and staged tensors live."""
    time_share: TimeSharing | None = None
    """Sleeps the rollout engine while the trainer runs (colocated, `Capabilities.sleep`)."""
    depth: int = 2
    """Streaming: packed versions that may be in flight at once (2: double buffering)."""
    meter: MemoryMeter = attrs.field(factory=MemoryMeter)
    """Bytes the service holds now and at most (pack pool, received buffers, arenas)."""
    _pool: list[Arena] = attrs.field(factory=list, init=False)
    _packs: int = attrs.field(default=0, init=False)
    _arena: Arena | None = attrs.field(default=None, init=False)
    _routes: tuple[BucketRoutes, ...] = attrs.field(init=False)

    @_routes.default
    def _route_buckets(self) -> tuple[BucketRoutes, ...]:
        """Every bucket's routes on this rank (fixed by the plan: worked out once)."""
        return bucket_routes(self.buckets, self.rank)

    @classmethod
    def build(cls, trainer: TrainEngine | None, rollout: RolloutEngine | None, *,
              transport: str | WeightTransport = "auto",
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, group: Any = None,
              device: str | None = None, colocated: bool = False, plan: ReshardPlan | None = None,
              ignore: tuple[str, ...] = (), encoding: str = "auto",
              full_every: int = DEFAULT_FULL_EVERY) -> WeightSyncService:
        """Plans the sync and binds the transport (collective over `group` unless `plan`).

        Args:
            trainer: This rank's train engine (`None` on rollout-only ranks).
            rollout: This rank's rollout engine (`None` on trainer-only ranks).
            transport: Registered transport name or instance; `auto` picks `inprocess`
                when no transfer crosses ranks, else `shm` when every rank of `group`
                shares this host (CPU buffers), else `cuda_ipc` when ranks share a GPU,
                else `torch`.
            bucket_bytes: Most destination bytes moved per bucket (all ranks together).
            group: Process group of every rank in the sync (`None`: world).
            device: Where buffers live; default the engines' `context.device`.
            colocated: Trainer and rollout share accelerators; the rollout engine then
                sleeps while the trainer runs, when it declares `Capabilities.sleep`.
            plan: A plan made already (skips the collective planning step).
            ignore: HF names or patterns the rollout side deliberately does not take.
            encoding: `full` sends every packed byte; `delta` sends routes between ranks
                as changed words against the receiver's copy (`peerflow.reshard.delta`);
                `auto` takes `delta` on the routes that cross hosts, `full` elsewhere
                (collective: gathers every rank's host name).
            full_every: `delta`: a route travels whole every this many syncs (0: only
                when a receiver's copy does not match).

        Raises:
            ConfigError: bad `bucket_bytes`, `encoding` or `full_every`, or the transport
                cannot run here.
            UnknownNameError: no transport of that name is registered.
        """
        if plan is None:
            plan = plan_weight_sync(trainer, rollout, group=group, ignore=ignore)
        rank, _ = rank_and_world(group)
        if device is None:
            engine = trainer if trainer is not None else rollout
            device = getattr(getattr(engine, "context", None), "device", "cpu") or "cpu"
        if not isinstance(transport, WeightTransport):
            if transport in (None, "auto"):
                transport = auto_transport(plan, rank=rank, group=group, device=device)
            else:
                transport = make_transport(transport, rank=rank, group=group, device=device)
        time_share = (TimeSharing(rollout) if colocated and rollout is not None
                      and rollout.capabilities.sleep else None)
        buckets = tuple(make_buckets(plan, bucket_bytes))
        transport = with_encoding(transport, plan, bucket_routes(buckets, rank),
                                  encoding=encoding, full_every=full_every, group=group)
        return cls(plan=plan, buckets=buckets,
                   transport=transport, rank=rank, trainer=trainer, rollout=rollout,
                   device=device, time_share=time_share)

    # -- lockstep -----------------------------------------------------------------------

    def sync(self, version: int) -> WeightSyncStats:
        """Moves the trainer's weights into the rollout engine(s); every rank, together.

        Returns:
            This rank's time split (pack / wire / load), bytes sent and received, bucket
            count and peak extra memory.
        """
        roles = self._roles(trainer=True, rollout=True)
        self._fire_before(version, roles)
        begin = time.perf_counter()
        self._wake((WEIGHTS,))
        if self.rollout is not None:
            self.rollout.begin_weight_update(version)
        self.meter.peak = self.meter.current
        self._begin_encoding(version, keep=False)  # unpacked before the next sync
        stats = run_plan(
            self.plan, self.buckets, rank=self.rank, transport=self.transport,
            materialize=self.trainer.materialize if self.trainer is not None else None,
            load=self.rollout.load_weights if self.rollout is not None else None,
            buffers=self.rollout.weight_buffers if self.rollout is not None else None,
            device=self.device, meter=self.meter, version=version, routes=self._routes,
            arena=self._kept_arena(),
        )
        stats = self._encoding_stats(stats)
        if self.rollout is not None:
            finish = time.perf_counter()
            self.rollout.finish_weight_update()
            stats = attrs.evolve(stats, load_s=stats.load_s + time.perf_counter() - finish)
        self._wake((KV_CACHE,))
        if self.rollout is not None:  # lockstep: the rollout waits for the whole sync
            stats = attrs.evolve(stats, pause_s=time.perf_counter() - begin)
        self._fire_after(version, roles, stats)
        return stats

    # -- streaming ----------------------------------------------------------------------

    def pack(self, version: int) -> VersionBytes:
        """Packs this trainer rank's regions of every bucket (trainer ranks, same order).

        `materialize` may be a collective over the trainer group. The bytes go into slot
        `n % depth` of a reusable pool: the caller keeps at most `depth` versions in
        flight (waits for `transfer` of the oldest before packing another).
        """
        roles = self._roles(trainer=True, rollout=False)
        self._fire_before(version, roles)
        start = time.perf_counter()
        mine = {s.local_name: s for s in self.plan.sources.get(self.rank, ())}
        layouts = [self._outgoing(routes) for routes in self._routes]
        slot = self._slot(sum(packed_layout(ts)[1] for per in layouts for ts in per.values()))
        sends, counts, sources = [], Counter(), {}
        read = self.trainer.materialize if self.trainer is not None else None
        with contextlib.ExitStack() as stack:
            for bucket, per_peer in zip(self.buckets, layouts):
                if bucket.part is None or bucket.part[0] == 0:  # slices: read once
                    stack.close()
                    sources = materialize_sources(bucket, self.rank, read, mine, stack, counts)
                sends.append(pack_regions(per_peer, sources, slot.take))
        gather_s = counts["gather_s"]
        own = sum(buf.numel() for per in sends for peer, buf in per.items() if peer == self.rank)
        stats = WeightSyncStats(version=version, gather_s=gather_s,
                                pack_s=time.perf_counter() - start - gather_s,
                                bytes=slot.cursor, wire_bytes=slot.cursor - own,
                                buckets=len(self.buckets), peak_extra_bytes=self.meter.peak,
                                senders=self.plan.senders,
                                sender_share=self.plan.sender_share)
        self._fire_after(version, roles, stats)
        return VersionBytes(regions=tuple(sends), stats=stats)

    def transfer(self, packed: VersionBytes | None, version: int) -> VersionBytes | None:
        """Runs every bucket's `transport.exchange` for one version (every rank, in order).

        Safe on a background thread when the transport's group serves nothing else.

        Returns:
            What this rank received (with its own regions when colocated), or `None` on a
            rank without a rollout engine.
        """
        start = time.perf_counter()
        received, nbytes = [], 0
        self._begin_encoding(version)
        for index, routes in enumerate(self._routes):
            sends = dict(packed.regions[index]) if packed is not None else {}
            own = sends.pop(self.rank, None)
            sizes = {peer: packed_layout(ts)[1] for peer, ts in routes.incoming.items()}
            got = exchange_bucket(self.transport, index, sends, sizes, routes.routes)
            if own is not None:  # the pool slot is reused by a later pack
                got[self.rank] = own.clone()
            nbytes += sum(buf.numel() for buf in got.values())
            received.append(got)
        if self.rollout is None:
            return None
        self.meter.reserve(nbytes)
        return VersionBytes(regions=tuple(received), stats=self._encoding_stats(WeightSyncStats(
            version=version, wire_s=time.perf_counter() - start, bytes=nbytes)))

    def apply(self, received: VersionBytes) -> WeightSyncStats:
        """Loads a received version into the rollout engine (between requests)."""
        assert self.rollout is not None, "apply runs on ranks with a rollout engine"
        version, roles = received.stats.version, self._roles(trainer=False, rollout=True)
        self._fire_before(version, roles)
        start = time.perf_counter()
        targets = {s.local_name: s for s in self.plan.destinations.get(self.rank, ())}
        arena = Arena(meter=self.meter, device=self.device)
        self.rollout.begin_weight_update(version)
        try:
            for bucket, routes, buffers in zip(self.buckets, self._routes, received.regions):
                names = [n for r, n in bucket.targets if r == self.rank]
                if not names:
                    continue
                per_peer = dict(routes.incoming)
                if routes.local:
                    per_peer[self.rank] = routes.local
                out = destination_tensors(names, targets, self.rollout.weight_buffers, arena,
                                          sliced=bucket.part is not None)
                unpack_regions(per_peer, buffers, out, rank=self.rank, bucket=bucket.index)
                ready = [n for r, n in bucket.loads if r == self.rank]
                if ready:  # a tensor streamed in slices loads after its last one
                    self.rollout.load_weights([(targets[n], out[n]) for n in ready])
                    for name in ready:
                        arena.drop(name)
        finally:
            arena.release()
            self.discard(received)
        self.rollout.finish_weight_update()
        load_s = time.perf_counter() - start
        stats = attrs.evolve(received.stats, load_s=load_s, pause_s=load_s,
                             buckets=len(self.buckets), peak_extra_bytes=self.meter.peak,
                             senders=self.plan.senders, sender_share=self.plan.sender_share)
        self._fire_after(version, roles, stats)
        return stats

    def discard(self, received: VersionBytes) -> None:
        """Forgets a received version (applied, or overtaken by a newer one)."""
        self.meter.release(received.stats.bytes)

    # -- time sharing -------------------------------------------------------------------

    def generating(self) -> contextlib.AbstractContextManager[None]:
        """Context around generation: sleep/wake time sharing when colocated, else none."""
        return self.time_share.generating() if self.time_share else contextlib.nullcontext()

    def _wake(self, tags: tuple[str, ...]) -> None:
        if self.time_share is not None:
            self.time_share.wake(tags)

    # -- helpers ------------------------------------------------------------------------

    def _begin_encoding(self, version: int, *, keep: bool = True) -> None:
        if isinstance(self.transport, DeltaTransport):
            self.transport.begin(version, keep=keep)

    def _encoding_stats(self, stats: WeightSyncStats) -> WeightSyncStats:
        """`stats` with the delta encoding's wire bytes and counts, when it runs."""
        if not isinstance(self.transport, DeltaTransport):
            return stats
        return attrs.evolve(stats, **self.transport.counters)

    def _kept_arena(self) -> Arena | None:
        """The packing arena kept between syncs when peers map it (`keeps_buffers`)."""
        if not self.transport.keeps_buffers:
            return None
        if self._arena is None:
            self._arena = Arena(meter=self.meter, device=self.device)
        return self._arena

    def _outgoing(self, routes: BucketRoutes) -> dict[int, list]:
        per_peer = dict(routes.outgoing)
        if routes.local:
            per_peer[self.rank] = routes.local
        return per_peer

    def _slot(self, nbytes: int) -> Arena:
        """The next of `depth` reusable pack buffers, reset and grown to `nbytes`."""
        if not self._pool:
            self._pool = [Arena(meter=self.meter, device=self.device)
                          for _ in range(max(self.depth, 1))]
        slot = self._pool[self._packs % len(self._pool)]
        self._packs += 1
        slot.reset()
        slot.reserve_total(nbytes)
        return slot

    def _roles(self, *, trainer: bool, rollout: bool) -> list[str]:
        roles = []
        if trainer and self.trainer is not None:
            roles.append("actor")
        if rollout and self.rollout is not None:
            roles.append("rollout")
        return roles

    def _fire_before(self, version: int, roles: list[str]) -> None:
        hooks = _hooks() if roles else None
        for role in roles:
            hooks.peerflow_before_weight_sync(version=version, role=role, rank=self.rank)

    def _fire_after(self, version: int, roles: list[str], stats: WeightSyncStats) -> None:
        hooks = _hooks() if roles else None
        for role in roles:
            hooks.peerflow_after_weight_sync(version=version, role=role, rank=self.rank,
                                             stats=stats)


def sync_weights(trainer: TrainEngine | None, rollout: RolloutEngine | None, *, version: int,
                 plan: ReshardPlan | None = None, transport: str | WeightTransport = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, group: Any = None,
                 device: str | None = None) -> WeightSyncStats:
    """One-off sync (tests, conformance): builds a `WeightSyncService` and syncs once.

    A run builds one service and calls `sync` on it every time instead; with `plan=None`
    this plans (collectively) on every call. `plan_s` reports the build time.
    """
    start = time.perf_counter()
    service = WeightSyncService.build(trainer, rollout, transport=transport, plan=plan,
                                      bucket_bytes=bucket_bytes, group=group, device=device)
    plan_s = time.perf_counter() - start
    return attrs.evolve(service.sync(version), plan_s=plan_s)
