"""The lockstep (sync) schedule: this rank's program, in order, step after step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import attrs

from peerflow.batch import Batch
from peerflow.worker.metrics import StepMetrics
from peerflow.worker.nodes import run_node
from peerflow.worker.program import RankProgram, RouteStep
from peerflow.worker.runtime import WorkerRuntime


@contextlib.contextmanager
def timed(metrics: StepMetrics, name: str, stage: Any = None) -> Iterator[None]:
    """Times a phase into `time/<name>` (max over ranks) inside an optional fault stage."""
    start = time.perf_counter()
    with stage if stage is not None else contextlib.nullcontext():
        yield
    metrics.max(f"time/{name}", time.perf_counter() - start)


def run_step(rt: WorkerRuntime, program: RankProgram, *, stage_factory: Any = None,
             tracer: Any = None) -> tuple[Batch, StepMetrics]:
    """Runs one step of this rank's program; returns its batch and this rank's metrics.

    Args:
        rt: This rank's runtime (its `step` already set to the step being run).
        program: This rank's program (workflow nodes and `RouteStep`s, in order).
        stage_factory: `f(name, deadline) -> context manager` marking the fault stage
            (names the node in the message peers print if this rank dies or gets stuck
            there; `peerflow.distributed.stage`); `None` for none.
        tracer: Optional per-rank timeline recorder with `span(name)`.
    """
    metrics = StepMetrics()
    batch = Batch.empty()
    start = time.perf_counter()
    for item in program.steps:
        kind = "route" if isinstance(item, RouteStep) else item.kind
        stage = stage_factory(f"step {rt.step} {item.name}",
                              rt.config.runtime.stage_deadline(kind)) if stage_factory else None
        span = tracer.span(item.name) if tracer is not None else contextlib.nullcontext()
        with span, timed(metrics, item.name.replace(" ", "_"), stage):
            if isinstance(item, RouteStep):
                batch = item.run(batch, metrics,
                                 shared_prompts=item.consumers_share_prompts(rt.prompt_sharing))
            else:
                batch = run_node(rt, item, batch, metrics)
    metrics.max("time/step", time.perf_counter() - start)
    return batch, metrics


@attrs.define(eq=False)
class LockstepSchedule:
    """Sync mode: every rank runs its whole program each step; all ranks checkpoint."""

    rt: WorkerRuntime
    program: RankProgram
    stage: Any = None
    """`peerflow.distributed.stage`, naming the node a dying rank was running."""
    name: str = "lockstep"
    group: Any = None
    reports: bool = attrs.field(init=False)
    _stopping: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self.reports = self.rt.rank == 0

    def restore(self, resumed: Any) -> None:
        """Rewinds this rank's prompt cursor and brings the rollout engine up to date."""
        if resumed.driver_state is not None:
            self.rt.sampler.load_state_dict(resumed.driver_state["sampler"])
        if self.program.has_kind("sync_weights"):
            self.rt.sync_weights()

    def state(self) -> dict[str, Any]:
        """This rank's prompt cursor."""
        return {"sampler": self.rt.sampler.state_dict()}

    def inflight(self) -> None:
        """Nothing is in flight between lockstep steps."""

    def stop(self) -> None:
        """Runs no step after the one yielded last (every rank agreed on it)."""
        self._stopping = True

    def steps(self, start_step: int, tracer: Any) -> Iterator[tuple[int, Batch, StepMetrics]]:
        """Runs steps `start_step + 1 … run.steps` in lockstep with every other rank."""
        for step in range(start_step + 1, self.rt.config.run.steps + 1):
            if self._stopping:
                return
            self.rt.step = step
            batch, metrics = run_step(self.rt, self.program, stage_factory=self.stage,
                                      tracer=tracer)
            yield step, batch, metrics
