"""What a run writes: its directory, metrics, TensorBoard/W&B, checkpoints, traces, plots.

* `create_run_dir`, `write_resolved_config` — the run directory (`rundir`).
* `MetricsWriter` — `metrics.jsonl` + TensorBoard + W&B; metric names in `metrics`.
* `save_tensors`, `atomic_directory`, `update_latest` — checkpoint helpers (`checkpoints`).
* `Tracer`, `span` — per-rank Chrome-trace timelines (`trace`).
* `StepProgress` — the progress bar (`progress`).
* `render_report` — PNG plots of a run (`report`), behind `peerflow report`.
"""

from peerflow.outputs.checkpoints import (
    atomic_directory,
    load_tensors,
    read_latest,
    save_tensors,
    should_checkpoint,
    update_latest,
)
from peerflow.outputs.metrics import MetricsWriter, read_metrics
from peerflow.outputs.progress import StepProgress
from peerflow.outputs.rundir import create_run_dir, write_resolved_config
from peerflow.outputs.trace import Tracer, get_tracer, set_tracer, span

__all__ = [
    "MetricsWriter",
    "StepProgress",
    "Tracer",
    "atomic_directory",
    "create_run_dir",
    "get_tracer",
    "load_tensors",
    "read_latest",
    "read_metrics",
    "save_tensors",
    "set_tracer",
    "should_checkpoint",
    "span",
    "update_latest",
    "write_resolved_config",
]
