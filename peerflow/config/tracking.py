"""`run.trackers`: the options of the metric trackers `run.wandb` and `run.mlflow` switch on.

Every tracker gets the same records as `metrics.jsonl` (`peerflow.outputs.trackers`):

    run:
      wandb: true
      mlflow: true
      trackers:
        wandb: {project: rl, entity: my-team, name: grpo-lr1e-6, tags: [grpo], group: sweep-3}
        mlflow: {tracking_uri: http://mlflow:5000, experiment: rl}

A tracker switched on without its package is a `config validate` error
(`tracker_problems`); options given for a tracker that is off are printed as a note when
the run starts (`unused_options`), so a W&B project is not set and then silently unused.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import attrs

#: The module each optional tracker needs, and the extra that installs it.
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


@attrs.frozen(kw_only=True)
class WandbOptions:
    """Weights & Biases (`pip install 'peerflow[wandb]'`), used when `run.wandb` is true."""

    project: str | None = None
    """W&B project the run is logged to (default: `$WANDB_PROJECT`, else `peerflow`)."""
    entity: str | None = None
    """W&B team or user owning the project (default: `$WANDB_ENTITY`, else the logged-in
    user's default)."""
    name: str | None = None
    """Display name of the run (default: `$WANDB_NAME`, else the run directory's name)."""
    group: str | None = None
    """Group the run belongs to, runs of one sweep or experiment shown together (default:
    `$WANDB_RUN_GROUP`)."""
    tags: tuple[str, ...] = ()
    """Tags of the run (default: `$WANDB_TAGS`, comma-separated)."""
    notes: str | None = None
    """A longer description of the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """`online`, `offline` (written under `RUN_DIR/wandb`, `wandb sync` later) or
    `disabled` (default: the `WANDB_MODE` environment variable, else online)."""


@attrs.frozen(kw_only=True)
class MlflowOptions:
    """MLflow (`pip install 'peerflow[mlflow]'`), used when `run.mlflow` is true."""

    tracking_uri: str | None = None
    """Where runs are recorded: a server (`http://host:5000`), a database (`sqlite:///x.db`,
    needs the full `mlflow` package) or a directory (default: `$MLFLOW_TRACKING_URI`,
    else the local file store `RUN_DIR/mlruns`)."""
    experiment: str = "peerflow"
    """MLflow experiment the run is logged to (created when missing)."""
    run_name: str | None = None
    """Display name of the run (default: the run directory's name)."""
    tags: dict[str, str] = attrs.Factory(dict)
    """Tags of the run."""


@attrs.frozen(kw_only=True)
class TrackersConfig:
    """Options of the trackers beside `metrics.jsonl` (switched by `run.wandb`, `run.mlflow`)."""

    wandb: WandbOptions = attrs.Factory(WandbOptions)
    """Weights & Biases options (`run.wandb: true` turns it on)."""
    mlflow: MlflowOptions = attrs.Factory(MlflowOptions)
    """MLflow options (`run.mlflow: true` turns it on)."""


def missing_package(name: str) -> str | None:
    """The install hint for tracker `name` (`wandb`, `mlflow`) when its package is missing."""
    module, extra = PACKAGES[name]
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"run.{name} is true but the {module} package is not installed; "
            f"pip install 'peerflow[{extra}]' (or set run.{name}: false).")


def tracker_problems(run: Any) -> list[str]:
    """Trackers switched on without their package: one message each, naming the install.

    Args:
        run: The `RunSettings` (`run.wandb`, `run.mlflow`).
    """
    return [problem for name in PACKAGES
            if getattr(run, name) and (problem := missing_package(name)) is not None]


def unused_options(run: Any) -> list[str]:
    """Tracker options set for a tracker that is off: one note each, naming the switch.

    A note, not an error: a resumed run may switch a tracker off while its saved config
    still holds the options.
    """
    notes = []
    for name, default in (("wandb", WandbOptions()), ("mlflow", MlflowOptions())):
        options = getattr(run.trackers, name)
        if options != default and not getattr(run, name):
            changed = [f.name for f in attrs.fields(type(options))
                       if getattr(options, f.name) != getattr(default, f.name)]
            notes.append(f"run.trackers.{name} sets {', '.join(changed)}, but run.{name} is "
                         f"false: nothing goes there (set run.{name}: true to log there).")
    return notes
