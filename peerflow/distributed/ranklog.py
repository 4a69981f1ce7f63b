"""Each worker's own log file, `RUN_DIR/logs/rank{N}.log`: full tracebacks and fault notes.

A worker's exception reaches the user as one line through the failure record; the whole
traceback goes here (and so does the stack of a stage stuck past its deadline), so the
launcher can print where to look.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

_PATH: Path | None = None


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` of a run writes its log."""
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def open_rank_log(run_dir: str | Path, rank: int) -> Path:
    """Makes this process write its log for `rank` under `run_dir`; returns the path."""
    global _PATH
    _PATH = rank_log_path(run_dir, rank)
    return _PATH


def append_to_rank_log(text: str) -> None:
    """Appends a time-stamped entry to this process's log (nothing before `open_rank_log`).

    Never raises: logging must not hide the failure being logged.
    """
    if _PATH is None:
        return
    with contextlib.suppress(OSError):
        _PATH.parent.mkdir(parents=True, exist_ok=True)
        with _PATH.open("a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text.rstrip()}\n")
