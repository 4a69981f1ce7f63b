"""What a run writes and prints: its directory, metrics, trackers, traces, lines, plots.

* `create_run_dir`, `write_resolved_config`, `RunLock` — the run directory (`rundir`).
* `MetricsWriter` — `metrics.jsonl` + the trackers (TensorBoard, W&B, MLflow:
  `trackers`); metric names in `metrics`.
* `Tracer`, `span` — per-rank Chrome-trace timelines (`trace`).
* `StepProgress` — the progress bar and the run's lines (`progress`); the step,
  evaluation and end-of-run summary lines themselves (`console`).
* `render_report` — PNG plots of a run (`report`), behind `peerflow report`.
"""

from peerflow.outputs.metrics import MetricsWriter, read_metrics
from peerflow.outputs.progress import StepProgress
from peerflow.outputs.rundir import RunLock, create_run_dir, write_resolved_config
from peerflow.outputs.trace import Tracer, get_tracer, set_tracer, span

__all__ = [
    "MetricsWriter",
    "RunLock",
    "StepProgress",
    "Tracer",
    "create_run_dir",
    "get_tracer",
    "read_metrics",
    "set_tracer",
    "span",
    "write_resolved_config",
]
