"""The step loop every worker runs: its program's nodes, in order, step after step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from peerflow.batch import Batch
from peerflow.worker.executors import executor_for
from peerflow.worker.metrics import StepMetrics, all_reduce_metrics
from peerflow.worker.program import RouteStep
from peerflow.worker.runtime import WorkerRuntime


def record_batch_metrics(batch: Batch, metrics: StepMetrics) -> None:
    """Records reward, length and token-count metrics of this rank's samples."""
    n = len(batch)
    if not n:
        return
    if "reward" in batch:
        reward = batch["reward"].float()
        metrics.mean("reward/mean", float(reward.mean()), n)
        metrics.mean("reward/_sq", float((reward**2).mean()), n)
        metrics.max("reward/max", float(reward.max()))
        metrics.min("reward/min", float(reward.min()))
    if "score" in batch:
        metrics.mean("score/mean", float(batch["score"].float().mean()), n)
    if "response_ids" in batch:
        lengths = batch.lengths("response_ids").float()
        metrics.mean("response_length/mean", float(lengths.mean()), n)
        metrics.max("response_length/max", float(lengths.max()))
        metrics.sum("tokens/response", float(lengths.sum()))
    if "prompt_ids" in batch:
        metrics.sum("tokens/prompt", float(batch.lengths("prompt_ids").sum()))
        metrics.mean("prompt_length/mean", float(batch.lengths("prompt_ids").float().mean()), n)
    if "finish_reason" in batch:
        clipped = sum(1 for r in batch["finish_reason"] if r == "length")
        metrics.mean("response_length/clip_frac", clipped / n, n)
    metrics.sum("samples", n)


def finish_metrics(reduced: dict[str, float], step: int) -> dict[str, float]:
    """Derives the metrics that need cross-rank totals (std, throughput) and adds `step`."""
    out = dict(reduced)
    if "reward/_sq" in out:
        mean = out.get("reward/mean", 0.0)
        out["reward/std"] = max(out.pop("reward/_sq") - mean * mean, 0.0) ** 0.5
    if "advantages/_sq" in out:
        mean = out.get("advantages/mean", 0.0)
        out["advantages/std"] = max(out.pop("advantages/_sq") - mean * mean, 0.0) ** 0.5
    tokens = out.get("tokens/prompt", 0.0) + out.get("tokens/response", 0.0)
    out["tokens/total"] = tokens
    step_s = out.get("time/step", 0.0)
    if step_s > 0:
        out["throughput/tokens_per_s"] = tokens / step_s
        out["throughput/samples_per_s"] = out.get("samples", 0.0) / step_s
    return {"step": step, **dict(sorted(out.items()))}


@contextlib.contextmanager
def timed(metrics: StepMetrics, name: str, stage: Any = None) -> Iterator[None]:
    """Times a phase into `time/<name>` (max over ranks) inside an optional fault stage."""
    start = time.perf_counter()
    with stage if stage is not None else contextlib.nullcontext():
        yield
    metrics.max(f"time/{name}", time.perf_counter() - start)


def run_step(
    rt: WorkerRuntime,
    steps: Sequence[Any],
    *,
    node_types: dict[str, type] | None = None,
    stage_factory: Any = None,
    tracer: Any = None,
) -> tuple[Batch, dict[str, float]]:
    """Runs one step of this rank's program and returns its batch and reduced metrics.

    Args:
        rt: This rank's runtime (its `step` already set to the step being run).
        steps: Workflow nodes and route steps (`RouteStep.run(batch)`), in program order.
        node_types: Registered plugin node types by kind.
        stage_factory: `f(name, deadline) -> context manager` marking the fault stage
            (names the node in the message peers print if this rank dies or gets stuck
            there; `peerflow.distributed.stage`); `None` for none.
        tracer: Optional per-rank timeline recorder with `span(name)`.
    """
    metrics = StepMetrics()
    batch = Batch.empty()
    start = time.perf_counter()
    for item in steps:
        kind = "route" if isinstance(item, RouteStep) else item.kind
        stage = stage_factory(f"step {rt.step} {item.name}",
                              rt.config.runtime.stage_deadline(kind)) if stage_factory else None
        span = tracer.span(item.name) if tracer is not None else contextlib.nullcontext()
        with span, timed(metrics, item.name.replace(" ", "_"), stage):
            if isinstance(item, RouteStep):
                batch = item.run(batch)
            else:
                run = executor_for(item.kind, (node_types or {}).get(item.kind))
                batch = run(rt, item, batch, metrics)
    metrics.max("time/step", time.perf_counter() - start)
    record_batch_metrics(batch, metrics)
    reduced = all_reduce_metrics(metrics)
    return batch, finish_metrics(reduced, rt.step)
