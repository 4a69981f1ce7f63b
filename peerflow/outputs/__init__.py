"""What a run writes: its directory, metrics, TensorBoard/W&B, checkpoints, traces, plots.

* `create_run_dir`, `write_resolved_config`, `RunLock` — the run directory (`rundir`).
* `MetricsWriter` — `metrics.jsonl` + TensorBoard + W&B; metric names in `metrics`.
* `Tracer`, `span` — per-rank Chrome-trace timelines (`trace`).
* `StepProgress` — the progress bar (`progress`).
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
