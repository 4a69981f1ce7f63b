"""The rollout rank's program in async mode: admit, generate, score, stream, apply weights.

Loop on every rollout rank (each is its own dp replica; no rollout peer is consulted):

1. apply the newest fully received weight version, if any (between requests);
2. admit new prompts while `StalenessScheduler.can_admit` allows (at most
   `runtime.async_prompts_per_call` per generate call), else wait for weights — the
   only idle time on this side;
3. generate (in chunks with `runtime.partial_rollout`, applying new weights between
   chunks), run the per-group nodes (reward, and the advantage when it needs no trainer
   output), mark the groups finished;
4. place finished groups into steps (earliest deadline first), assign each to the trainer
   dp-rank with the fewest tokens from this rank in that step, send the groups placed
   together as one message per (step, trainer), and seal completed steps with a message
   that also carries this rank's activity for the step.

It ends when it has sealed `run.steps` steps, then sends `STOP` and waits for the
trainers' `STOP` on the weight channel. Between requests (never inside a generate call)
it hands the loaded weight version to `after_weights` (held-out evaluation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.coordinator.wire import pack_batch
from peerflow.layout import ParallelLayout
from peerflow.streaming.assignment import TokenBalancer
from peerflow.streaming.metrics import ActivityLog
from peerflow.streaming.partial import generate_in_segments
from peerflow.streaming.staleness import StalenessScheduler
from peerflow.streaming.transport import Heartbeat, Kind, StreamSender, encode_payload
from peerflow.streaming.versions import TOKEN_VERSIONS, oldest_version, token_versions
from peerflow.streaming.weight_push import WeightReceiver


def split_groups(batch: Batch) -> list[Batch]:
    """Splits a batch into one batch per group, in first-appearance order."""
    order: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_id.tolist()):
        order.setdefault(g, []).append(i)
    return [batch.select(idx) for idx in order.values()]


def attach_segments(batch: Batch, segments: Sequence[Sequence[tuple[int, int]]]) -> Batch:
    """Adds `token_versions` and sets each sample's `weight_version` to its oldest segment."""
    lengths = batch.lengths("response_ids").tolist()
    default = batch.weight_version.tolist()
    batch.set(
        TOKEN_VERSIONS,
        RaggedField.from_tensors(
            [token_versions(s, n, d) for s, n, d in zip(segments, lengths, default)],
            dtype=torch.int64,
        ),
    )
    batch.weight_version = torch.tensor(
        [oldest_version(s, d) for s, d in zip(segments, default)], dtype=torch.int64
    )
    return batch


@attrs.define(eq=False)
class RolloutStreamer:
    """One rollout rank's async program."""

    engine: Any
    """This rank's `RolloutEngine`."""
    generate: Callable[[Sequence[Any], Any, Callable[[], None]], Batch]
    """`generate(draws, sampling, between_chunks) -> batch` (fields as `generate_batch`)."""
    draw: Callable[[int], list[Any]]
    """`draw(count) -> draws` from this rank's prompt shard."""
    sampling_for: Callable[[int, int], Any]
    """`sampling_for(open_step, call_in_step) -> SamplingParams` (seeded)."""
    per_group: Callable[[Batch], Batch]
    """Per-group nodes (reward, advantage) run on a finished group's batch."""
    scheduler: StalenessScheduler
    balancer: TokenBalancer
    trainer_layout: ParallelLayout
    sender: StreamSender
    weights: WeightReceiver
    steps: int
    """Training steps of the run (this rank seals `steps` steps, then stops)."""
    rank: int
    prompts_per_call: int = 0
    """Most prompts per generate call (0: the rank's per-step quota)."""
    heartbeat_s: float = 5.0
    activity: ActivityLog = attrs.field(factory=ActivityLog)
    spans: Any = None
    """A tracer with `span(name, **args)` (`peerflow.outputs.Tracer`), or `None`."""
    pending: list[Any] = attrs.field(factory=list)
    """Draws to admit before new ones (resumed holes)."""
    after_weights: Callable[[int], None] | None = None
    """Called with the engine's weight version between requests (`None`: nothing)."""
    _groups: dict[int, Batch] = attrs.field(factory=dict, init=False)
    _calls_in_step: dict[int, int] = attrs.field(factory=dict, init=False)
    _weight_load_s: float = attrs.field(default=0.0, init=False)
    sent_groups: list[tuple[int, int, int]] = attrs.field(factory=list, init=False)
    """`(group_id, step, trainer dp-rank)` of every group sent (tests, checkpoints)."""

    def _trainer_ranks(self) -> tuple[int, ...]:
        return tuple(self.trainer_layout.global_ranks)

    def _span(self, name: str, **args: Any) -> Any:
        import contextlib

        return (
            self.spans.span(f"rollout/{name}", **args) if self.spans else contextlib.nullcontext()
        )

    def apply_weights(self, wait: float | None = None) -> None:
        """Applies the newest complete weight version, waiting up to `wait` s for one."""
        version = self.weights.poll(timeout=wait)
        if version is not None and version > self.engine.weight_version:
            start = time.perf_counter()
            with self._span("load weights", version=version), self.activity.track("busy"):
                self.weights.apply(self.engine, version)
            self._weight_load_s += time.perf_counter() - start

    def _admit(self) -> list[Any]:
        limit = self.prompts_per_call or self.scheduler.quota
        needed = self.steps * self.scheduler.quota - (
            self.scheduler.sealed_steps() * self.scheduler.quota
            + self.scheduler.filled
            + len(self.scheduler.in_flight)
            + len(self.scheduler.finished)
        )
        draws: list[Any] = []
        trainer_version = max(self.weights.latest_announced, 0)
        while len(draws) < min(limit, needed) and self.scheduler.can_admit(
            self.engine.weight_version, trainer_version
        ):
            draw = self.pending.pop(0) if self.pending else self.draw(1)[0]
            self.scheduler.admit(draw.position, self.engine.weight_version, trainer_version)
            draws.append(draw)
        return draws

    def run(self) -> None:
        """Runs until every step is sealed or the trainers stop, then stops the data channel.

        The trainers stop early in a graceful stop (Ctrl-C).
        """
        beat = Heartbeat(
            sender=self.sender, targets=self._trainer_ranks(), interval=self.heartbeat_s
        ).start()
        try:
            while self.scheduler.sealed_steps() < self.steps and not self.weights.stopped:
                self.apply_weights()
                self._after_weights()
                draws = self._admit()
                if not draws:
                    with self._span("wait (staleness bound)"), self.activity.track("idle"):
                        self.apply_weights(wait=0.5)
                    if self.weights.stopped:
                        break
                    continue
                self._generate(draws)
                self._stream()
        finally:
            beat.stop()
        for dst in self._trainer_ranks():
            self.sender.send(dst, Kind.STOP)
        self.sender.flush()
        while not self.weights.stopped:  # drain weights until the trainers are done
            self.apply_weights(wait=0.5)
            self._after_weights()

    def _after_weights(self) -> None:
        if self.after_weights is not None:
            self.after_weights(self.engine.weight_version)

    def _generate(self, draws: list[Any]) -> None:
        open_step = self.scheduler.sealed_steps()
        call = self._calls_in_step.get(open_step, 0)
        self._calls_in_step[open_step] = call + 1
        sampling = self.sampling_for(open_step, call)
        with self._span("generate", prompts=len(draws)), self.activity.track("busy"):
            batch = self.generate(draws, sampling, lambda: self.apply_weights())
            for group in split_groups(batch):
                group = self.per_group(group)
                gid = int(group.group_id[0])
                self._groups[gid] = group
                self.scheduler.finish(gid)

    def _stream(self) -> None:
        """Sends the groups placed now: one message per (step, trainer dp-rank), then seals.

        Groups that finished together travel together (one pack, one message: with one
        generate call per step, a step's groups reach a trainer as one batch); a group
        finishing on its own still leaves at once.
        """
        before = self.scheduler.sealed_steps()
        outgoing: dict[tuple[int, int], list[Batch]] = {}
        for placed in self.scheduler.assign_finished():
            group = self._groups.pop(placed.group_id)
            dp = self.balancer.assign_group(placed.step, group)
            outgoing.setdefault((placed.step, dp), []).append(group)
            self.sent_groups.append((placed.group_id, placed.step, dp))
        for (step, dp), groups in outgoing.items():
            payload = pack_batch(groups[0] if len(groups) == 1 else Batch.concat(groups))
            for dst in self.trainer_layout.ranks_of_dp(dp):
                self.sender.send(dst, Kind.GROUP, a=step, payload=payload)
        for step in range(before, self.scheduler.sealed_steps()):
            self._seal(step)

    def _seal(self, step: int) -> None:
        busy, idle = self.activity.take()
        report = encode_payload(
            {
                "busy": busy,
                "idle": idle,
                "in_flight": len(self.scheduler.in_flight),
                "finished": len(self.scheduler.finished),
                "weight_load_s": self._weight_load_s,
                "version": self.engine.weight_version,
                "skipped_versions": self.weights.skipped,
            }
        )
        self._weight_load_s = 0.0
        counts = self.balancer.groups.get(step, [0] * self.trainer_layout.dp)
        for dp in range(self.trainer_layout.dp):
            for dst in self.trainer_layout.ranks_of_dp(dp):
                self.sender.send(dst, Kind.SEAL, a=step, b=counts[dp], payload=report)
        self.balancer.forget_before(step)


def make_generate(
    engine: Any, generate_batch: Callable[..., Batch], *,
    partial_rollout: bool, chunk_tokens: int, multi_turn: bool = False,
) -> Callable[[Sequence[Any], Any, Callable[[], None]], Batch]:
    """Returns the rollout's generate function, optionally generating in segments.

    Args:
        engine: This rank's rollout engine.
        generate_batch: `f(engine, draws, sampling, **agent_args) -> batch`, the worker's
            batch builder (`WorkerRuntime.generate_batch`).
        partial_rollout: Generate in chunks, applying new weights between them.
        chunk_tokens: Tokens per chunk.
        multi_turn: `generate_batch` runs agent episodes (`peerflow.agents.rollout`): it
            calls `between` between turns (and chunks) itself and fills `token_versions`.
    """
    if multi_turn:

        def episodes(draws: Sequence[Any], sampling: Any, between: Callable[[], None]) -> Batch:
            return generate_batch(engine, draws, sampling, between=between,
                                  chunk_tokens=chunk_tokens if partial_rollout else 0)

        return episodes
    if not partial_rollout:

        def plain(draws: Sequence[Any], sampling: Any, between: Callable[[], None]) -> Batch:
            return generate_batch(engine, draws, sampling)

        return plain

    class _Segmented:
        """Adapts `generate_in_segments` to the engine interface `generate_batch` calls."""

        def __init__(self, between: Callable[[], None]) -> None:
            self.between = between
            self.segments: list[tuple[tuple[int, int], ...]] = []

        @property
        def weight_version(self) -> int:
            return min((s[0][1] for s in self.segments if s), default=engine.weight_version)

        def generate(self, requests: Sequence[Any], sampling: Any) -> list[Any]:
            results = generate_in_segments(
                engine, requests, sampling, chunk_tokens=chunk_tokens, between_chunks=self.between
            )
            self.segments = [r.version_segments for r in results]
            return results

    def segmented(draws: Sequence[Any], sampling: Any, between: Callable[[], None]) -> Batch:
        proxy = _Segmented(between)
        batch = generate_batch(proxy, draws, sampling)
        return attach_segments(batch, proxy.segments) if len(batch) else batch

    return segmented
