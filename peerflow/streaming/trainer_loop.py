"""The trainer rank's program in async mode: collect a step, train, push weights.

Loop on every trainer rank, step `s = start … steps-1` (version `s` → `s + 1`):

1. take messages from the rollout ranks: groups for step `s` go to the
   `MicroBatchAccumulator` (groups for later steps wait in a buffer), seals are counted
   by the `StepInbox`; every micro-batch that fills up is processed at once
   (`per_micro_batch`: old/reference log-probs) when the trainer group has one rank —
   with several ranks those forwards are collectives (FSDP all-gathers) and run once per
   step, so every rank calls them the same number of times;
2. when every rollout rank has sealed `s` and its groups are in: run the per-step nodes
   (advantage if it needs trainer output, `train_actor`, …) on the step's samples in
   `sample_id` order;
3. push version `s + 1` asynchronously (`WeightPusher`, every `weight_sync.every` steps)
   and yield the step to the run driver (`peerflow.worker.driver`), which reports it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from peerflow.batch import Batch
from peerflow.coordinator.wire import unpack_batch
from peerflow.streaming.accumulator import MicroBatchAccumulator, StepInbox
from peerflow.streaming.metrics import (
    ActivityLog,
    clip,
    overlap_fraction,
    staleness_metrics,
    total,
)
from peerflow.streaming.transport import Kind, StreamReceiver, decode_payload


@attrs.define(eq=False)
class TrainerStreamer:
    """One trainer rank's async program."""

    receiver: StreamReceiver
    inbox: StepInbox
    accumulator: MicroBatchAccumulator
    per_micro_batch: Callable[[Batch, Any], Batch]
    """`f(micro_batch, metrics) -> batch`: forwards that may start before the step is in."""
    per_step: Callable[[Batch, Any], Batch]
    """`f(step_batch, metrics) -> batch`: the remaining nodes, training included."""
    push: Callable[[int], Any] | None
    """`push(version)` starts sending new weights (`None`: never)."""
    new_metrics: Callable[[], Any]
    """Returns a fresh `StepMetrics`."""
    steps: int
    rank: int
    stream_micro_batches: bool = True
    """Process micro-batches as they fill (single-rank trainer groups)."""
    sync_every: int = 1
    start_step: int = 0
    max_staleness: int = 0
    """The bound, so every rank reports the same histogram bins."""
    activity: ActivityLog = attrs.field(factory=ActivityLog)
    spans: Any = None
    """A tracer with `span(name, **args)` (`peerflow.outputs.Tracer`), or `None`."""
    _future: dict[int, list[Batch]] = attrs.field(factory=dict, init=False)
    _reports: dict[int, list[dict]] = attrs.field(factory=dict, init=False)
    _source_of: dict[int, int] = attrs.field(factory=dict, init=False)
    _rollout_busy: list[tuple[float, float]] = attrs.field(factory=list, init=False)
    _rollout_idle: list[tuple[float, float]] = attrs.field(factory=list, init=False)
    _previous: tuple[tuple[float, float], list] | None = attrs.field(default=None, init=False)
    trained_groups: dict[int, list[int]] = attrs.field(factory=dict, init=False)
    """Source rank → group ids collected into a trained step (for checkpoints)."""

    def _span(self, name: str, **args: Any) -> Any:
        return (
            self.spans.span(f"trainer/{name}", **args) if self.spans else contextlib.nullcontext()
        )

    def _take(self, message: Any, step: int, done: list[Batch], metrics: Any) -> None:
        if message.kind == Kind.GROUP:
            batch = unpack_batch(message.payload)  # one or more whole groups
            groups = dict.fromkeys(batch.group_id.tolist())
            self.inbox.on_group(message.a, message.source, len(groups))
            for gid in groups:
                self._source_of[gid] = message.source
            if message.a == step:
                self.accumulator.add(batch)
            elif message.a > step:
                self._future.setdefault(message.a, []).append(batch)
        elif message.kind == Kind.SEAL:
            self.inbox.on_seal(message.a, message.source, message.b)
            if message.payload is not None:
                report = decode_payload(message.payload, f"seal report from rank {message.source}")
                self._reports.setdefault(message.a, []).append(report)
                self._rollout_busy += report["busy"]
                self._rollout_idle += report["idle"]
        if self.stream_micro_batches:
            for micro in self.accumulator.pop_ready():
                with self._span("micro-batch forwards", samples=len(micro)):
                    done.append(self.per_micro_batch(micro, metrics))

    def _collect(self, step: int, metrics: Any) -> tuple[Batch, int]:
        done: list[Batch] = []
        for batch in self._future.pop(step, []):
            self.accumulator.add(batch)
        max_depth = 0
        while not self.inbox.complete(step):
            max_depth = max(max_depth, self.accumulator.pending + self.receiver.depth)
            message = self.receiver.get()
            if message is None:
                with self._span("wait for samples"), self.activity.track("idle"):
                    message = self.receiver.get(timeout=0.5)
                if message is None:
                    if self.receiver.all_stopped:
                        raise RuntimeError(
                            f"every rollout rank stopped before sealing step {step}; see the "
                            "rollout ranks' logs."
                        )
                    continue
            with self.activity.track("busy"):
                self._take(message, step, done, metrics)
        with self.activity.track("busy"):
            rest = self.accumulator.pop_ready(final=True)
            if rest:
                joined = Batch.concat(rest)
                if self.stream_micro_batches:
                    done.append(self.per_micro_batch(joined, metrics))
                else:
                    done.append(joined)
        self.accumulator.reset()
        self.inbox.forget(step)
        batch = Batch.concat(done) if done else Batch.empty()
        order = torch.argsort(batch.sample_id)
        batch = batch.select(order.tolist())
        for gid in dict.fromkeys(batch.group_id.tolist()):
            self.trained_groups.setdefault(self._source_of.pop(gid), []).append(gid)
        if not self.stream_micro_batches and len(batch):
            batch = self.per_micro_batch(batch, metrics)
        return batch, max_depth

    def run(self) -> Iterator[tuple[int, Batch, Any, dict[str, float]]]:
        """Trains steps `start_step … steps-1`, yielding each as it ends.

        Yields:
            `(step, batch, metrics, extra)`: the 0-based step, its trained samples, this
            rank's `StepMetrics` and the streaming figures (idle, queue, staleness, …).
        """
        for step in range(self.start_step, self.steps):
            metrics = self.new_metrics()
            window_start = time.time()
            with self._span(f"collect step {step}"):
                batch, depth = self._collect(step, metrics)
            with self._span(f"train step {step}", samples=len(batch)), self.activity.track("busy"):
                batch = self.per_step(batch, metrics)
                version = step + 1
                if self.push is not None and (
                    version % self.sync_every == 0 or version == self.steps
                ):
                    with self._span("push weights", version=version):
                        self.push(version)
            extra = self._step_extra(step, batch, depth, (window_start, time.time()))
            yield step, batch, metrics, extra

    def _step_extra(
        self, step: int, batch: Batch, depth: int, window: tuple[float, float]
    ) -> dict[str, float]:
        busy, idle = self.activity.take()
        reports = self._reports.pop(step, [])
        length = max(window[1] - window[0], 1e-9)
        extra: dict[str, float] = {
            "idle/trainer_s": total(idle),
            "idle/trainer_fraction": min(total(idle) / length, 1.0),
            "queue/trainer_pending": float(depth),
        }
        # Rollout activity during a window arrives with later seals, so the rollout-side
        # figures describe the previous step's window.
        if self._previous is not None:
            prev_window, prev_busy = self._previous
            prev_length = max(prev_window[1] - prev_window[0], 1e-9)
            sources = max(len(reports), 1)
            extra["overlap/fraction"] = overlap_fraction(prev_busy, self._rollout_busy)
            extra["idle/rollout_fraction"] = min(
                total(clip(self._rollout_idle, prev_window)) / (prev_length * sources), 1.0
            )
            horizon = prev_window[0]
            self._rollout_busy = [i for i in self._rollout_busy if i[1] > horizon]
            self._rollout_idle = [i for i in self._rollout_idle if i[1] > horizon]
        self._previous = (window, clip(busy, window))
        if reports:
            extra["idle/rollout_s"] = sum(total(r["idle"]) for r in reports) / len(reports)
            extra["queue/rollout_in_flight"] = float(sum(r["in_flight"] for r in reports))
            extra["queue/rollout_finished"] = float(sum(r["finished"] for r in reports))
            extra["rollout/weight_load_s"] = max(r["weight_load_s"] for r in reports)
            # Staged weights: the bytes arrived while the rollout generated; it stops only
            # to apply them between requests, so its pause is the apply time.
            extra["weight_sync/pause_s"] = extra["rollout/weight_load_s"]
            extra["rollout/skipped_versions"] = float(max(r["skipped_versions"] for r in reports))
        extra.update(staleness_metrics((step - batch.weight_version).tolist(), self.max_staleness))
        return extra
