"""`runtime.mode: async`: the two streaming schedules the run driver runs.

The planner gives every node of the async program its phase
(`peerflow.planner.streaming`); rollout and trainer ranks are disjoint and meet only
through p2p streams. `streaming_schedule` (every rank, collectively) opens the stream
channel and returns, driving the run's `WeightSyncService` (`rt.weight_sync`):

* on rollout ranks a `RolloutSchedule`: `RolloutStreamer` generates (phase `generate`),
  runs the `per_group` nodes on each finished group and streams it to a trainer; it
  reports no steps (the trainers do), but meets the trainers' evaluation (the driver's
  `EvalHook`) with the weights of each step it is due after;
* on trainer ranks a `TrainerSchedule`: `TrainerStreamer` runs the `per_micro_batch`
  nodes as micro-batches fill and the `per_step` nodes on each whole step, pushes new
  weights asynchronously, and yields every finished step to the driver, which reduces
  and writes its metrics and checkpoints.

A checkpoint's in-flight state (`peerflow.checkpoint.inflight`) is `trained_groups`
(rollout rank → prompt groups trained on any trainer rank). On resume a rollout rank
replays its prompt stream past them and queues the prompts that were in flight to be
generated again first, so no prompt is lost and no sample is trained twice.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from peerflow.batch import Batch
from peerflow.checkpoint.inflight import replay_prompts, trained_groups, trained_groups_state
from peerflow.worker.metrics import StepMetrics
from peerflow.worker.nodes import run_node
from peerflow.worker.program import RankProgram
from peerflow.worker.runtime import WorkerRuntime


@attrs.frozen(kw_only=True)
class StreamLink:
    """What both sides of the streams share: the run's weight sync and the peer-wait timeout."""

    service: Any
    """The run's `WeightSyncService` (`rt.weight_sync`), driven by the streaming push."""
    timeout: float = 60.0


def streaming_schedule(rt: WorkerRuntime, program: RankProgram, stage: Any,
                       evaluation: Any = None) -> Any:
    """Returns this rank's streaming schedule (call on every rank: it is collective).

    Args:
        rt: This rank's runtime.
        program: This rank's program.
        stage: `peerflow.distributed.stage`.
        evaluation: The driver's `EvalHook`, which rollout ranks call when they have
            loaded a step's weights (trainer ranks get it from the driver).
    """
    timeout = rt.config.runtime.peer_wait_timeout
    link = StreamLink(service=rt.weight_sync, timeout=timeout)
    if "rollout" in rt.engines:
        return RolloutSchedule(rt=rt, program=program, link=link, stage=stage,
                               evaluation=evaluation)
    return TrainerSchedule(rt=rt, program=program, link=link, stage=stage)


def _runner(rt: WorkerRuntime, nodes: Sequence[Any], stage: Any
            ) -> Callable[[Batch, StepMetrics], Batch]:
    """Runs `nodes` in order, each as a fault stage with its kind's deadline."""
    def run(batch: Batch, metrics: StepMetrics) -> Batch:
        for node in nodes:
            with stage(f"{node.name} (async)", rt.config.runtime.stage_deadline(node.kind)):
                batch = run_node(rt, node, batch, metrics)
        return batch

    return run


@attrs.define(eq=False)
class RolloutSchedule:
    """A rollout rank of an async run: generate, score per group, stream; no steps."""

    rt: WorkerRuntime
    program: RankProgram
    link: StreamLink
    stage: Any
    """`peerflow.distributed.stage`: every node runs as a stage with its deadline."""
    name: str = "async rollout"
    group: Any = None
    reports: bool = False
    pending: list[Any] = attrs.field(factory=list)
    """Draws to generate before new ones (prompts in flight at the checkpoint)."""
    evaluation: Any = None
    """The driver's `EvalHook` (`end_step(rt, step, metrics)`), or `None`."""
    _evaluated: int = attrs.field(default=0, init=False)
    """The newest weight version handed to `evaluation` (or the step the run starts at)."""

    def restore(self, resumed: Any) -> None:
        """Replays the prompt stream past what the trainers have trained."""
        trained = trained_groups(resumed.inflight).get(self.rt.rank, [])
        self.pending = replay_prompts(self.rt.sampler, trained)

    def state(self) -> None:
        """Nothing: rollout ranks do not checkpoint."""

    def inflight(self) -> None:
        """Nothing: the trainers save the in-flight state."""

    def stop(self) -> None:
        """Nothing: a rollout rank stops when the trainers stop its streams."""

    def steps(self, start_step: int, tracer: Any) -> Iterator[tuple[int, Batch, StepMetrics]]:
        """Streams groups until the trainers stop its streams; yields nothing."""
        self._evaluated = start_step  # the driver's `begin` evaluated the start
        self._streamer(start_step, tracer).run()
        yield from ()

    def _after_weights(self, version: int) -> None:
        """Evaluates after step `version` when due, as the trainers' driver does then.

        A trainer pushes a step's weights before its driver evaluates that step, and
        pushes no newer ones until the evaluation (a collective over every rank) is done,
        so each due version is loaded here before any newer one.
        """
        if self.evaluation is not None and version > self._evaluated:
            self._evaluated = version
            self.evaluation.end_step(self.rt, version, {})

    def _streamer(self, start_step: int, tracer: Any) -> Any:
        from peerflow.rollout.generate import step_seed
        from peerflow.rollout.sampler import split_evenly
        from peerflow.streaming.assignment import TokenBalancer
        from peerflow.streaming.rollout_loop import RolloutStreamer, make_generate
        from peerflow.streaming.staleness import StalenessScheduler
        from peerflow.streaming.transport import DATA_TAG, WEIGHT_TAG, StreamReceiver, StreamSender
        from peerflow.streaming.weight_push import WeightReceiver

        rt, cfg, link = self.rt, self.rt.config, self.link
        layout = self.program.layouts["rollout"]
        trainer_layout = self.program.placement["actor"]
        per_group = _runner(rt, self.program.nodes("per_group"), self.stage)
        engine = rt.engine("rollout")
        runtime = cfg.runtime
        chunk = runtime.partial_rollout_tokens or max(cfg.rollout.sampling.max_tokens // 4, 1)
        receiver = StreamReceiver(sources=tuple(sorted(link.service.plan.sources)),
                                  tag=WEIGHT_TAG, timeout=link.timeout,
                                  what="weights")
        return RolloutStreamer(
            engine=engine,
            generate=make_generate(engine, rt.generate_batch,
                                   partial_rollout=runtime.partial_rollout, chunk_tokens=chunk,
                                   multi_turn=rt.agent is not None),
            draw=rt.sampler.draw,
            sampling_for=lambda open_step, call: cfg.rollout.sampling.to_params(
                seed=step_seed(cfg.seed, open_step + 1, rt.dp_rank, call)),
            per_group=lambda batch: per_group(batch, StepMetrics()),
            scheduler=StalenessScheduler(
                max_staleness=runtime.max_staleness, next_step=start_step,
                quota=split_evenly(cfg.run.prompts_per_step, layout.dp, layout.dp_rank(rt.rank))),
            balancer=TokenBalancer(num_consumers=trainer_layout.dp,
                                   source_index=layout.dp_rank(rt.rank),
                                   shared_prompts=rt.prompt_sharing.get("actor", False)),
            trainer_layout=trainer_layout,
            sender=StreamSender(tag=DATA_TAG, timeout=link.timeout),
            weights=WeightReceiver(service=link.service, receiver=receiver.start()).start(),
            steps=cfg.run.steps, rank=rt.rank,
            prompts_per_call=runtime.async_prompts_per_call,
            heartbeat_s=max(link.timeout / 6, 0.5), spans=tracer, pending=self.pending,
            after_weights=self._after_weights,
        )


def _add_stream_metrics(metrics: StepMetrics, extra: dict[str, float], samples: int) -> None:
    for name, value in extra.items():
        if name.endswith("max") or name.startswith("queue/"):
            metrics.max(name, value)
        elif name.startswith("staleness/"):
            metrics.mean(name, value, max(samples, 1))
        else:
            metrics.mean(name, value)


@attrs.define(eq=False)
class TrainerSchedule:
    """A trainer rank of an async run: collect each step from the stream, train, push."""

    rt: WorkerRuntime
    program: RankProgram
    link: StreamLink
    stage: Any
    """`peerflow.distributed.stage`: every node runs as a stage with its deadline."""
    name: str = "async trainer"
    trained: dict[int, list[int]] = attrs.field(factory=dict)
    """Rollout rank → prompt groups this rank has trained (checkpointed)."""
    _streamer: Any = attrs.field(default=None, init=False)
    _stopping: bool = attrs.field(default=False, init=False)

    @property
    def group(self) -> Any:
        """The trainer ranks' group (metrics reduce and checkpoints barrier over it)."""
        return self.program.process_group("actor")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The trainer ranks."""
        return tuple(self.program.layouts["actor"].global_ranks)

    @property
    def reports(self) -> bool:
        """The first trainer rank writes the metrics."""
        return self.rt.rank == min(self.ranks)

    def restore(self, resumed: Any) -> None:
        """Takes back the record of trained groups."""
        self.trained = trained_groups(resumed.inflight)

    def state(self) -> None:
        """Nothing of its own beyond the engines and RNG."""

    def inflight(self) -> dict[str, Any]:
        """Every group trained so far on any trainer rank, by rollout rank (collective)."""
        from peerflow.distributed.comm import all_gather_values

        for source, gids in self._streamer.trained_groups.items():
            self.trained.setdefault(source, []).extend(gids)
        self._streamer.trained_groups.clear()
        mine: list[Any] = [self.trained]
        if len(self.ranks) > 1:  # each trainer dp-rank trained its own share
            mine = all_gather_values(self.trained, self.group,
                                     what="async: the groups each trainer rank trained")
        merged: dict[int, list[int]] = {}
        for trained in mine:
            for source, gids in trained.items():
                merged.setdefault(source, []).extend(gids)
        return trained_groups_state(merged)

    def stop(self) -> None:
        """Trains no step after the one yielded last (a graceful stop).

        The streams end as at the run's end: the rollout ranks stop, and groups they
        generated beyond that step are not trained.
        """
        self._stopping = True

    def steps(self, start_step: int, tracer: Any) -> Iterator[tuple[int, Batch, StepMetrics]]:
        """Trains steps `start_step + 1 … run.steps` as their samples stream in."""
        from peerflow.streaming.transport import (
            DATA_TAG,
            WEIGHT_TAG,
            Heartbeat,
            Kind,
            StreamReceiver,
            StreamSender,
        )
        from peerflow.streaming.weight_push import WeightPusher

        rt, link = self.rt, self.link
        sources = tuple(self.program.placement["rollout"].global_ranks)
        sender = StreamSender(tag=WEIGHT_TAG, timeout=link.timeout)
        pusher = WeightPusher(service=link.service, sender=sender)
        receiver = StreamReceiver(sources=sources, tag=DATA_TAG,
                                  timeout=link.timeout).start()
        self._streamer = self._make_streamer(receiver, sources, start_step, tracer,
                                             functools.partial(pusher.push, rt.engine("actor")))
        beat = Heartbeat(sender=sender, targets=sources,
                         interval=max(link.timeout / 6, 0.5)).start()
        try:
            if start_step:  # the rollout engines start from the initial weights
                pusher.push(rt.engine("actor"), start_step)
            started = time.time()
            for step, batch, metrics, extra in self._streamer.run():
                _add_stream_metrics(metrics, extra, len(batch))
                metrics.max("time/step", time.time() - started)
                yield step + 1, batch, metrics
                if self._stopping:
                    break
                started = time.time()
        finally:
            beat.stop()
        pusher.drain()
        for dst in sources:
            sender.send(dst, Kind.STOP)
        sender.flush()
        while not receiver.all_stopped:  # groups beyond the last step are not trained
            receiver.get(timeout=0.5)
        receiver.join()

    def _make_streamer(self, receiver: Any, sources: tuple[int, ...], start_step: int,
                       tracer: Any, push: Callable[[int], Any]) -> Any:
        from peerflow.streaming.accumulator import MicroBatchAccumulator, StepInbox
        from peerflow.streaming.samplers import MicroBatchBudget
        from peerflow.streaming.trainer_loop import TrainerStreamer

        cfg = self.rt.config
        return TrainerStreamer(
            receiver=receiver,
            inbox=StepInbox(sources=sources),
            accumulator=MicroBatchAccumulator(
                sampler=self.rt.pm.get("sampler", cfg.runtime.sampler)(),
                budget=MicroBatchBudget(max_tokens=cfg.trainer.micro_batch_tokens),
            ),
            per_micro_batch=_runner(self.rt, self.program.nodes("per_micro_batch"), self.stage),
            per_step=_runner(self.rt, self.program.nodes("per_step"), self.stage),
            push=push,
            new_metrics=StepMetrics,
            steps=cfg.run.steps,
            rank=self.rt.rank,
            stream_micro_batches=len(self.ranks) == 1,
            sync_every=max(cfg.weight_sync.every, 1),
            start_step=start_step,
            spans=tracer,
            max_staleness=cfg.runtime.max_staleness,
        )
