"""`drive`: the one run driver of both modes (pytest's single `runtestprotocol` is the model).

A *schedule* decides what a rank does inside steps: `LockstepSchedule` (sync: the
program's nodes and routes in order, every step; `peerflow.worker.loop`) or the streaming
schedules of async mode (`RolloutSchedule`, `TrainerSchedule`;
`peerflow.worker.async_schedule`). The driver owns what every run has once, on every rank:

1. resume (`--resume`): the newest complete checkpoint's engines — every trainable role
   this rank hosts — and RNG, then the schedule's own saved state (`Schedule.restore`);
2. outputs: the per-rank tracer, and on the schedule's reporting rank the metrics writer
   (`metrics.jsonl`, TensorBoard, W&B) and the progress bar;
3. for each step the schedule finishes: reduce its metrics over the schedule's group, run
   the driver hooks (`DriverHook.end_step`, e.g. evaluation), write the metrics, call the
   plugins' `peerflow_end_of_step`, and checkpoint every `run.checkpoint_every` steps and
   at the end (the schedule's ranks together; `Schedule.state` is saved beside the engines).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs

from peerflow.batch import Batch
from peerflow.errors import ConfigError
from peerflow.worker import checkpoint as ckpt
from peerflow.worker.metrics import (
    StepMetrics,
    all_reduce_metrics,
    finish_metrics,
    record_batch_metrics,
)
from peerflow.worker.runtime import WorkerRuntime
from peerflow.workflow.roles import trainable_roles


class Schedule(Protocol):
    """What one rank does within steps; `drive` does everything else."""

    name: str
    """Fault stage of the whole run on this rank (`step N <node>` stages nest inside)."""
    group: Any
    """Process group whose ranks reduce step metrics and checkpoint together (None: world)."""
    ranks: tuple[int, ...]
    """Global ranks of `group`; the lowest writes the checkpoint's `COMPLETE` marker."""
    reports: bool
    """This rank writes `metrics.jsonl` and draws the progress bar."""

    def restore(self, step: int, states: Mapping[int, dict[str, Any]]) -> None:
        """Takes back the state saved at `step` (`states`: every saving rank's `state()`)."""

    def state(self) -> dict[str, Any]:
        """This rank's schedule state to checkpoint (JSON-ready)."""

    def steps(self, start_step: int, tracer: Any) -> Iterator[tuple[int, Batch, StepMetrics]]:
        """Runs steps `start_step + 1 …`, yielding `(step, batch, metrics)` as each ends."""


class DriverHook(Protocol):
    """Per-run work beside the schedule (evaluation, extra outputs); all methods optional."""

    def begin(self, rt: WorkerRuntime, start_step: int) -> None:
        """Called before the first step."""

    def end_step(self, rt: WorkerRuntime, step: int, metrics: dict[str, float]) -> None:
        """Called after each step, before its metrics are written (may add some)."""

    def end(self, rt: WorkerRuntime) -> None:
        """Called when the run ends, also on error."""


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
            if start_step:
                ckpt.truncate_metrics(rt.run_dir / "metrics.jsonl", start_step)
            writer = MetricsWriter(rt.run_dir, rt.config, tensorboard=run.tensorboard,
                                   wandb=run.wandb)
        progress = StepProgress(run.steps, start=start_step, enabled=reports)
        rt.progress = progress
        return cls(tracer=tracer, writer=writer, progress=progress)

    def write(self, step: int, metrics: dict[str, float], run: Any) -> None:
        """Writes a step's metrics (every `run.log_every` steps and the last)."""
        if self.writer is not None and (step % max(run.log_every, 1) == 0 or step == run.steps):
            self.writer.write(step, metrics)
        self.progress.update(step, metrics)

    def close(self) -> None:
        """Flushes the timeline and closes the writer."""
        from peerflow.outputs import set_tracer

        self.progress.close()
        self.tracer.flush()
        set_tracer(None)
        if self.writer is not None:
            self.writer.close()


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
    if resuming:
        with stage("resume"):
            start_step = _restore(rt, schedule)
    elif ckpt.latest_checkpoint(rt.run_dir):
        raise ConfigError(
            f"run directory {str(rt.run_dir)!r} already holds checkpoints; continue it with "
            f"`peerflow train --resume {rt.run_dir}`, or pick another --run-dir."
        )
    else:
        start_step = 0
    rt.step = start_step
    outputs = RunOutputs.open(rt, start_step, reports=schedule.reports)
    for hook in hooks:
        getattr(hook, "begin", lambda *a: None)(rt, start_step)
    every, last = rt.config.run.checkpoint_every, rt.config.run.steps
    try:
        with stage(schedule.name), contextlib.closing(
                schedule.steps(start_step, outputs.tracer)) as steps:
            for step, batch, metrics in steps:
                rt.step = step
                record_batch_metrics(batch, metrics)
                reduced = finish_metrics(all_reduce_metrics(metrics, schedule.group), step)
                for hook in hooks:
                    getattr(hook, "end_step", lambda *a: None)(rt, step, reduced)
                outputs.write(step, reduced, rt.config.run)
                rt.pm.hook.peerflow_end_of_step(step=step, metrics=reduced, rank=rt.rank)
                if (every and step % every == 0) or step == last:
                    deadline = rt.config.runtime.stage_deadline("checkpoint")
                    with stage(f"checkpoint step {step}", deadline), \
                            outputs.tracer.span("checkpoint"):
                        _save(rt, step, schedule)
    finally:
        for hook in hooks:
            getattr(hook, "end", lambda *a: None)(rt)
        outputs.close()


def _hosted_trainable(rt: WorkerRuntime) -> list[tuple[str, Any]]:
    return [(role, rt.engines[role]) for role in trainable_roles() if role in rt.engines]


def _save(rt: WorkerRuntime, step: int, schedule: Schedule) -> None:
    """Every rank of the schedule: its trainable engines, RNG and schedule state."""
    from peerflow.distributed import barrier

    directory = ckpt.checkpoint_dir(rt.run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    barrier(schedule.group, what=f"checkpoint step {step}")
    for role, engine in _hosted_trainable(rt):
        engine.save_checkpoint(str(directory / role))
    ckpt.write_json_atomic(directory / f"worker_rank{rt.rank}.json", {
        "step": step, "rng": ckpt.rng_state(), "time": time.time(), **schedule.state(),
    })
    barrier(schedule.group, what=f"checkpoint step {step}")
    if rt.rank == min(schedule.ranks):
        ckpt.write_json_atomic(directory / ckpt.COMPLETE, {"step": step})


def _restore(rt: WorkerRuntime, schedule: Schedule) -> int:
    """Loads the newest complete checkpoint into this rank; returns its step."""
    step, directory = ckpt.find_resume_checkpoint(rt.run_dir)
    for role, engine in _hosted_trainable(rt):
        engine.load_checkpoint(str(directory / role))
    states = {int(path.stem.removeprefix("worker_rank")): json.loads(path.read_text())
              for path in directory.glob("worker_rank*.json")}
    if rt.rank in states:
        ckpt.set_rng_state(states[rt.rank]["rng"])
    schedule.restore(step, states)
    return step
