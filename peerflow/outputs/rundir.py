"""The run directory: created once, holding the resolved config and everything else.

Layout (what the other `peerflow.outputs` modules write)::

    RUN_DIR/
        config.yaml          the resolved config (defaults filled in, overrides applied)
        metrics.jsonl        one JSON object per logged step (`step` + metrics)
        tb/                  TensorBoard events
        trace_rank{r}.json   Chrome-trace timeline of rank r (chrome://tracing, Perfetto)
        checkpoints/         see `peerflow.worker.checkpoint`
        report/              PNG plots from `peerflow report RUN_DIR`
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
DEFAULT_ROOT = "runs"


def create_run_dir(
    run_dir: str | Path | None = None, *, root: str | Path = DEFAULT_ROOT, name: str = "run",
    now: dt.datetime | None = None,
) -> Path:
    """Creates (or reuses) the run directory and returns it.

    Args:
        run_dir: The directory to use; created if missing, reused if it exists.
        root: Parent of a fresh directory when `run_dir` is `None`.
        name: Prefix of a fresh directory's name.
        now: Timestamp of a fresh directory (default: the current UTC time).

    Returns:
        `run_dir`, or a fresh `root/<name>-YYYYmmdd-HHMMSS[-k]` that did not exist before
        (a suffix `-k` keeps two runs started in the same second apart).
    """
    if run_dir is not None:
        path = Path(run_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    for k in range(1000):
        path = root / (f"{name}-{stamp}" + (f"-{k}" if k else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"could not create a fresh run directory under {root}.")


def write_resolved_config(run_dir: str | Path, config: Any) -> Path:
    """Writes the resolved config to `RUN_DIR/config.yaml` (atomically) and returns it.

    Args:
        run_dir: The run directory.
        config: A `RunConfig`, or plain data (a mapping) already resolved.
    """
    import yaml

    from peerflow.config import dump_config

    text = dump_config(config) if not isinstance(config, dict) else yaml.safe_dump(
        config, sort_keys=False)
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
