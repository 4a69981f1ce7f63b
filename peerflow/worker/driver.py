"""`drive`: the one run driver of both modes (pytest's single `runtestprotocol` is the model).

A *schedule* decides what a rank does inside steps: `LockstepSchedule` (sync: the
program's nodes and routes in order, every step; `peerflow.worker.loop`) or the streaming
schedules of async mode (`RolloutSchedule`, `TrainerSchedule`;
`peerflow.worker.async_schedule`). The driver owns what every run has once, on every rank:

1. resume (`--resume`): `peerflow.checkpoint.restore_latest` loads the newest verified
   checkpoint's engines (every trainable role this rank hosts) and RNG, then the schedule
   takes back its own state (`Schedule.restore`);
2. outputs: the per-rank tracer, and on the schedule's reporting rank the metrics writer
   (`metrics.jsonl` and the trackers: TensorBoard, W&B, MLflow) and the progress bar,
   which prints a line per logged step and per evaluation (`peerflow.outputs.console`);
3. for each step the schedule finishes: write `run.samples_per_step` of its samples
   (`samples/step_N.jsonl`, `peerflow.worker.samples`), reduce its metrics over the
   schedule's group, run
   the driver hooks (`DriverHook.end_step`, e.g. evaluation), write the metrics, watch
   the rewards' failures (`RewardWatch`: stop when one fails on everything; a tally at
   the end, non-zero past `task.reward_limits.max_failure_share`) and the agents'
   (`AgentWatch`: name each step's failures, stop after `rollout.agent.fatal_after_steps`
   steps whose every episode failed), call the
   plugins' `peerflow_end_of_step`, and checkpoint every `run.checkpoint_every` steps and
   at the end (`peerflow.checkpoint.save_step` on the schedule's ranks together, with
   `Schedule.state` and `Schedule.inflight` beside the engines);
4. at the end of the run (or of a graceful stop) the reporting rank prints the summary:
   rewards, evaluations, the checkpoint, samples and trackers, the commands to run next;
5. a graceful stop (first Ctrl-C or SIGTERM, `peerflow.distributed.stop`): each rank
   adds whether it has seen the request to the step's metrics exchange, so the
   schedule's ranks agree on the same stop step; they checkpoint it when cheap
   (`runtime.stop_checkpoint`, and the run's slowest save so far took at most half of
   `runtime.stop_grace`), publish where they stopped, and end the schedule
   (`Schedule.stop`: async trainers stop their rollout ranks as at the end of a run).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import attrs

from peerflow.batch import Batch
from peerflow.checkpoint import (
    Resumed,
    list_checkpoints,
    restore_latest,
    save_step,
    should_checkpoint,
    truncate_metrics,
)
from peerflow.errors import ConfigError
from peerflow.training.memory import rank_device, record_peak, reset_peak
from peerflow.worker.agent_watch import AgentWatch
from peerflow.worker.graceful_stop import GracefulStop
from peerflow.worker.metrics import (
    MetricsExchange,
    SignalWatch,
    StepMetrics,
    finish_metrics,
    record_batch_metrics,
)
from peerflow.worker.reward_watch import RewardWatch
from peerflow.worker.runtime import WorkerRuntime
from peerflow.worker.samples import write_step_samples


class Schedule(Protocol):
    """What one rank does within steps; `drive` does everything else."""

    name: str
    """Fault stage of the whole run on this rank (`step N <node>` stages nest inside)."""
    group: Any
    """Process group whose ranks reduce step metrics and checkpoint together (None: world)."""
    reports: bool
    """This rank writes `metrics.jsonl` and draws the progress bar."""

    def restore(self, resumed: Resumed) -> None:
        """Takes back this rank's state from a restored checkpoint (engines are loaded)."""

    def state(self) -> dict[str, Any] | None:
        """This rank's own state to checkpoint (JSON-ready; `None`: none)."""

    def inflight(self) -> dict[str, Any] | None:
        """The run's in-flight streaming state, the same on every saving rank (or `None`)."""

    def steps(self, start_step: int, tracer: Any) -> Iterator[tuple[int, Batch, StepMetrics]]:
        """Runs steps `start_step + 1 …`, yielding `(step, batch, metrics)` as each ends."""

    def stop(self) -> None:
        """Ends `steps` after the step it yielded last (a graceful stop)."""


class DriverHook(Protocol):
    """Per-run work beside the schedule (e.g. `EvalHook`); every method is optional.

    `begin` and `end_step` may return extra metrics; the driver then writes that step
    (`begin`'s as step `start_step`) whatever `run.log_every` says.
    """

    def begin(self, rt: WorkerRuntime, start_step: int) -> dict[str, float] | None:
        """Called on every rank before the first step."""

    def end_step(self, rt: WorkerRuntime, step: int, metrics: dict[str, float]
                 ) -> dict[str, float] | None:
        """Called on every rank after each step, before its metrics are written."""

    def end(self, rt: WorkerRuntime) -> None:
        """Called on every rank when the run ends, also on error."""


@attrs.define(eq=False)
class RunOutputs:
    """The tracer of every rank; the metrics writer and progress bar of the reporting rank."""

    tracer: Any
    writer: Any = None
    progress: Any = None

    @classmethod
    def open(cls, rt: WorkerRuntime, start_step: int, *, reports: bool) -> RunOutputs:
        """Starts the outputs (dropping metrics past `start_step` left by a crashed run)."""
        from peerflow.outputs import MetricsWriter, StepProgress, Tracer, set_tracer

        run = rt.config.run
        tracer = Tracer(rt.run_dir, rt.rank, enabled=run.trace)
        set_tracer(tracer)
        writer = None
        if reports:
            # a resume, or a torchrun restart before the first checkpoint (start_step 0)
            truncate_metrics(rt.run_dir / "metrics.jsonl", start_step)
            writer = MetricsWriter(rt.run_dir, rt.config)
        progress = StepProgress(run.steps, start=start_step, enabled=reports)
        rt.progress = progress
        return cls(tracer=tracer, writer=writer, progress=progress)

    def write(self, step: int, metrics: dict[str, float], run: Any, *, force: bool = False
              ) -> None:
        """Writes and prints a step's metrics: every `run.log_every` steps, the last, `force`.

        The progress bar moves every step.
        """
        due = step % max(run.log_every, 1) == 0 or step == run.steps
        if self.writer is not None and (due or force):
            self.writer.write(step, metrics)
        self.progress.update(step, metrics, line=due or force)
        if self.writer is not None and any(name.startswith("eval/") for name in metrics):
            from peerflow.outputs.samples import read_samples

            with contextlib.suppress(FileNotFoundError):  # evaluation wrote its samples
                self.mirror_samples(step, read_samples(self.writer.run_dir, step,
                                                       evaluation=True)[1], kind="eval")

    def mirror_samples(self, step: int, records: list[dict[str, Any]], kind: str = "train"
                       ) -> None:
        """Hands the samples the reporting rank wrote to the trackers (a table each)."""
        if self.writer is not None:
            self.writer.log_samples(step, records, kind)

    def summarize(self, rt: WorkerRuntime, step: int, seconds: float, start: int) -> None:
        """Prints the end-of-run summary on the reporting rank (`console.run_summary`)."""
        if self.writer is None:
            return
        from peerflow.checkpoint import newest_complete
        from peerflow.outputs import read_metrics
        from peerflow.outputs.console import run_summary

        found = newest_complete(rt.run_dir)
        self.progress.print(run_summary(
            rt.run_dir, read_metrics(self.writer.path), step=step, total=rt.config.run.steps,
            seconds=seconds, mode=rt.config.runtime.mode,
            checkpoint=str(found.path) if found is not None else None,
            trackers=[t.location for t in self.writer.trackers], start=start))

    def close(self, failed: bool = False) -> None:
        """Flushes the timeline and closes the writer (`failed`: the run raised)."""
        from peerflow.outputs import set_tracer

        self.progress.close()
        self.tracer.flush()
        set_tracer(None)
        if self.writer is not None:
            self.writer.close(failed=failed)


def drive(rt: WorkerRuntime, schedule: Schedule, stage: Any, *, resuming: bool = False,
          hooks: Sequence[DriverHook] = ()) -> None:
    """Runs a whole run on this rank: resume, steps, outputs, hooks, checkpoints.

    Args:
        rt: This rank's runtime (engines built).
        schedule: The rank's schedule (lockstep or streaming).
        stage: `peerflow.distributed.stage`, naming what a dying rank was doing.
        resuming: Continue from the newest complete checkpoint in `rt.run_dir`.
        hooks: Driver hooks, called in order.

    Raises:
        ConfigError: not resuming, but the run directory already holds checkpoints.
    """
    start_step = 0
    if resuming:
        with stage("resume"):
            start_step = _restore(rt, schedule)
    elif list_checkpoints(rt.run_dir):
        raise ConfigError(
            f"run directory {str(rt.run_dir)!r} already holds checkpoints; continue it with "
            f"`peerflow train --resume {rt.run_dir}`, or pick another --run-dir."
        )
    rt.step = start_step
    outputs = RunOutputs.open(rt, start_step, reports=schedule.reports)
    run = rt.config.run
    stopping = GracefulStop(enabled=rt.config.runtime.stop_checkpoint,
                            grace=rt.config.runtime.stop_grace)
    exchange = MetricsExchange(group=schedule.group)
    began, failed = time.perf_counter(), True
    try:
        initial = _call(hooks, "begin", rt, start_step)
        if initial:
            outputs.write(start_step, initial, run, force=True)
        with stage(schedule.name), contextlib.closing(
                schedule.steps(start_step, outputs.tracer)) as steps:
            since, signal = time.perf_counter(), SignalWatch()
            device = rank_device()
            reset_peak(device)
            reward_watch = RewardWatch.from_config(rt.config, rt.run_dir)
            agent_watch = AgentWatch.from_config(rt.config, rt.run_dir,
                                                 reports=schedule.reports)
            for step, batch, metrics in steps:
                # The loop's wall time, per step: this step and the previous step's driver
                # work (metrics, hooks, checkpoint) — what a user waits for in the loop.
                now = time.perf_counter()
                metrics.max("time/iteration", now - since)
                record_peak(metrics, device)  # memory/peak_*_gib, max over ranks
                since = now
                rt.step = step
                record_batch_metrics(batch, metrics)
                outputs.mirror_samples(step, write_step_samples(
                    rt, step, batch, group=schedule.group, reports=schedule.reports))
                stopping.offer(metrics)
                reduced = finish_metrics(exchange.reduce(metrics), step)
                if schedule.reports:
                    signal.check(step, reduced)
                stop_now = stopping.agreed(reduced)
                extra = _call(hooks, "end_step", rt, step, reduced)
                reduced.update(extra)
                outputs.write(step, reduced, run, force=bool(extra))
                reward_watch.check(step, reduced)  # a reward failing on everything stops
                agent_watch.check(step, reduced)  # so do episodes that all fail
                rt.pm.hook.peerflow_end_of_step(step=step, metrics=reduced, rank=rt.rank)
                saved = should_checkpoint(step, run.checkpoint_every, run.steps)
                if saved or (stop_now and stopping.cheap):
                    stopping.timed(functools.partial(_save, rt, schedule, stage,
                                                     outputs.tracer, step))
                    saved = True
                if stop_now and step < run.steps:
                    stopping.publish(step, saved=saved)
                    schedule.stop()
        failed = False
        outputs.summarize(rt, rt.step, time.perf_counter() - began, start_step)
        reward_watch.finish(reports=schedule.reports)
    finally:
        _call(hooks, "end", rt)
        outputs.close(failed=failed)


def _save(rt: WorkerRuntime, schedule: Schedule, stage: Any, tracer: Any, step: int) -> None:
    """Checkpoints `step` on the schedule's ranks together (the one checkpoint API)."""
    run = rt.config.run
    with stage(f"checkpoint step {step}", rt.config.runtime.stage_deadline("checkpoint")), \
            tracer.span("checkpoint"):
        save_step(rt.run_dir, step, engines=rt.engines, rank=rt.rank,
                  driver_state=schedule.state(), inflight=schedule.inflight(),
                  group=schedule.group, keep_last=run.keep_last)


def _call(hooks: Sequence[DriverHook], method: str, *args: Any) -> dict[str, float]:
    """Calls `method` on every hook having it, in order; returns the metrics they add."""
    added: dict[str, float] = {}
    for hook in hooks:
        added.update(getattr(hook, method, lambda *a: None)(*args) or {})
    return added


def _restore(rt: WorkerRuntime, schedule: Schedule) -> int:
    """Loads the newest verified checkpoint into this rank (every rank); returns its step."""
    resumed = restore_latest(rt.run_dir, engines=rt.engines, rank=rt.rank)
    if resumed is None:
        raise ConfigError(
            f"--resume {str(rt.run_dir)!r}: no verified checkpoint under "
            f"{rt.run_dir / 'checkpoints'}; a run saves one every run.checkpoint_every steps "
            "and at its end. Start a fresh run instead, or pick another run directory."
        )
    schedule.restore(resumed)
    return resumed.step
