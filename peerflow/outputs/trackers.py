"""Metric trackers beside `metrics.jsonl`: TensorBoard, Weights & Biases, MLflow.

Every tracker implements one small interface (`Tracker`): `log(step, record)` gets each
record `metrics.jsonl` gets (its `null`s left out), `log_samples(step, records, kind)`
the samples `RUN_DIR/samples/` gets (a table: TensorBoard text, a W&B table, an MLflow
artifact), `close(failed)` ends the run there, and `location` says where to look (the
end-of-run summary prints it). `open_trackers`
opens the ones `run.tensorboard`, `run.wandb` and `run.mlflow` switch on, with the
options of `run.trackers` (`peerflow.config.tracking`). A switched-on tracker whose
package is missing is refused with the install command (`peerflow config validate`
says so before a run starts); TensorBoard, a default dependency, only warns.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from peerflow.config.tracking import TrackersConfig, missing_package, unused_options
from peerflow.errors import ConfigError

TENSORBOARD_DIR = "tb"
#: Seconds between TensorBoard's writes to disk (and at close).
TENSORBOARD_FLUSH_S = 5
#: Where an MLflow run's id is kept, so that a resumed run continues the same MLflow run.
MLFLOW_RUN_FILE = "mlflow_run.json"
#: Sample fields the trackers show, in this order (`peerflow.outputs.samples`).
SAMPLE_COLUMNS = ("step", "mode", "sample_id", "group_id", "reward", "advantage",
                  "finish_reason", "response_tokens", "num_turns", "prompt", "response",
                  "components")


def sample_table(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The columns the records have (of `SAMPLE_COLUMNS`) and one row per record.

    `components` (each reward's score) is written as a JSON object in one cell.
    """
    columns = [c for c in SAMPLE_COLUMNS if any(c in r for r in records)]
    rows = [[json.dumps(r.get(c)) if c == "components" else r.get(c) for c in columns]
            for r in records]
    return columns, rows


class Tracker(Protocol):
    """Where a run's metrics go besides `metrics.jsonl`."""

    name: str
    """`tensorboard`, `wandb` or `mlflow`."""

    def log(self, step: int, record: Mapping[str, float | int]) -> None:
        """Records one step's scalars (no `step` key, no `None` values)."""

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]], kind: str) -> None:
        """Records the samples of `step` as a table (`kind`: `train` or `eval`)."""

    def close(self, failed: bool = False) -> None:
        """Flushes and ends the run here (`failed`: the run ended with an error)."""

    @property
    def location(self) -> str:
        """Where to look at the run (a directory, a URL)."""


class TensorBoardTracker:
    """TensorBoard event files under `RUN_DIR/tb`, one event per step."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard.writer import FileWriter

        self.directory = run_dir / TENSORBOARD_DIR
        # The writer's own thread writes events to disk every few seconds; flushing at
        # every step instead made the reporting rank wait for that thread each step.
        self._writer = FileWriter(str(self.directory), flush_secs=TENSORBOARD_FLUSH_S)

    def log(self, step: int, record: Mapping[str, float | int]) -> None:
        """Writes every scalar of the step as one TensorBoard `Summary`.

        Each value is what `SummaryWriter.add_scalar` writes (`simple_value`); one event
        per step instead of one per metric saves the reporting rank ~50 protobuf events
        and writer-thread hand-offs a step, while the rest of the job waits for it.
        """
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=name, simple_value=float(value))
                                 for name, value in record.items()])
        self._writer.add_summary(summary, global_step=step)

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]], kind: str) -> None:
        """Writes the samples as a Markdown table (TensorBoard's Text tab, `samples/<kind>`)."""
        from torch.utils.tensorboard.summary import text

        columns, rows = sample_table(records)

        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        table = [" | ".join(columns), " | ".join("---" for _ in columns)]
        table += [" | ".join(cell(v) for v in row) for row in rows]
        self._writer.add_summary(text(f"samples/{kind}", "\n".join(table)), global_step=step)

    def close(self, failed: bool = False) -> None:
        """Writes the pending events."""
        self._writer.close()

    @property
    def location(self) -> str:
        """`tensorboard --logdir RUN_DIR/tb`."""
        return f"tensorboard --logdir {self.directory}"


class WandbTracker:
    """A Weights & Biases run with the options of `run.trackers.wandb`.

    The run's id is the run directory's name, so a resumed run continues the same W&B
    run (`resume="allow"`); W&B writes its files under `RUN_DIR/wandb`.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, options: Any, config: Any = None) -> None:
        import wandb

        # options left unset fall back to W&B's environment variables (WANDB_PROJECT, …)
        self.run = wandb.init(
            project=options.project or os.environ.get("WANDB_PROJECT") or "peerflow",
            entity=options.entity, group=options.group, tags=list(options.tags) or None,
            name=options.name or os.environ.get("WANDB_NAME") or run_dir.name,
            notes=options.notes, mode=options.mode, dir=str(run_dir), config=config,
            resume="allow", id=re.sub(r"[^\w.-]", "-", run_dir.name))

    def log(self, step: int, record: Mapping[str, float | int]) -> None:
        """Logs the step's scalars at `step`."""
        self.run.log(dict(record), step=step)

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]], kind: str) -> None:
        """Logs the samples as a `wandb.Table` under `samples/<kind>`."""
        import wandb

        columns, rows = sample_table(records)
        self.run.log({f"samples/{kind}": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool = False) -> None:
        """Finishes the W&B run (exit code 1 when the run failed)."""
        self.run.finish(exit_code=1 if failed else 0)

    @property
    def location(self) -> str:
        """The run's URL, or its offline directory and the `wandb sync` command."""
        if self.run.settings.mode == "offline":
            offline = Path(self.run.dir).parent
            return f"W&B offline in {offline} (upload: wandb sync {offline})"
        return f"W&B {self.run.url or self.run.dir}"


def _flatten(plain: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(plain, Mapping):
        out: dict[str, str] = {}
        for key, value in plain.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(plain) if not isinstance(plain, str) else plain}


class MlflowTracker:
    """An MLflow run with the options of `run.trackers.mlflow`, through `MlflowClient`.

    A new run records the resolved config as parameters (dotted keys) and as the
    artifact `config.json`; its id goes to `RUN_DIR/mlflow_run.json`, so a resumed run
    logs into the same MLflow run. Metric names keep MLflow's characters (`/`, `.`,
    `-`, `_`, letters, digits, spaces); any other character becomes `_`. Without a
    tracking URI the run is kept in the local file store `RUN_DIR/mlruns`, which
    MLflow 3 keeps in maintenance mode and opens only with `MLFLOW_ALLOW_FILE_STORE`
    set; it is set for a file store PeerFlow writes (`mlflow ui --backend-store-uri
    RUN_DIR/mlruns` shows it).
    """

    name = "mlflow"

    def __init__(self, run_dir: Path, options: Any, config: Any = None) -> None:
        from mlflow.tracking import MlflowClient

        uri = (options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (run_dir / "mlruns").resolve().as_uri())
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(options.experiment)
        self.experiment_id = (experiment.experiment_id if experiment is not None
                              else self.client.create_experiment(options.experiment))
        record = run_dir / MLFLOW_RUN_FILE
        saved = json.loads(record.read_text()) if record.is_file() else {}
        if saved.get("tracking_uri") == uri:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(self.experiment_id, run_name=options.run_name or
                                     run_dir.name, tags=dict(options.tags))
        self.run_id = run.info.run_id
        record.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        if config is not None:
            from mlflow.entities import Param

            params = [Param(k, v[:6000]) for k, v in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 params a batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])
            self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, record: Mapping[str, float | int]) -> None:
        """Logs the step's scalars at `step` (one batch of up to 1000 metrics each)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(re.sub(r"[^\w./\- ]", "_", k), float(v), now, step)
                   for k, v in record.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]], kind: str) -> None:
        """Logs the samples as the artifact `samples/<kind>_step_<step>.jsonl`."""
        text = "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in records)
        self.client.log_text(self.run_id, text, f"samples/{kind}_step_{step}.jsonl")

    def close(self, failed: bool = False) -> None:
        """Marks the MLflow run finished (or failed)."""
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    @property
    def location(self) -> str:
        """The tracking URI, experiment and run id."""
        return f"MLflow {self.uri}, experiment {self.experiment_id}, run {self.run_id}"


def open_trackers(run_dir: Path, config: Any = None, *, tensorboard: bool | None = None,
                  wandb: bool | None = None, mlflow: bool | None = None) -> list[Tracker]:
    """The trackers the config switches on (keyword arguments override the switches).

    Raises:
        ConfigError: W&B or MLflow is switched on but its package is missing (naming the
            `pip install` command).
    """
    settings = getattr(config, "run", None)
    wanted = {
        "tensorboard": tensorboard if tensorboard is not None
        else getattr(settings, "tensorboard", True),
        "wandb": wandb if wandb is not None else getattr(settings, "wandb", False),
        "mlflow": mlflow if mlflow is not None else getattr(settings, "mlflow", False),
    }
    for name in ("wandb", "mlflow"):
        problem = missing_package(name) if wanted[name] else None
        if problem is not None:
            raise ConfigError(problem)
    if settings is not None:
        for note in unused_options(settings):
            print(f"peerflow: {note}", file=sys.stderr, flush=True)
    plain = None
    if config is not None and (wanted["wandb"] or wanted["mlflow"]):
        from peerflow.config import unstructure

        plain = unstructure(config)
    options = getattr(settings, "trackers", None) or TrackersConfig()
    trackers: list[Tracker] = []
    try:
        if wanted["tensorboard"]:
            try:
                trackers.append(TensorBoardTracker(run_dir))
            except ImportError as exc:  # tensorboard missing: keep the JSONL going
                print(f"peerflow: TensorBoard disabled ({exc}); pip install tensorboard",
                      file=sys.stderr)
        if wanted["wandb"]:
            trackers.append(WandbTracker(run_dir, options.wandb, plain))
        if wanted["mlflow"]:
            trackers.append(MlflowTracker(run_dir, options.mlflow, plain))
    except BaseException:
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    return trackers
