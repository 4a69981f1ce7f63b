"""Asynchronous, bucketed, double-buffered weight push from trainer to rollout ranks.

The plan and buckets come from `peerflow.reshard` (`plan_weight_sync`, `make_buckets`):
the same box-intersection plan as a synchronous sync, computed once on every rank.
What differs is the timing:

* **Trainer side** (`WeightPusher.push`, on every trainer rank after an optimizer step):
  for each bucket, `materialize` the bucket's source tensors (a collective over the
  trainer group, same order everywhere), pack the regions each rollout rank needs into a
  staging buffer and `isend` it; then return to training while the bytes travel. At most
  `depth` versions are in flight (2: double buffering); a third push first waits until
  the oldest has been delivered, which bounds staging memory to two model copies' worth
  of this rank's outgoing regions.
* **Rollout side** (`WeightReceiver`): a receiver thread takes buckets while the engine
  generates. Between requests (or while paused, with partial rollout) the rollout loop
  calls `poll()`; once every trainer rank has delivered version `v`, `apply(engine, v)`
  unpacks bucket by bucket into destination tensors and calls `begin_weight_update`,
  `load_weights` per bucket and `finish_weight_update`. A version overtaken by a newer
  complete one before it was applied is skipped (weights are full snapshots).

Both sides fire `peerflow_before_weight_sync` / `peerflow_after_weight_sync` (roles
`actor` and `rollout`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from peerflow.engines import RolloutEngine, TrainEngine, WeightSyncStats
from peerflow.errors import ShardError
from peerflow.reshard.buckets import Bucket, itemsize
from peerflow.reshard.executor import packed_layout
from peerflow.reshard.plan import ReshardPlan, Transfer
from peerflow.streaming.transport import Kind, Message, StreamReceiver, StreamSender


def _region(buf: torch.Tensor, offset: int, t: Transfer) -> torch.Tensor:
    n = t.numel * itemsize(t.src_dtype)
    return buf[offset : offset + n].view(getattr(torch, t.src_dtype)).view(t.src_box.sizes)


def _routes(bucket: Bucket, src: int) -> dict[int, list[Transfer]]:
    routes: dict[int, list[Transfer]] = {}
    for t in bucket.transfers:
        if t.src_rank == src and t.dst_rank != src:
            routes.setdefault(t.dst_rank, []).append(t)
    return routes


def _hooks() -> Any:
    from peerflow.plugins import get_plugin_manager

    return get_plugin_manager().hook


@attrs.define(eq=False)
class WeightPusher:
    """Pushes new weights from this trainer rank to every rollout rank, asynchronously."""

    plan: ReshardPlan
    buckets: Sequence[Bucket]
    rank: int
    sender: StreamSender
    depth: int = 2
    """Versions that may be in flight at once (2 = double buffering)."""
    _inflight: deque[tuple[int, int]] = attrs.field(factory=deque, init=False)

    @property
    def destinations(self) -> tuple[int, ...]:
        """Rollout ranks that receive weights."""
        return tuple(sorted(self.plan.destinations))

    def push(self, trainer: TrainEngine, version: int) -> WeightSyncStats:
        """Packs and starts sending `version`; returns once the bytes are queued.

        Call on every trainer rank (materialize may be collective) in the same order.
        """
        hooks = _hooks()
        hooks.peerflow_before_weight_sync(version=version, role="actor", rank=self.rank)
        start = time.perf_counter()
        while len(self._inflight) >= self.depth:  # wait for the oldest buffer to drain
            self.sender.wait_for(self._inflight.popleft()[1])
        wait_s = time.perf_counter() - start
        mine = {s.local_name: s for s in self.plan.sources.get(self.rank, ())}
        per_dst: dict[int, list[tuple[int, torch.Tensor]]] = {d: [] for d in self.destinations}
        pack_start = time.perf_counter()
        sent = 0
        for bucket in self.buckets:
            specs = [mine[n] for n in bucket.source_tensors if n in mine]
            if not specs:
                continue
            with trainer.materialize(specs) as tensors:
                sources = dict(zip((s.local_name for s in specs), tensors))
                for dst, transfers in _routes(bucket, self.rank).items():
                    offsets, size = packed_layout(transfers)
                    buf = torch.empty(size, dtype=torch.uint8)
                    for t, off in zip(transfers, offsets):
                        _region(buf, off, t).copy_(sources[t.src_tensor][t.src_box.slices()])
                    per_dst[dst].append((bucket.index, buf))
                    sent += size
        pack_s = time.perf_counter() - pack_start
        for dst, items in per_dst.items():
            self.sender.send(dst, Kind.WEIGHTS, a=version, b=len(items))
            for index, buf in items:
                self.sender.send(dst, Kind.BUCKET, a=version, b=index, payload=buf)
        self._inflight.append((version, self.sender.mark()))
        stats = WeightSyncStats(
            version=version, plan_s=wait_s, pack_s=pack_s, bytes=sent, buckets=len(self.buckets)
        )
        hooks.peerflow_after_weight_sync(version=version, role="actor", rank=self.rank, stats=stats)
        return stats

    def drain(self) -> None:
        """Waits until every pushed version has been delivered."""
        self.sender.flush()
        self._inflight.clear()


@attrs.define(eq=False)
class _Arrival:
    expected: dict[int, int] = attrs.field(factory=dict)
    """Source rank → buckets announced."""
    buffers: dict[tuple[int, int], torch.Tensor] = attrs.field(factory=dict)
    """(source rank, bucket index) → packed bytes."""

    def complete(self, sources: Sequence[int]) -> bool:
        return all(
            s in self.expected and sum(1 for (r, _) in self.buffers if r == s) == self.expected[s]
            for s in sources
        )


@attrs.define(eq=False)
class WeightReceiver:
    """Collects pushed versions on a rollout rank and applies them between requests."""

    plan: ReshardPlan
    buckets: Sequence[Bucket]
    rank: int
    receiver: StreamReceiver
    _arrivals: dict[int, _Arrival] = attrs.field(factory=dict, init=False)
    latest_announced: int = attrs.field(default=0, init=False)
    """Newest version any trainer rank has announced (a lower bound of the trainer's)."""
    stopped: bool = attrs.field(default=False, init=False)
    """Every trainer rank has said it sends no more weights."""
    skipped: int = attrs.field(default=0, init=False)
    """Versions overtaken by newer ones before they were applied."""

    @property
    def sources(self) -> tuple[int, ...]:
        """Trainer ranks that push weights."""
        return tuple(sorted(self.plan.sources))

    def _take(self, message: Message) -> None:
        if message.kind == Kind.WEIGHTS:
            arrival = self._arrivals.setdefault(message.a, _Arrival())
            arrival.expected[message.source] = message.b
            self.latest_announced = max(self.latest_announced, message.a)
        elif message.kind == Kind.BUCKET:
            arrival = self._arrivals.setdefault(message.a, _Arrival())
            arrival.buffers[(message.source, message.b)] = message.payload
        elif message.kind == Kind.STOP:
            self.stopped = self.receiver.all_stopped

    def poll(self, timeout: float | None = None) -> int | None:
        """Takes arrived messages; returns the newest complete version not yet applied.

        Args:
            timeout: Seconds to wait for the first message (`None`: do not wait).

        Raises:
            WorkerFailedError: a trainer rank died or went silent.
        """
        message = self.receiver.get(timeout=timeout)
        while message is not None:
            self._take(message)
            message = self.receiver.get()
        complete = [v for v, a in self._arrivals.items() if a.complete(self.sources)]
        if not complete:
            return None
        newest = max(complete)
        for v in [v for v in self._arrivals if v < newest]:
            del self._arrivals[v]
            self.skipped += 1
        return newest

    def apply(self, rollout: RolloutEngine, version: int) -> WeightSyncStats:
        """Loads a complete version into `rollout` (between requests or while paused)."""
        arrival = self._arrivals.pop(version)
        hooks = _hooks()
        hooks.peerflow_before_weight_sync(version=version, role="rollout", rank=self.rank)
        start = time.perf_counter()
        targets = {s.local_name: s for s in self.plan.destinations.get(self.rank, ())}
        rollout.begin_weight_update(version)
        received = 0
        for bucket in self.buckets:
            names = [n for r, n in bucket.targets if r == self.rank]
            if not names:
                continue
            out: dict[str, torch.Tensor] = {}
            for name in names:
                spec = targets[name]
                out[name] = torch.zeros(spec.local_shape, dtype=getattr(torch, spec.dtype))
            for src in self.sources:
                transfers = [
                    t for t in bucket.transfers if t.src_rank == src and t.dst_rank == self.rank
                ]
                if not transfers:
                    continue
                buf = arrival.buffers.get((src, bucket.index))
                offsets, size = packed_layout(transfers)
                if buf is None or buf.numel() != size:
                    raise ShardError(
                        f"rank {self.rank} got {None if buf is None else buf.numel()} bytes "
                        f"from trainer rank {src} for bucket {bucket.index} of version "
                        f"{version}, expected {size}; the ranks planned differently."
                    )
                for t, off in zip(transfers, offsets):
                    out[t.dst_tensor][t.dst_box.slices()].copy_(_region(buf, off, t))
                received += size
            rollout.load_weights([(targets[n], out[n]) for n in names])
        rollout.finish_weight_update()
        stats = WeightSyncStats(
            version=version,
            load_s=time.perf_counter() - start,
            bytes=received,
            buckets=len(self.buckets),
        )
        hooks.peerflow_after_weight_sync(
            version=version, role="rollout", rank=self.rank, stats=stats
        )
        return stats
